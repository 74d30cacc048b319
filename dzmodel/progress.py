"""Progress bars for long work (training, conversion, statistics, evaluation): tqdm on stderr when it is
installed, nothing otherwise (the GPU image may lack it). Inside `report_to(log)` (a pipeline stage run as a
Prefect task) every bar also writes a line to that log now and then, so the task's own log shows how far it is."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

REPORT_EVERY_S = 30.0  # a task log line per bar at most this often (and one when it completes)
_SINKS: list[tuple[Callable[[str], None], float]] = []


@contextmanager
def report_to(log: Callable[[str], None], every_s: float | None = None) -> Iterator[None]:
    """While inside, each new Progress bar also reports to `log`: at most one line per `every_s` seconds (default
    REPORT_EVERY_S), and a last one when it completes."""
    _SINKS.append((log, REPORT_EVERY_S if every_s is None else every_s))
    try:
        yield
    finally:
        _SINKS.pop()


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
        self.total, self.done, self.start, self.desc, self.unit = total, initial, initial, desc, unit
        self.sink = _SINKS[-1] if _SINKS else None
        self.started = self.reported = time.monotonic()

    def update(self, metrics: dict[str, float] | None = None, n: int = 1) -> None:
        """`n` units done; `metrics` (a training step's) adds the loss and throughput to the bar."""
        if self.bar is not None:
            if metrics is not None:
                self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", sps=f"{metrics['samples_per_s_per_gpu']:.2f}",
                                     refresh=False)
            self.bar.update(n)
        self.done += n
        if self.sink is not None:
            now = time.monotonic()
            if now - self.reported >= self.sink[1] or self.done >= self.total:
                self.reported = now
                self.sink[0](self._line(now, metrics))

    def _line(self, now: float, metrics: dict[str, float] | None) -> str:
        rate = (self.done - self.start) / max(now - self.started, 1e-9)
        left = f", ~{(self.total - self.done) / rate:.0f} s left" if rate > 0 and self.done < self.total else ""
        loss = f", loss {metrics['loss']:.4f}" if metrics and "loss" in metrics else ""
        return (f"{self.desc}: {self.done}/{self.total} {self.unit}s ({100 * self.done / max(self.total, 1):.0f} %, "
                f"{rate:.2f} {self.unit}/s{left}{loss})")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
