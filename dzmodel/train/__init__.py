"""Training: the trainer and its one step, FSDP2 and compile from outside the model, checkpoints and exact resume,
conversion to a model directory, the encoder cache, the device-resident data path and vision pretraining; `dz train`,
`dz cache` and `dz convert` (cli.py)."""
