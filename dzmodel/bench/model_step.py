"""`dz bench model`: the trainer's forward + backward (no optimizer, no FSDP) on the real token layout.

The model-only GPU check: it builds a preset in bf16, optionally cut to a few layers, and times the training
step's forward and backward (`TrainStep.forward_backward`: its mask, noise draws and flow-matching loss) on
synthetic micro-batches of the DROID training sample's shape, with CUDA events after warm-up. FLOPs follow
`DreamZeroArgs.flops`; MFU divides by the device's peak (none on a CPU).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..model.args import preset
from ..model.attention import latent_layout
from ..model.synthetic import random_inputs
from ..model.wam import DreamZeroWAM
from ..train.metrics import peak_flops
from ..train.synthetic import synthetic_batches


@dataclass
class StepResult:
    preset: str
    num_layers: int
    batch: int
    seq_len: int
    context_tokens: int
    backend: str
    dtype: str
    step_ms_median: float
    step_ms_min: float
    peak_mem_gib: float
    samples_per_s: float
    model_tflops_per_s: float
    mfu: float | None
    device: str


def time_steps(step, steps: int, warmup: int, device: str) -> list[float]:
    """Milliseconds per call of `step` after `warmup` calls: CUDA events on a GPU (peak memory reset after
    warm-up), the host clock on a CPU."""
    for _ in range(warmup):
        step()
    times = []
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()  # alloc retries counted over the timed steps only
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_step(preset_name: str = "dreamzero_5b", num_layers: int | None = 4, batch: int = 1,
               latent_hw: tuple[int, int] = (11, 20), backend: str = "flex", warmup: int = 3, steps: int = 10,
               dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> StepResult:
    from ..train.step import TrainStep

    overrides = {"num_layers": num_layers} if num_layers else {}
    args = preset(preset_name, **overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = DreamZeroWAM(args).to(dtype)
    model.train()
    train_step = TrainStep(model, attn_backend=backend, autocast=None if dtype == torch.float32 else dtype)
    batches = synthetic_batches(args, batch, latent_hw, device, "cache")
    layout = latent_layout(args, latent_hw)
    flops = args.flops(latent_hw).train() * batch

    def step():
        train_step.forward_backward(batches)
        model.zero_grad(set_to_none=True)

    times = time_steps(step, steps, warmup, device)
    cuda = device.startswith("cuda")
    med = statistics.median(times)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    achieved = flops / (med / 1e3)
    peak = peak_flops(torch.device(device))
    return StepResult(
        preset=preset_name, num_layers=args.num_layers, batch=batch, seq_len=layout.seq_len,
        context_tokens=args.text_len + args.clip_tokens, backend=backend, dtype=str(dtype).replace("torch.", ""),
        step_ms_median=round(med, 3), step_ms_min=round(min(times), 3), peak_mem_gib=round(peak_mem, 3),
        samples_per_s=round(batch / (med / 1e3), 3), model_tflops_per_s=round(achieved / 1e12, 1),
        mfu=round(achieved / peak, 4) if peak else None,
        device=torch.cuda.get_device_name() if cuda else "cpu",
    )


def run(preset_name: str, num_layers: int | None, batches: list[int], backends: list[str], latent_hw, steps: int,
        warmup: int, device: str, out_path: str | None) -> list[StepResult]:
    results = []
    for backend in backends:
        for b in batches:
            try:
                r = bench_step(preset_name, num_layers, b, latent_hw, backend, warmup, steps, device=device)
            except torch.OutOfMemoryError:
                print(f"{backend} batch {b}: out of memory")
                torch.cuda.empty_cache()
                continue
            results.append(r)
            print(json.dumps(asdict(r)), flush=True)
            if out_path:
                with open(out_path, "a") as f:
                    f.write(json.dumps(asdict(r)) + "\n")
            torch.cuda.empty_cache() if device.startswith("cuda") else None
    hdr = f"{'backend':>7} {'batch':>5} {'L':>6} {'step ms':>9} {'peak GiB':>9} {'samples/s':>10} {'TFLOP/s':>8} {'MFU':>6}"
    print(hdr)
    for r in results:
        print(f"{r.backend:>7} {r.batch:>5} {r.seq_len:>6} {r.step_ms_median:>9.2f} {r.peak_mem_gib:>9.2f} "
              f"{r.samples_per_s:>10.2f} {r.model_tflops_per_s:>8.1f} {'-' if r.mfu is None else f'{r.mfu:.1%}':>6}")
    return results


def check_flex_vs_sdpa(preset_name: str = "tiny", num_layers: int | None = None, latent_hw=(4, 6),
                       dtype: torch.dtype = torch.float32, device: str = "cuda", batch: int = 2) -> dict[str, float]:
    """Same weights and inputs through the FlexAttention and the dense-SDPA mask: outputs and grads must agree."""
    overrides = {"num_layers": num_layers} if num_layers else {}
    args = preset(preset_name, **overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = DreamZeroWAM(args).to(dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    inputs = random_inputs(args, batch, latent_hw, device, dtype, gen)
    layout = latent_layout(args, latent_hw)
    results, grads = {}, {}
    for backend in ("sdpa", "flex"):
        out = model(**inputs, mask=model.make_mask(layout, backend, torch.device(device)))
        (out.video_pred.float().square().mean() + out.action_pred.float().square().mean()).backward()
        results[backend] = (out.video_pred.detach().float(), out.action_pred.detach().float())
        grads[backend] = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-12))  # noqa: E731
    return {
        "video_rel_err": rel(results["flex"][0], results["sdpa"][0]),
        "action_rel_err": rel(results["flex"][1], results["sdpa"][1]),
        "grad_rel_err": rel(grads["flex"], grads["sdpa"]),
        "video_max_abs": float((results["flex"][0] - results["sdpa"][0]).abs().max()),
    }
