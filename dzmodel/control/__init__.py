"""Control nodes: the robot side of a policy server. `dz client` drives the LIBERO Panda (the simulated Franka, from
the evaluation's env workers) through any server of the protocol, or prints a dry run's actions. Above both
`serve` (its protocol client) and `eval` (the LIBERO env), which import nothing from each other."""
