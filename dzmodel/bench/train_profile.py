"""Where a training step's GPU time goes: `python -m dzmodel.bench.train_profile [layers] [mbs] [compile] [ac]`.

Profiles one step of the same configuration `dz bench train` times (dreamzero_5b, DROID shape, cached encoders)."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from .train_bench import build_train_step


def main(layers: int = 4, mbs: int = 32, compile: bool = True, ac: str = "full") -> None:
    step, _, _ = build_train_step("dreamzero_5b", layers, mbs, compile, ac, "flex", "cache")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 4, int(a[1]) if len(a) > 1 else 32, (a[2] != "0") if len(a) > 2 else True,
         a[3] if len(a) > 3 else "full")
