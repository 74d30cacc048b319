"""Deployment: the versioned Franka bundle (`dz package`), the policy server (`dz serve`, openpi and RoboArena
protocols) and its clients (`dz client`)."""
