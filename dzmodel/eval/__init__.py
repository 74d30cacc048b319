"""Evaluation: LIBERO success rate across checkpoints (env workers, the scripted expert, recording with DART and
DAgger), the held-out action error, previews, probes and the replay oracle; `dz eval ...`. The policy it evaluates
comes from `dzmodel.policy`; serving is a sibling, neither imports the other."""
