"""Per-step metrics and the sinks they go to (JSONL; the pipeline streams the file to MLflow).

MFU = achieved model FLOPs / peak. Model FLOPs follow reference §3.3 (`dzmodel.model.flops`): 3 x forward
per sample. Activation recompute is NOT counted (it is hardware work, not model work), so enabling
recompute lowers MFU for the same step time.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Protocol

from ..progress import Progress  # noqa: F401 - the trainer's bar; re-exported for its users

import torch

PEAK_FLOPS = {"cuda": 989e12, "cpu": 1e12}  # H100 dense bf16; the CPU figure is nominal (MFU on CPU is not meaningful)


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"step": n, "loss": ..., ...}. Appends, so a resumed run continues the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": step, **metrics}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)
