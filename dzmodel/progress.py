"""Progress bars for long work (training, conversion, statistics, evaluation): tqdm on stderr when it is
installed, nothing otherwise (the GPU image may lack it)."""

from __future__ import annotations

import sys


class Progress:
    """A progress bar on stderr (tqdm when available), showing the latest loss and throughput."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train", unit: str = "step"):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                                dynamic_ncols=True)
            except ImportError:
                self.bar = None
        self.enabled = enabled

    def update(self, metrics: dict[str, float] | None = None, n: int = 1) -> None:
        """`n` units done; `metrics` (a training step's) adds the loss and throughput to the bar."""
        if self.bar is not None:
            if metrics is not None:
                self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", sps=f"{metrics['samples_per_s_per_gpu']:.2f}",
                                     refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
