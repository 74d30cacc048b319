"""Evaluation: LIBERO success rate across checkpoints, and the policy adapter."""
