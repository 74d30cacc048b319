"""Evaluation: LIBERO success rate across checkpoints (env workers, the scripted expert, recording with DART and
DAgger), the held-out action error, previews, probes, the replay oracle, and the policy adapter; `dz eval ...`."""
