"""One training process from the TrainConfig JSON the train stage writes, as torchrun starts it:

    python -m dzmodel.train.launch --config runs/<profile>/train_config.json

It is `dz train --config` without the command line's other options, so that the train stage's code is what this
module imports, not the whole CLI (the stage table derives each stage's code from its imports)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import TrainConfig


def run(config: TrainConfig, overwrite: bool = False) -> list[dict]:
    """Train; rank 0 prints the last step's losses and throughput."""
    from .trainer import train

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before any CUDA allocation
    history = train(config, overwrite=overwrite)
    if history and int(os.environ.get("RANK", "0")) == 0:
        last = history[-1]
        print(f"step {last['step']}: loss {last['loss']:.4f} (dynamics {last['dynamics_loss']:.4f}, "
              f"action {last['action_loss']:.4f}), {last['samples_per_s_per_gpu']:.2f} samples/s/GPU")
    return history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dzmodel.train.launch", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path, help="a TrainConfig JSON (what the train stage writes)")
    ns = ap.parse_args(argv)
    try:
        config = TrainConfig.from_dict(json.loads(ns.config.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        print(f"dz train: error: {ns.config}: {exc}", file=sys.stderr)
        return 2
    try:
        run(config)
    except (ValueError, FileNotFoundError) as exc:  # bad data or config found while training: one line, as `dz train`
        print(f"dz train: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
