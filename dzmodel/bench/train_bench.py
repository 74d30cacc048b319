"""`dz bench train`: a plain baseline and the optimised configuration, side by side, on one device.

Both run full training steps (forward, backward, grad clip, AdamW with fp32 master weights and state) of
the same preset on the DROID sample shape, with random inputs:
  baseline   upstream-like: eager, micro-batch 1, dense-mask SDPA, and the frozen encoders (VAE, umT5,
             CLIP; random weights, real sizes) run per sample every step
  optimised  compiled blocks, one FlexAttention call per layer, activation checkpointing as configured,
             a large micro-batch, bf16 autocast, and encoder outputs read from the cache (no encoder work),
             or (encoders=online_batched) the encoders run once per micro-batch, batched
samples/s/GPU, MFU (model FLOPs of reference §3.3 / 989 TFLOP/s; recompute not counted), peak memory,
and the ratio are printed. Medians over timed steps after warm-up, CUDA events.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..model.args import preset
from ..model.attention import latent_layout
from ..model.flops import wam_forward_flops
from ..model.objective import FlowMatchSchedule, flow_matching_losses, sample_timestep_ids
from ..model.wam import DreamZeroWAM
from ..train.parallelize import apply_fsdp, apply_recompute_and_compile, build_adamw
from .model_step import H100_BF16_PEAK, random_inputs, time_steps


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
    mfu: float
    peak_mem_gib: float
    activation_gib: float  # memory held from the start of a micro-batch's forward until its backward
    alloc_retries: int  # allocator flush-and-retry events: > 0 means the step ran at the memory limit
    device: str


def _encoder_inputs(preset_name: str, batch: int, device, image_size, frames: int):
    from ..model.components import build_encoders

    enc = build_encoders(preset_name, device=device).to(torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    images = torch.randint(0, 255, (batch, frames, *image_size, 3), generator=g, device=device, dtype=torch.uint8)
    ids = torch.randint(3, 1000, (batch, 512), generator=g, device=device)
    mask = torch.ones(batch, 512, dtype=torch.long, device=device)
    return enc, images, ids, mask


def build_train_step(preset_name: str, num_layers: int | None, micro_batch: int, compile: bool, ac: str,
                     attention: str, encoders: str, latent_hw=(11, 20), device: str = "cuda", accumulation: int = 1,
                     fsdp: bool = False, memory: dict | None = None):
    """One full training step of a configuration as a closure: (step, args, layout). A step is
    `accumulation` forward/backward passes of `micro_batch` samples, then clip and AdamW. Used by the bench
    and by `train_profile`. fsdp: wrap in FSDP2 even in a one-process group (its own overhead, without
    communication). memory: if given, gets "activation_bytes" of the last micro-batch."""
    from ..model.conditioning import encode_batch

    args = preset(preset_name, **({"num_layers": num_layers} if num_layers else {}))
    sharded = dist.is_initialized() and (dist.get_world_size() > 1 or fsdp)
    torch.manual_seed(0)
    with torch.device(device):
        model = DreamZeroWAM(args)
    model.train()
    apply_recompute_and_compile(model, ac, compile)
    if sharded:  # FSDP2 full_shard: fp32 master weights sharded, bf16 compute, fp32 gradient reduction
        apply_fsdp(model, "full", "bf16", "fp32", "cuda")
    opt = build_adamw(model.parameters(), lr=1e-5, betas=(0.95, 0.999), weight_decay=1e-5,
                      device_type=torch.device(device).type)
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = random_inputs(model, micro_batch, latent_hw, device, torch.float32, gen)
    layout = latent_layout(args, latent_hw)
    mask = model.make_mask(layout, attention, torch.device(device))
    sched = FlowMatchSchedule()
    A, K = args.num_action_per_block, args.max_chunk_size
    actions = torch.rand(micro_batch, K * A, args.action_dim, device=device) * 2 - 1
    action_mask = torch.ones_like(actions, dtype=torch.bool)
    real = torch.ones(micro_batch, dtype=torch.bool, device=device)
    enc = None
    if encoders not in ("cache", "online_per_sample", "online_batched"):
        raise ValueError(f"encoders must be cache, online_per_sample or online_batched, got {encoders!r}")
    if encoders.startswith("online"):
        vae_factor = 16 if args.in_dim == 48 else 8
        image_size = (latent_hw[0] * vae_factor, latent_hw[1] * vae_factor)
        enc, images, ids, tmask = _encoder_inputs(preset_name, micro_batch, device, image_size, 4 * (args.num_frames - 1) + 1)

    def micro_step():
        before = torch.cuda.memory_allocated() if memory is not None and device.startswith("cuda") else None
        clean = inputs["clean_latents"]
        if enc is not None:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                if encoders == "online_per_sample":  # upstream: every sample's encoders, one at a time, every step
                    for i in range(micro_batch):
                        encode_batch(args, enc.vae, enc.text_encoder, enc.image_encoder, images[i:i + 1],
                                     ids[i:i + 1], tmask[i:i + 1])
                else:  # ours without the cache: one batched call per encoder for the whole micro-batch
                    encode_batch(args, enc.vae, enc.text_encoder, enc.image_encoder, images, ids, tmask)
        _, tid, aid = sample_timestep_ids(micro_batch, args.num_frames, args.num_frame_per_block, A)
        tid, aid = tid.to(device), aid.to(device)
        noise, noise_a = torch.randn_like(clean), torch.randn_like(actions)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            out = model(sched.add_noise(clean, noise, tid, 2), clean, sched.timestep(tid),
                        sched.add_noise(actions, noise_a, aid, 1), sched.timestep(aid), inputs["state"],
                        inputs["context"], inputs["clip_feature"], y=inputs["y"], mask=mask)
        losses = flow_matching_losses(sched, out.video_pred, out.action_pred, clean, noise, actions, noise_a, tid, aid,
                                      action_mask, real)
        if before is not None:
            memory["activation_bytes"] = torch.cuda.memory_allocated() - before
        (losses.loss / accumulation).backward()

    def step():
        for _ in range(accumulation):
            micro_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, args, layout


def run_config(name: str, preset_name: str, num_layers: int | None, micro_batch: int, compile: bool, ac: str,
               attention: str, encoders: str, latent_hw=(11, 20), steps: int = 8, warmup: int = 3,
               device: str = "cuda", accumulation: int = 1, fsdp: bool = False) -> TrainBenchResult:
    memory: dict = {}
    step, args, layout = build_train_step(preset_name, num_layers, micro_batch, compile, ac, attention, encoders,
                                          latent_hw, device, accumulation, fsdp, memory)
    each = time_steps(step, steps, warmup, device)
    ms = statistics.median(each)
    samples = micro_batch * accumulation
    flops = wam_forward_flops(args, layout).train() * samples
    achieved = flops / (ms / 1e3)
    res = TrainBenchResult(
        name=name, preset=preset_name, num_layers=args.num_layers, micro_batch=micro_batch,
        accumulation=accumulation, compile=compile,
        activation_checkpointing=ac, attention=attention, encoders=encoders, step_ms=round(ms, 2),
        step_ms_each=[round(t, 1) for t in each],
        samples_per_s_per_gpu=round(samples / (ms / 1e3), 3), model_tflops_per_s=round(achieved / 1e12, 1),
        mfu=round(achieved / H100_BF16_PEAK, 4), peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        activation_gib=round(memory.get("activation_bytes", 0) / 2**30, 2),
        alloc_retries=int(torch.cuda.memory_stats().get("num_alloc_retries", 0)),
        device=torch.cuda.get_device_name())
    del step  # frees the model, optimizer and inputs it holds
    _release_memory()
    return res


def _release_memory() -> None:
    """Between configurations: drop compiled graphs and collect cycles, so the next one starts empty."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def print_side_by_side(results: list[TrainBenchResult]) -> None:
    print(f"{'config':<12} {'layers':>6} {'mbs':>4} {'acc':>3} {'compile':>7} {'AC':>9} {'attn':>5} {'encoders':>17} "
          f"{'step ms':>9} {'samples/s/GPU':>13} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8} {'act GiB':>7}")
    for r in results:
        print(f"{r.name:<12} {r.num_layers:>6} {r.micro_batch:>4} {r.accumulation:>3} {str(r.compile):>7} {r.activation_checkpointing:>9} "
              f"{r.attention:>5} {r.encoders:>17} {r.step_ms:>9.1f} {r.samples_per_s_per_gpu:>13.3f} "
              f"{r.model_tflops_per_s:>8.1f} {r.mfu:>6.1%} {r.peak_mem_gib:>8.1f} {r.activation_gib:>7.1f}")
    base = next((r for r in results if r.name.startswith("baseline")), None)
    if base:
        for r in results:
            if r is not base:
                print(f"{r.name} / baseline: {r.samples_per_s_per_gpu / base.samples_per_s_per_gpu:.2f}x samples/s/GPU")


def init_distributed(fsdp: bool = False) -> str:
    """Under torchrun (WORLD_SIZE > 1): join the process group and pick this rank's GPU. Returns the device.
    With one process and fsdp=True: a one-process NCCL group, so FSDP2 can wrap the model."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if fsdp and not dist.is_initialized():
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        return "cuda"
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return f"cuda:{torch.cuda.current_device()}"


def run(preset_name: str, num_layers: int | None, configs: list[dict], latent_hw, steps: int, warmup: int,
        out_path: str | None, fsdp: bool = False) -> list[TrainBenchResult]:
    """Under torchrun (WORLD_SIZE > 1) every config runs with FSDP2 over all GPUs; rank 0 reports.
    fsdp=True wraps in FSDP2 on one GPU too."""
    device = init_distributed(fsdp)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    results = []
    for c in configs:
        t0 = time.time()
        try:
            r = run_config(preset_name=preset_name, num_layers=num_layers, latent_hw=latent_hw, steps=steps,
                           warmup=warmup, device=device, fsdp=fsdp, **c)
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
    return results
