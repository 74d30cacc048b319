"""`dz bench train`: a plain baseline and the optimised configuration, side by side, on one device.

Both are the trainer's own step (`dzmodel.train.step.TrainStep`, built by `Trainer.build_model` from a TrainConfig)
fed synthetic batches of the preset's DROID sample shape: forward, backward, grad clip, AdamW with fp32 master
weights and state. Only the data loader is missing, so `dz train` at the same configuration can be compared with
it (`--against-run`).
  baseline   upstream-like: eager, micro-batch 1, dense-mask SDPA, and the frozen encoders (VAE, umT5,
             CLIP; random weights, real sizes) run per sample every step
  optimised  compiled blocks, segmented attention, activation checkpointing as configured, a large
             micro-batch, bf16 autocast, and encoder outputs as the cache holds them (no encoder work),
             or (encoders=online_batched) the encoders run once per micro-batch, batched
samples/s/GPU, MFU (model FLOPs of `DreamZeroArgs.flops` / the device's peak; recompute not counted), peak
memory, and the ratio are printed. Medians over timed steps after warm-up, CUDA events.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..train.config import TrainConfig
from ..train.metrics import peak_flops
from ..train.synthetic import synthetic_batches
from .model_step import time_steps


@dataclass
class TrainBenchResult:
    name: str
    preset: str
    num_layers: int
    micro_batch: int
    accumulation: int
    compile: bool
    activation_checkpointing: str
    attention: str
    encoders: str
    step_ms: float
    step_ms_each: list  # every timed step, to show warm-up effects the median hides
    samples_per_s_per_gpu: float
    model_tflops_per_s: float
    mfu: float | None           # None on a CPU or an unlisted GPU
    peak_mem_gib: float | None
    activation_gib: float  # memory held from the start of a micro-batch's forward until its backward
    alloc_retries: int  # allocator flush-and-retry events: > 0 means the step ran at the memory limit
    device: str
    lora_rank: int = 0              # 0: full fine-tuning
    ema_decay: float = 0.0
    trainable_params: int = 0
    params: int = 0
    precision: str = "bf16"         # fp8: the blocks' linears in FP8 (train.precision); MFU is still against the
    #                                 bf16 dense peak (an FP8 peak is twice it): the model's FLOPs per second


ENCODER_MODES = ("cache", "online_per_sample", "online_batched")


def build_trainer(preset_name: str, num_layers: int | None, micro_batch: int, compile: bool, ac: str,
                  attention: str, encoders: str, accumulation: int = 1, fsdp: bool = False, lora_rank: int = 0,
                  ema_decay: float = 0.0, precision: str = "bf16", fp8_keep_inputs: bool | str = False):
    """The Trainer of `dz train` at one configuration (bf16, one process or FSDP2 over the torchrun group), its
    model, optimizer and step built; no data. fsdp: FSDP2 in a one-process group too. lora_rank > 0: LoRA
    adapters of that rank (alpha = rank) on the frozen bf16 base; ema_decay > 0: an EMA of the trained weights;
    fp8_keep_inputs: `train.fp8_keep_inputs`."""
    from ..train.trainer import Trainer

    if encoders not in ENCODER_MODES:
        raise ValueError(f"encoders must be one of {ENCODER_MODES}, got {encoders!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: every rank holds micro_batch samples
    cfg = TrainConfig(preset=preset_name, model_overrides={"num_layers": num_layers} if num_layers else {},
                      micro_batch=micro_batch, global_batch=micro_batch * accumulation * world, compile=compile,
                      activation_checkpointing=ac, attn_backend=attention, precision=precision,
                      fp8_keep_inputs=fp8_keep_inputs,
                      out_dir=tempfile.gettempdir(), progress=False, save_every=0, ema_decay=ema_decay,
                      lora={"rank": lora_rank, "alpha": float(lora_rank or 16)})
    trainer = Trainer(cfg)
    trainer.build_model(shard_one_process=fsdp, with_encoders=encoders != "cache")
    trainer.step.encode_per_sample = encoders == "online_per_sample"
    return trainer


def build_train_step(preset_name: str, num_layers: int | None, micro_batch: int, compile: bool, ac: str,
                     attention: str, encoders: str, latent_hw=(11, 20), accumulation: int = 1, fsdp: bool = False,
                     lora_rank: int = 0, ema_decay: float = 0.0, precision: str = "bf16",
                     fp8_keep_inputs: bool | str = False):
    """The trainer's step at one configuration, fed synthetic batches, as a closure: (step, trainer). Used by the
    bench and by `train_profile`."""
    trainer = build_trainer(preset_name, num_layers, micro_batch, compile, ac, attention, encoders, accumulation,
                            fsdp, lora_rank, ema_decay, precision, fp8_keep_inputs)
    batches = synthetic_batches(trainer.args, micro_batch, latent_hw, trainer.info.device, encoders)

    def step():
        trainer.step(batches)

    return step, trainer


def run_config(name: str, preset_name: str, num_layers: int | None, micro_batch: int, compile: bool, ac: str,
               attention: str, encoders: str, latent_hw=(11, 20), steps: int = 8, warmup: int = 3,
               accumulation: int = 1, fsdp: bool = False, lora_rank: int = 0,
               ema_decay: float = 0.0, precision: str = "bf16") -> TrainBenchResult:
    step, trainer = build_train_step(preset_name, num_layers, micro_batch, compile, ac, attention, encoders,
                                     latent_hw, accumulation, fsdp, lora_rank, ema_decay, precision)
    device = trainer.info.device
    cuda = device.type == "cuda"
    each = time_steps(step, steps, warmup, str(device))
    ms = statistics.median(each)
    samples = micro_batch * accumulation
    achieved = trainer.args.flops(latent_hw).train() * samples / (ms / 1e3)
    peak = peak_flops(device)
    res = TrainBenchResult(
        name=name, preset=preset_name, num_layers=trainer.args.num_layers, micro_batch=micro_batch,
        accumulation=accumulation, compile=compile,
        activation_checkpointing=ac, attention=attention, encoders=encoders, step_ms=round(ms, 2),
        step_ms_each=[round(t, 1) for t in each],
        samples_per_s_per_gpu=round(samples / (ms / 1e3), 3), model_tflops_per_s=round(achieved / 1e12, 1),
        mfu=round(achieved / peak, 4) if peak else None,
        peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        activation_gib=round(trainer.step.activation_bytes / 2**30, 2),
        alloc_retries=int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if cuda else 0,
        device=torch.cuda.get_device_name() if cuda else "cpu", lora_rank=lora_rank, ema_decay=ema_decay,
        trainable_params=sum(p.numel() for p in trainer.step.params),
        params=sum(p.numel() for p in trainer.model.parameters()), precision=trainer.precision)
    del step, trainer  # frees the model, optimizer and inputs they hold
    _release_memory()
    return res


def _release_memory() -> None:
    """Between configurations: drop compiled graphs and collect cycles, so the next one starts empty."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_side_by_side(results: list[TrainBenchResult]) -> None:
    print(f"{'config':<12} {'layers':>6} {'mbs':>4} {'acc':>3} {'compile':>7} {'AC':>9} {'attn':>8} {'encoders':>17} "
          f"{'lora':>4} {'prec':>4} {'step ms':>9} {'samples/s/GPU':>13} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8} "
          f"{'act GiB':>7}")
    for r in results:
        peak = "-" if r.peak_mem_gib is None else f"{r.peak_mem_gib:.1f}"
        print(f"{r.name:<12} {r.num_layers:>6} {r.micro_batch:>4} {r.accumulation:>3} {str(r.compile):>7} "
              f"{r.activation_checkpointing:>9} {r.attention:>8} {r.encoders:>17} {r.lora_rank:>4} {r.precision:>4} "
              f"{r.step_ms:>9.1f} "
              f"{r.samples_per_s_per_gpu:>13.3f} {r.model_tflops_per_s:>8.1f} {_pct(r.mfu):>6} {peak:>8} "
              f"{r.activation_gib:>7.1f}")
    base = next((r for r in results if r.name.startswith("baseline")), None)
    if base:
        for r in results:
            if r is not base:
                print(f"{r.name} / baseline: {r.samples_per_s_per_gpu / base.samples_per_s_per_gpu:.2f}x samples/s/GPU")


