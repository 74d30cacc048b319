"""Deployment: the versioned Franka bundle (`dz package`), the policy server (`dz serve`, openpi and RoboArena
protocols) and its protocol client; `dz client` (`dzmodel.control`) drives a robot through it. The policy it serves
comes from `dzmodel.policy`; evaluation is a sibling, neither imports the other."""
