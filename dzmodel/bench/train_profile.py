"""`dz bench profile`: where a training step's GPU time goes, and what each piece could reach alone.

1. One step of a `dz bench train` configuration is profiled (torch.profiler, a Chrome trace). Its GPU
   kernels are grouped into matmul, attention, fused elementwise (compiled), eager elementwise,
   communication and other, with the time the GPU sat idle inside the step.
2. `--parts` times the pieces of one transformer block alone at the same shapes: each GEMM of the
   forward and backward (cuBLAS via torch.mm), the self-attention kernel with the real mask, and the
   cross-attention. Their TFLOP/s bound what the block can reach, and say which piece is behind.
"""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import tempfile
from dataclasses import dataclass

import torch

from ..train.metrics import peak_flops

CATEGORIES = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flex|attention|fmha|flash|attn", re.I)),
    # Inductor's matmul templates; its other kernels are elementwise even where their names carry the matmul they
    # feed (triton_poi_fused__scaled_mm_..., an FP8 cast)
    ("matmul", re.compile(r"^triton_tem_", re.I)),
    ("fused elementwise (compiled)", re.compile(r"^triton_", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|sm90|sm100|s16816|wgmma|_mm_|splitk", re.I)),
    ("eager elementwise", re.compile(r"elementwise|vectorized|reduce|copy|memcpy|memset|cat|index|fill", re.I)),
)


def categorize(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "other"


@dataclass
class KernelSummary:
    step_ms: float         # first kernel start to last kernel end
    compute_busy_ms: float  # union of the non-communication kernel intervals
    exposed_comm_ms: float  # communication kernels running while no compute kernel does
    by_category: dict      # category -> summed kernel ms (streams overlap, so the sum can exceed the span)
    top: list              # (name, calls, ms) by summed time

    @property
    def idle_ms(self) -> float:
        return self.step_ms - self.compute_busy_ms - self.exposed_comm_ms


def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def summarize_trace(trace: dict, top: int = 20) -> KernelSummary:
    """Group the GPU kernels of a Chrome trace (torch.profiler's export) by category."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise ValueError("the trace has no GPU kernel events (was the step run on a GPU?)")
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
    compute = [sp for sp, e in zip(spans, kernels) if categorize(e["name"]) != "communication"]
    by_cat: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for e in kernels:
        ms = float(e["dur"]) / 1e3
        cat = categorize(e["name"])
        by_cat[cat] = by_cat.get(cat, 0.0) + ms
        entry = by_name.setdefault(e["name"], [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    ranked = sorted(((n, c, ms) for n, (c, ms) in by_name.items()), key=lambda x: -x[2])[:top]
    compute_ms = _union_ms(compute)
    return KernelSummary(step_ms=(max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3,
                         compute_busy_ms=compute_ms, exposed_comm_ms=_union_ms(spans) - compute_ms,
                         by_category=dict(sorted(by_cat.items(), key=lambda kv: -kv[1])), top=ranked)


def print_summary(s: KernelSummary) -> None:
    print(f"GPU span of the step {s.step_ms:.1f} ms: compute kernels busy {s.compute_busy_ms:.1f} ms "
          f"({s.compute_busy_ms / s.step_ms:.1%}), communication alone {s.exposed_comm_ms:.1f} ms, "
          f"idle {s.idle_ms:.1f} ms")
    for cat, ms in s.by_category.items():
        print(f"  {cat:<30} {ms:>9.1f} ms  {ms / s.step_ms:>6.1%}")
    print("top kernels (calls, ms):")
    for name, calls, ms in s.top:
        print(f"  {ms:>8.1f} ms {calls:>5}x  {name[:110]}")


def profile_step(preset_name: str, num_layers: int | None, micro_batch: int, compile: bool, ac: str, attention: str,
                 latent_hw, trace_out: str | None = None, warmup: int = 3, fsdp: bool = False,
                 precision: str = "bf16", fp8_keep_inputs: bool | str = False, top: int = 20) -> KernelSummary | None:
    """Profiles one step after `warmup` steps. Under torchrun every rank steps; rank 0 returns the summary (its
    `top` kernels by time)."""
    from torch.profiler import ProfilerActivity, profile

    import torch.distributed as dist

    from .train_bench import build_train_step, init_distributed

    init_distributed(fsdp)  # under torchrun: FSDP2 over all GPUs, as `dz bench train` runs it
    step, _ = build_train_step(preset_name, num_layers, micro_batch, compile, ac, attention, "cache", latent_hw,
                               fsdp=fsdp, precision=precision, fp8_keep_inputs=fp8_keep_inputs)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_out or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return summarize_trace(trace, top)


# --- the block's pieces alone ----------------------------------------------------------------------------

def _median_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # CPU: only for smoke tests of this module
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# FlexAttention tile configurations to try against the default (forward BLOCK_M/N; backward *1/*2).
ATTENTION_KERNEL_OPTIONS = (
    (("BLOCK_M", 128), ("BLOCK_N", 128), ("num_warps", 8), ("num_stages", 2)),
    (("BLOCK_M", 128), ("BLOCK_N", 64), ("num_warps", 8), ("num_stages", 3)),
    (("BLOCK_M1", 64), ("BLOCK_N1", 128), ("BLOCK_M2", 128), ("BLOCK_N2", 64), ("num_warps", 8), ("num_stages", 3)),
    (("USE_TMA", True),),
)


def _flex_with_options(q, k, v, block_mask, options):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, kernel_options=dict(options))


def _segments_on(q, k, v, plan, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..model.attention import segmented_attention

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return segmented_attention(q, k, v, plan)


def block_parts(preset_name: str, latent_hw, micro_batch: int = 1, device: str = "cuda") -> list[dict]:
    """TFLOP/s of each piece of one block's forward and backward at the training shapes, on its own."""
    from torch.nn.attention.flex_attention import flex_attention

    from ..model.args import preset
    from ..model.attention import SegmentedMask, segmented_attention, teacher_forcing_block_mask
    from ..model.attention import latent_layout
    from ..model.flops import allowed_pairs

    args = preset(preset_name)
    layout = latent_layout(args, latent_hw)
    L, d, ffn, C = layout.seq_len * micro_batch, args.dim, args.ffn_dim, args.text_len + args.clip_tokens
    H, D = args.num_heads, args.head_dim
    dev, bf = device, torch.bfloat16
    peak = peak_flops(torch.device(dev))
    rows = []

    def add(name: str, flops: float, ms: float, count: int = 1):
        rows.append({"piece": name, "count_per_block": count, "ms": round(ms, 3), "ms_per_block": round(ms * count, 3),
                     "tflops": round(flops / ms / 1e9, 1), "of_peak": round(flops / ms / 1e9 / (peak / 1e12), 3) if peak else None})

    # Linear layers: forward X·W, backward dX = dY·Wᵀ and dW = Xᵀ·dY (each 2·M·N·K).
    def linear(name: str, k: int, n: int, count: int) -> None:
        x, w, dy = (torch.randn(L, k, device=dev, dtype=bf), torch.randn(k, n, device=dev, dtype=bf),
                    torch.randn(L, n, device=dev, dtype=bf))
        f = 2 * L * k * n
        add(f"{name}: forward [{L}x{k}]·[{k}x{n}]", f, _median_ms(lambda: x @ w), count)
        add(f"{name}: grad input", f, _median_ms(lambda: dy @ w.t()), count)
        add(f"{name}: grad weight", f, _median_ms(lambda: x.t() @ dy), count)

    for name, k, n, count in (("qkvo + cross q/o", d, d, 6), ("ffn up", d, ffn, 1), ("ffn down", ffn, d, 1)):
        linear(name, k, n, count)

    # Self-attention under the teacher-forcing mask, each implementation compiled as in training.
    block_mask = teacher_forcing_block_mask(layout, device=dev)
    plan = SegmentedMask.from_layout(layout)
    model_flops = 4 * D * H * allowed_pairs(layout)
    tiles = block_mask.kv_num_blocks.sum().item() + block_mask.full_kv_num_blocks.sum().item()
    rows.append({"piece": "flex tiles computed / allowed pairs",
                 "ratio": round(tiles * block_mask.BLOCK_SIZE[0] * block_mask.BLOCK_SIZE[1] / allowed_pairs(layout), 3)})
    q, k, v = (torch.randn(1, H, layout.seq_len, D, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    variants = {"flex": lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask)}
    for opts in ATTENTION_KERNEL_OPTIONS:
        variants[f"flex {opts}"] = functools.partial(_flex_with_options, block_mask=block_mask, options=opts)
    variants["segments (SDPA's choice)"] = lambda q, k, v: segmented_attention(q, k, v, plan)
    for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
        variants[f"segments ({backend})"] = functools.partial(_segments_on, plan=plan, backend=backend)
    reference = None
    for name, fn in variants.items():
        compiled = torch.compile(fn, dynamic=False)
        try:
            out = compiled(q, k, v)
            fwd_ms = _median_ms(lambda: compiled(q, k, v))
            fb_ms = _median_ms(lambda: torch.autograd.grad(compiled(q, k, v), (q, k, v), g))
        except Exception as e:  # a kernel option the GPU cannot run: report it, keep going
            rows.append({"piece": f"self-attention, {name}", "error": f"{type(e).__name__}: {str(e)[:200]}"})
            torch._dynamo.reset()
            continue
        if reference is None:
            reference = out.detach().float()
        err = ((out.float() - reference).norm() / reference.norm()).item()
        add(f"self-attention forward, {name}", model_flops, fwd_ms)
        add(f"self-attention backward, {name}", 2 * model_flops, fb_ms - fwd_ms)
        rows[-1]["rel_err_vs_flex"] = round(err, 5)
        del out

    # Cross-attention: L queries over C context tokens (SDPA, no mask).
    q = torch.randn(1, H, L, D, device=dev, dtype=bf, requires_grad=True)
    kc, vc = (torch.randn(1, H, C, D, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cf = 4 * D * H * L * C
    c_fwd = _median_ms(lambda: sdpa(q, kc, vc))
    add(f"cross-attention forward ({C} keys)", cf, c_fwd)
    go = torch.randn(1, H, L, D, device=dev, dtype=bf)
    c_fb = _median_ms(lambda: torch.autograd.grad(sdpa(q, kc, vc), (q, kc, vc), go))
    add("cross-attention backward", 2 * cf, c_fb - c_fwd)
    return rows


def block_linear_shapes(args, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, tokens, in, out) of each linear layer of one DiT block as the model runs them: q, k and v as one
    matmul, the output projection, cross-attention's query and output projections over the video tokens, the FFN.
    (Cross-attention's keys and values read the few context tokens and are left out.)"""
    d, ffn = args.dim, args.ffn_dim
    return [("self q/k/v", tokens, d, 3 * d), ("self o", tokens, d, d), ("cross q", tokens, d, d),
            ("cross o", tokens, d, d), ("ffn up", tokens, d, ffn), ("ffn down", tokens, ffn, d)]


def linear_layers(preset_name: str, latent_hw, micro_batch: int = 1, device: str = "cuda",
                  compile: bool = True) -> list[dict]:
    """Each linear layer of one block alone, forward and backward as training runs it: fp32 master weights under
    bf16 autocast, compiled, in bf16 (`F.linear`) and in FP8 (`float8_linear`: the dynamic scales and roundings
    included). Their ratio is what `train.precision: fp8` can gain on the linears at this shape."""
    import torch.nn.functional as F

    from ..model.args import preset
    from ..model.attention import latent_layout
    from ..model.fp8 import float8_linear

    args = preset(preset_name)
    tokens = latent_layout(args, latent_hw).seq_len * micro_batch
    dev = torch.device(device)
    wrap = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
    layers = {"bf16": wrap(lambda x, w: F.linear(x, w)), "fp8": wrap(lambda x, w: float8_linear(x, w))}
    rows = []
    for name, m, k, n in block_linear_shapes(args, tokens):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(n, k, device=dev) * k ** -0.5)
        g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

        def forward_backward(layer):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = layer(x, w)
            return torch.autograd.grad(out, (x, w), g)

        row = {"piece": f"{name} [{m}x{k}]->{n}", "tflop": round(3 * 2 * m * k * n / 1e12, 4)}
        for precision, layer in layers.items():
            ms = _median_ms(functools.partial(forward_backward, layer))
            row[f"{precision}_ms"] = round(ms, 3)
            row[f"{precision}_tflops"] = round(3 * 2 * m * k * n / ms / 1e9, 1)
        row["fp8_speedup"] = round(row["bf16_ms"] / row["fp8_ms"], 3)
        rows.append(row)
    total = {p: sum(r[f"{p}_ms"] for r in rows) for p in layers}
    rows.append({"piece": "one block's linears", "bf16_ms": round(total["bf16"], 3), "fp8_ms": round(total["fp8"], 3),
                 "fp8_speedup": round(total["bf16"] / total["fp8"], 3)})
    return rows


def print_linears(rows: list[dict]) -> None:
    print(f"  {'layer, forward + backward':<40} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8 speedup':>11}")
    for r in rows:
        print(f"  {r['piece'][:40]:<40} {r['bf16_ms']:>9.3f} {r['fp8_ms']:>9.3f} {r['fp8_speedup']:>10.2f}x")


def print_parts(rows: list[dict]) -> None:
    for r in rows:
        if "ratio" in r or "error" in r:
            print(f"  {r['piece']}: {r.get('ratio', r.get('error'))}")
            continue
        err = f"  rel. err {r['rel_err_vs_flex']:.1e}" if "rel_err_vs_flex" in r else ""
        print(f"  {r['piece'][:70]:<70} {r['ms']:>8.2f} ms x{r['count_per_block']}  {r['tflops']:>6.1f} TFLOP/s "
              f"({r['of_peak']:.0%}){err}")