def compare_with_run(run_dir: str | Path, result: TrainBenchResult, skip: int = 3) -> dict:
    """`dz train`'s logged samples/s/GPU (median over its steps after the first `skip`, which compile and warm
    up) against the bench's at the same configuration."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics of a dz train run")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    timed = [r for r in rows if r["step"] > skip]
    if not timed:
        raise ValueError(f"{path}: {len(rows)} logged steps, none after the first {skip} (warm-up)")
    train = statistics.median(r["samples_per_s_per_gpu"] for r in timed)
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {"run": str(run_dir), "train_steps_timed": len(timed),
            "train_samples_per_s_per_gpu": round(train, 3),
            "train_mfu": round(statistics.median(mfu), 4) if mfu else None,
            "bench": result.name, "bench_samples_per_s_per_gpu": result.samples_per_s_per_gpu,
            "bench_mfu": result.mfu, "ratio": round(train / result.samples_per_s_per_gpu, 4)}


def init_distributed(fsdp: bool = False) -> None:
    """Under torchrun: the trainer's process group (it joins when built). With one process and fsdp=True: a
    one-process NCCL group, so FSDP2 can wrap the model."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and fsdp and not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def run(preset_name: str, num_layers: int | None, configs: list[dict], latent_hw, steps: int, warmup: int,
        out_path: str | None, fsdp: bool = False, against_run: str | None = None) -> list[TrainBenchResult]:
    """Under torchrun (WORLD_SIZE > 1) every config runs with FSDP2 over all GPUs; rank 0 reports.
    fsdp=True wraps in FSDP2 on one GPU too. against_run: a `dz train` run directory at the first config's
    settings; its logged throughput is compared with the bench's."""
    init_distributed(fsdp)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    results = []
    for c in configs:
        t0 = time.time()
        try:
            r = run_config(preset_name=preset_name, num_layers=num_layers, latent_hw=latent_hw, steps=steps,
                           warmup=warmup, fsdp=fsdp, **c)
        except torch.OutOfMemoryError:
            print(f"{c['name']}: out of memory", flush=True)
            _release_memory()
            continue
        if dist.is_initialized():
            r.name = f"{r.name}@fsdp{dist.get_world_size()}"
        results.append(r)
        if rank0:
            print(json.dumps(asdict(r)), f"({time.time() - t0:.0f} s)", flush=True)
            if out_path:
                with open(out_path, "a") as f:
                    f.write(json.dumps(asdict(r)) + "\n")
    if rank0:
        print_side_by_side(results)
        if against_run and results:
            cmp = compare_with_run(against_run, results[0])
            print(f"dz train {cmp['train_samples_per_s_per_gpu']:.3f} samples/s/GPU (median of {cmp['train_steps_timed']} "
                  f"steps) vs dz bench train {cmp['bench_samples_per_s_per_gpu']:.3f}: {cmp['ratio']:.1%}")
            print(json.dumps({"compare": cmp}))
            if out_path:
                with open(out_path, "a") as f:
                    f.write(json.dumps({"compare": cmp}) + "\n")
    return results
