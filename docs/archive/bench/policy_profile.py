"""Where one action chunk's time goes at the deployed setting (16 solver steps, DiT caching, CFG 5, bf16 weights,
CUDA graphs, compiled block), through the serving path (`predict_batch`), on the device machine:

    python docs/archive/bench/policy_profile.py [--preset dreamzero_5b] [--batch 1] [--compile-mode MODE ...] [--out F.jsonl]

For each compile mode (default: the policy's own), one JSON line: p50 / p95 of timed calls, and one profiled call
with its stages synchronised at their edges: per stage the wall time, the GPU's busy time (the union of its kernels'
intervals), the kernel count and the time by kind of kernel, and the call's slowest kernels. Busy well below wall
means the host (launches, Python, copies) holds the GPU up; busy near wall with few matmul milliseconds means the
kernels themselves are slow for their work. --trace DIR writes each profiled call's Chrome trace there."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dzmodel.bench.policy_bench import PolicySetting, _configure, _observations, random_policy
from dzmodel.model.wan_dit import WanAttentionBlock

KINDS = (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "splitk")),
         ("attention", ("flash", "fmha", "attention", "cudnn")),
         ("conv", ("conv", "implicit", "winograd", "dgrad", "wgrad")),
         ("compiled", ("triton_",)),
         ("copy", ("copy", "memcpy", "memset", "cat", "index")),
         ("norm/reduce", ("norm", "reduce", "softmax")))


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other elementwise")


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, milliseconds out)."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


class ProfiledStages:
    """policy.timer stand-in: synchronises at every stage edge and marks the stage for the profiler."""

    def start_call(self) -> None:
        pass

    @contextmanager
    def stage(self, name: str):
        torch.cuda.synchronize()
        with record_function(f"stage:{name}"):
            yield
            torch.cuda.synchronize()


def profile_call(policy, rng, batch: int, trace: Path | None, tag: str) -> dict:
    obs = _observations(policy, rng, batch, "bench")
    policy.timer = ProfiledStages()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        policy.predict_batch(obs)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    policy.timer = None
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"policy_{tag}.json"))
    events = prof.events()
    # the GPU side of the annotations (the stages', compiled regions') spans kernels: count kernels only
    kernels = [e for e in events if e.device_type.name == "CUDA" and not e.is_user_annotation
               and e.time_range.end > e.time_range.start]
    stages = sorted((e.name.removeprefix("stage:"), e.time_range.start, e.time_range.end)
                    for e in events if e.name.startswith("stage:") and e.device_type.name == "CPU")
    out: dict = {"wall_ms": round(wall, 2), "kernels": len(kernels),
                 "gpu_busy_ms": round(busy_ms([(k.time_range.start, k.time_range.end) for k in kernels]), 2),
                 "stages": {}}
    for name, start, end in stages:
        own = [k for k in kernels if start <= k.time_range.start < end]
        by_kind: dict[str, float] = {}
        for k in own:
            by_kind[kind(k.name)] = by_kind.get(kind(k.name), 0.0) + (k.time_range.end - k.time_range.start) / 1e3
        entry = out["stages"].setdefault(name, {"wall_ms": 0.0, "busy_ms": 0.0, "kernels": 0, "by_kind_ms": {}})
        entry["wall_ms"] = round(entry["wall_ms"] + (end - start) / 1e3, 2)
        entry["busy_ms"] = round(entry["busy_ms"] + busy_ms([(k.time_range.start, k.time_range.end) for k in own]), 2)
        entry["kernels"] += len(own)
        for key, ms in by_kind.items():
            entry["by_kind_ms"][key] = round(entry["by_kind_ms"].get(key, 0.0) + ms, 2)
    totals: dict[str, list[float]] = {}
    for k in kernels:
        totals.setdefault(k.name, []).append((k.time_range.end - k.time_range.start) / 1e3)
    out["top_kernels"] = [{"ms": round(sum(t), 2), "count": len(t), "kind": kind(n), "name": n[:140]}
                          for n, t in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:25]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="dreamzero_5b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--compile-mode", action="append", default=None,
                    help="torch.compile mode of the DiT block ('default', 'max-autotune-no-cudagraphs', ...); "
                         "repeat for several, each measured in turn on one model")
    ap.add_argument("--sdpa", choices=("default", "flash", "efficient", "cudnn"), default="default",
                    help="the only attention backend scaled_dot_product_attention may use (default: torch's choice)")
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--label", default="", help="what this run is, in its JSON line (e.g. the code's commit)")
    args = ap.parse_args()
    if args.sdpa != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION}[args.sdpa]
        sdpa_kernel([backend]).__enter__()  # for the whole process, compiled code included
    policy = random_policy(args.preset, "cuda", "bf16", 0)
    rng = np.random.default_rng(0)
    for mode in args.compile_mode or ["default"]:
        _configure(policy, PolicySetting(name="deploy", dit_steps="upstream", compile=True), "cuda")
        if mode != "default":
            policy.model.block_runner = torch.compile(WanAttentionBlock.forward_with_kv, dynamic=False, mode=mode)
        t_warm = time.perf_counter()
        for _ in range(3):
            policy.predict_batch(_observations(policy, rng, args.batch, "bench"))
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t_warm
        times = []
        for _ in range(args.calls):
            obs = _observations(policy, rng, args.batch, "bench")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            policy.predict_batch(obs)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        row = {"preset": args.preset, "batch": args.batch, "compile_mode": mode, "sdpa": args.sdpa,
               "label": args.label, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "warmup_s": round(warm_s, 1),
               "p50_ms": round(statistics.median(times), 2), "p95_ms": round(float(np.percentile(times, 95)), 2),
               "per_call_ms": [round(t, 2) for t in times],
               "profiled_call": profile_call(policy, rng, args.batch, args.trace, f"{args.preset}_b{args.batch}_{mode}")}
        line = json.dumps(row)
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
