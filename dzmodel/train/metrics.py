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

# Dense bf16 peak FLOP/s per GPU model, matched by name in this order. A CPU, or a GPU not listed, reports no MFU
# rather than a made-up one.
PEAK_BF16_FLOPS = (("B200", 2250e12), ("B100", 1750e12), ("H200", 989e12), ("H100", 989e12), ("H800", 989e12),
                   ("L40S", 362e12), ("A100", 312e12), ("A800", 312e12), ("L40", 181e12), ("A10", 125e12),
                   ("L4", 121e12))


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"step": n, "loss": ..., ...}. Appends, so a resumed run continues the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():  # a kill mid-write can leave half a row: drop it, so every line stays one JSON row
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):
                with open(self.path, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        self._f = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": step, **metrics}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:  # this process's own peak RSS; ru_maxrss would also count a parent's size at fork (Linux keeps it on exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20  # KiB -> GiB
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)
