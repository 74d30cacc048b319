"""Training: the SFT step now; FSDP2, checkpoints, conversion and the encoder cache with the trainer issue."""
