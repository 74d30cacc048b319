"""The SFT trainer: one process, or many under torchrun (gloo on CPU, NCCL on GPU), FSDP2 when sharded.

    dz train --preset tiny --dataset DIR --embodiment libero_sim --metadata meta.json --steps 100 --out runs/x
    torchrun --nproc_per_node 8 -m dzmodel.cli train ...

A run resumes from its newest complete checkpoint in `out_dir`: model, optimizer, step, the data stream's
position and the noise generator all come back, so the losses continue bit-exactly. The LR schedule is a
pure function of the step (linear warmup then cosine to `min_lr`, like HF's cosine-with-min-lr).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.collate import Collator
from ..data.dataset import MixtureDataset, StreamSampler, load_statistics
from ..data.embodiments import get_embodiment, load_embodiments
from ..data.errors import DataError
from ..data.sampling import SampleStream, WindowSpec
from ..data.video import worker_init_fn
from ..dirlock import directory_lock
from ..model.args import OFFLINE_PRESETS, preset
from ..model.conditioning import NULL_PROMPT, encode_prompts, prompt_rows
from ..model.fp8 import check_bf16_layers, convert_blocks_to_fp8, resolve_precision
from ..model.lora import apply_lora, trainable_parameters
from ..model.state_dict import load_wan_dit
from ..model.vae import WanVideoVAE38
from ..model.wam import DreamZeroWAM
from ..outputs import check_output_dir, is_ours, mark
from .checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .encoders import frozen_encoders
from .metrics import JsonlSink, MetricsSink, Progress, peak_flops, peak_memory_gib
from .parallelize import DTYPES, apply_fsdp, apply_recompute_and_compile, build_adamw
from .step import TrainStep
from .windows import size_to_embodiment, training_windows


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed() -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        # NCCL for the GPU collectives, gloo for the few CPU ones (metrics, checkpoint bookkeeping)
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return DistInfo(rank, world, local, device)


def resume_position(state: dict, world_size: int) -> int:
    """Each rank's position in the sample stream after a checkpoint, for any world size: rank r of W reads global
    positions r, r + W, ..., so after `samples` samples in all, every rank of the new world continues at
    samples / W and together they read exactly the positions not yet read."""
    total = state.get("samples")
    if total is None:  # older checkpoints: each rank's own count (all equal)
        total = sum(int(v) for v in state["consumed"].values())
    if int(total) % world_size:
        raise DataError(f"cannot resume on {world_size} processes: the checkpoint consumed {total} samples, "
                        f"which do not split evenly over them (use a world size that divides the global batch)")
    return int(total) // world_size


# How far compiled may be from eager on one micro-batch (`_check_compiled`): bf16 rounding moved the loss by 7e-6
# (relative) and single gradient tensors by up to 6 % (docs/performance.md); the miscompiled blocks moved the
# gradient norm 600-fold and the dynamics loss by 60 % within 5 steps.
COMPILE_LOSS_RTOL, COMPILE_GRAD_RTOL = 2e-3, 0.05
COMPILE_RECHECK_AFTER = 20  # steps: the check runs again on the weights of that step
# Stream positions of the held-out samples (`validate`): their draws never coincide with a training sample's
VAL_POSITIONS = 1 << 40


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rtol * max(abs(a), abs(b), 1e-6)


# Windows per encoder call when encoding copies (`encoded_variants`): the VAE's activations at full resolution grow
# with it (about 9 GiB per 16-channel layer at 512 windows of 17 frames of 128x256), its speed much less.
ENCODE_BATCH = 128


def steps_for_epochs(cfg: TrainConfig, windows: int) -> int:
    """`epochs` passes over `windows` training windows, in optimizer steps of global_batch samples."""
    return max(1, math.ceil(cfg.epochs * windows / cfg.global_batch))


def lr_at(step: int, cfg: TrainConfig) -> float:
    warmup = int(cfg.warmup_ratio * cfg.steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def init_device(cfg: TrainConfig, device: torch.device | str) -> str:
    """Where the seeded init is drawn: the small offline presets on the CPU, as their encoders (`frozen_encoders`),
    so a run trained on a GPU and evaluated on a CPU starts from the same numbers (its untrained reference too);
    a WAN DiT file replaces the init, so the CPU; the big presets where they train (a 5B CPU init takes minutes,
    and its numbers differ between device types)."""
    return "cpu" if cfg.init_dit or cfg.preset in OFFLINE_PRESETS else torch.device(device).type


def initial_model(cfg: TrainConfig, device: torch.device | str) -> DreamZeroWAM:
    """The model before its first step (the trainer's, the untrained reference's, a LoRA run's base), on the
    device `init_device` picks."""
    torch.manual_seed(cfg.seed)
    with torch.device(init_device(cfg, device)):
        model = DreamZeroWAM(preset(cfg.preset, **cfg.model_overrides))
    if cfg.init_dit:
        load_wan_dit(model, cfg.init_dit)
    return model


def base_reference(cfg: TrainConfig, device: torch.device | str) -> dict:
    """What a LoRA checkpoint's frozen base is: the WAN DiT file(s) and their sha256, or the seeded init (and the
    device type it was drawn on). `dz convert` rebuilds the base from it and refuses one that changed."""
    if cfg.init_dit:
        return {"init_dit": str(cfg.init_dit), "sha256": files_sha256(cfg.init_dit)}
    return {"init": "seeded", "seed": cfg.seed, "device": init_device(cfg, device)}


def files_sha256(path: str | Path) -> str:
    """sha256 over a weights file, or over an index.json and every shard it names."""
    import hashlib

    path = Path(path)
    files = [path]
    if path.name.endswith(".index.json"):
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        files += [path.parent / s for s in shards]
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


class Trainer:
    def __init__(self, cfg: TrainConfig, sink: MetricsSink | None = None, overwrite: bool = False):
        """overwrite: train into an `out_dir` that dz did not write (by default refused: dzmodel/outputs.py)."""
        cfg = size_to_embodiment(cfg)
        self.cfg, self.overwrite = cfg, overwrite
        self.info = init_distributed()
        self.out = Path(cfg.out_dir)
        self.sink = sink
        self.args = preset(cfg.preset, **cfg.model_overrides)
        self.accum = cfg.accumulation(self.info.world_size)

    # -- building --------------------------------------------------------------------------

    def build_model(self, shard_one_process: bool = False, with_encoders: bool | None = None) -> None:
        """The model, optimizer, frozen encoders and the one training step. shard_one_process: FSDP2 in a
        one-process group too (benchmarks measure its overhead without communication); with_encoders: default
        unless training from the cache."""
        cfg, dev = self.cfg, self.info.device
        model = initial_model(cfg, dev)
        self.base = None
        precision, fallback = resolve_precision(cfg.precision, dev)
        if fallback and self.info.rank == 0:
            print(fallback)
        self.precision = precision
        if cfg.lora.enabled:  # the base is frozen (in the compute dtype) and referenced by checkpoints, not copied
            self.base = base_reference(cfg, dev)
            apply_lora(model, cfg.lora, base_dtype=DTYPES[precision] if precision != "fp32" else None)
        if cfg.fp8_bf16_layers and precision != "fp8":  # fell back to bf16: the names are still checked
            check_bf16_layers(model, cfg.fp8_bf16_layers)
        if precision == "fp8":  # before compile, so the compiled blocks see the FP8 matmuls
            converted = convert_blocks_to_fp8(model, cfg.fp8_bf16_layers)
            if self.info.rank == 0:
                kept = f", and the blocks' {', '.join(cfg.fp8_bf16_layers)}" if cfg.fp8_bf16_layers else ""
                print(f"precision fp8: {converted} linears of the blocks run FP8 matmuls; the embeddings, the head "
                      f"and the action and state layers stay bf16{kept}")
        model.to(dev).train()
        self.sharded = cfg.sharding != "none" and (self.info.world_size > 1 or shard_one_process)
        if cfg.cuda_graphs and self.sharded:
            raise ValueError("train.cuda_graphs runs in one process only: FSDP2 gathers the weights into new "
                             "memory every step, which a captured graph cannot follow")
        # CUDA graphs exist on CUDA only; elsewhere the compiled blocks run as they are
        if cfg.compile and cfg.compile_scope == "step" and self.sharded:
            raise ValueError("train.compile_scope: step compiles one process's whole step; under FSDP2 use "
                             "compile_scope: blocks")
        apply_recompute_and_compile(model, cfg.activation_checkpointing, cfg.compile,
                                    cuda_graphs=cfg.cuda_graphs and dev.type == "cuda",
                                    compile_options=cfg.compile_options, scope=cfg.compile_scope,
                                    keep_fp8_inputs=cfg.fp8_keep_inputs)
        if self.sharded:
            apply_fsdp(model, cfg.sharding, precision, cfg.reduce_dtype, dev.type)
        elif self.info.world_size > 1:
            raise ValueError("sharding 'none' with several processes is not supported: use full or hybrid")
        self.model = model
        self.optimizer = build_adamw([p for _, p in trainable_parameters(model)], cfg.lr, cfg.betas, cfg.eps,
                                     cfg.weight_decay, dev.type)
        # frozen, replicated, batched per micro-batch; not needed when training from the cache
        if with_encoders is None:
            with_encoders = not cfg.cache
        self.encoders = frozen_encoders(cfg, dev) if with_encoders else None
        if self.encoders is not None and precision in ("bf16", "fp8"):  # frozen: no master copy needed
            self.encoders.to(torch.bfloat16)
        # FSDP2 casts to the compute dtype itself; a plain model computes under autocast
        autocast = DTYPES[precision] if precision != "fp32" and not self.sharded else None
        self.step = TrainStep(model, self.optimizer, accumulation=self.accum, grad_clip=cfg.grad_clip,
                              encoders=self.encoders, autocast=autocast, attn_backend=cfg.attn_backend,
                              noise_seed=cfg.seed, noise_on=cfg.noise_on,
                              residual_dtype=autocast if cfg.residual_in_compute_dtype else None,
                              denoise_first_frame=cfg.denoise_first_frame)
        if cfg.compile and cfg.compile_scope == "step":
            self.step.compile(cuda_graphs=cfg.cuda_graphs and dev.type == "cuda", options=cfg.compile_options)
        if cfg.ema_decay:
            self.step.enable_ema(cfg.ema_decay)

    @property
    def num_windows(self) -> int:
        """Training windows (samples) in one pass over the data: one per anchor of every dataset."""
        return len(self.cached) if self.cached is not None else sum(len(d) for d in self.datasets)

    def build_data(self) -> None:
        cfg, a = self.cfg, self.args
        self.device_data = None  # `data_on_device`: the recording on the device (below)
        self.video_images = None  # `video_decode: nvdec`: the loader's frames decoded on this device (`loader`)
        from .cache import CachedWindows, collate_cached

        self.val = CachedWindows(cfg.val_cache, expect_preset=cfg.preset) if cfg.val_cache else None
        if cfg.cache:

            self.cached = CachedWindows(cfg.cache, expect_preset=cfg.preset)
            if self.cached.index.get("heldout_episodes", 0) != cfg.heldout_episodes:
                raise DataError(f"{cfg.cache}: built with heldout_episodes {self.cached.index.get('heldout_episodes', 0)}"
                                f", train.heldout_episodes is {cfg.heldout_episodes}; rebuild it with `dz cache`")
            self.datasets = None
            self.stream = SampleStream([len(self.cached)], seed=cfg.seed, rank=self.info.rank,
                                       world_size=self.info.world_size)
            self.collate = collate_cached
            if cfg.prompt_dropout:
                if self.cached.null_context is None:
                    raise DataError(f"{cfg.cache}: has no null-prompt context, which train.prompt_dropout needs "
                                    "(built before prompt dropout); rebuild it with `dz cache`")
                self.step.enable_prompt_dropout(cfg.prompt_dropout, self.cached.null_context)
            # every context the step can see: the prompts of the cache and of the held-out cache, and the null one
            tables = [c.text for c in (self.cached, self.val) if c is not None]
            tables += [self.step.null_context] if self.step.null_context is not None else []
            self.step.text_rows = prompt_rows(*tables)
            self.flops_per_sample = a.flops(tuple(self.cached[0]["clean_latents"].shape[-2:]),
                                            noisy_first_frame=cfg.denoise_first_frame,
                                            text_rows=self.step.text_rows).train()
            return
        self.cached = None
        if not cfg.datasets:
            raise DataError("train.datasets is empty: give at least one LeRobot dataset directory")
        if not cfg.metadata:
            raise DataError("train.metadata is required (run `dz data metadata`): actions are q99-normalised")
        known = load_embodiments(cfg.embodiment_files)
        tags = cfg.dataset_embodiments or [cfg.embodiment] * len(cfg.datasets)
        embodiments = [get_embodiment(tag, known) for tag in tags]
        for emb in embodiments:
            if emb.action_horizon != a.num_action_per_block:
                raise DataError(emb.horizon_mismatch(a.num_action_per_block, f"the model (preset {cfg.preset!r})"))
        self.datasets = [
            training_windows(path, emb, WindowSpec(a.max_chunk_size, emb.action_horizon, 4 * a.num_frame_per_block,
                                                   emb.sampling), load_statistics(cfg.metadata, emb.tag), cfg)
            for path, emb in zip(cfg.datasets, embodiments)]
        self.stream = SampleStream([len(d) for d in self.datasets], cfg.dataset_weights, seed=cfg.seed,
                                   rank=self.info.rank, world_size=self.info.world_size)
        tokenizer = self._tokenizer()
        self.collate = Collator(tokenizer, a.text_len, a.max_state_dim, a.action_dim)
        if cfg.packing:  # one-sample batches, packed by the step (`TrainStep.packed_losses`)
            self.collate = OneByOne(self.collate)
            self.step.pack_capacity = cfg.pack_capacity or None
        if cfg.data_on_device:  # the whole recording decoded once onto the device; no loader workers
            from ..data.device_dataset import DeviceData

            t0 = time.perf_counter()
            self.device_data = DeviceData(self.datasets, self.info.device, tokenizer, a.text_len, a.max_state_dim,
                                          a.action_dim, train=cfg.augment, seed=cfg.seed)
            if self.info.rank == 0:
                print(f"data_on_device: {self.device_data.decodes} episode videos decoded to "
                      f"{self.device_data.nbytes / 2**30:.2f} GiB on {self.info.device} in "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if cfg.video_decode == "nvdec":
            if self.info.device.type != "cuda":
                raise ValueError(f"train.video_decode: nvdec decodes on an NVIDIA GPU; this run trains on "
                                 f"{self.info.device}: set train.video_decode: cpu")
            from ..data.nvdec import VideoImages

            self.video_images = VideoImages.attach(self.datasets, self.info.device, cfg.augment, cfg.seed,
                                                   threads=cfg.nvdec_threads)
        vae_factor = 16 if isinstance(self.encoders.vae, WanVideoVAE38) else 8
        # a mixture: each dataset's sequence, weighted as the stream samples the datasets
        weights = cfg.dataset_weights or [1.0] * len(embodiments)
        self.flops_per_sample = sum(
            w * a.flops((e.image_size[0] // vae_factor, e.image_size[1] // vae_factor),
                        noisy_first_frame=cfg.denoise_first_frame).train()
            for w, e in zip(weights, embodiments)) / sum(weights)
        if cfg.prompt_dropout:
            null = encode_prompts(tokenizer, self.encoders.text_encoder, [NULL_PROMPT], a.text_len, self.info.device)
            self.step.enable_prompt_dropout(cfg.prompt_dropout, null)
        if cfg.encoded_variants:
            self._encode_variants()

    def _check_compiled(self, batch: dict[str, torch.Tensor], step: int | None = None) -> None:
        """`train.compile`: the compiled blocks must agree with their eager forward on the run's first micro-batch
        (losses and gradient norm, no optimizer step), or the run stops before it trains; and again at its
        `COMPILE_RECHECK_AFTER`-th step (`step`), once the weights have moved. torch 2.11's Inductor
        miscompiled the small preset's blocks at micro-batch 128 on an H100: the loss
        looked plausible while the gradient norm was 600x eager's, and the run diverged."""
        with self.step.eager():
            eager_losses, eager_norm = self._eager_probe(batch)
        losses, norm = self.step.probe(batch)
        names = ("loss", "dynamics loss", "action loss")
        bad = [f"{n} {c:.5g} compiled vs {e:.5g} eager" for n, c, e in zip(names, losses, eager_losses)
               if not _close(c, e, COMPILE_LOSS_RTOL)]
        if not _close(norm, eager_norm, COMPILE_GRAD_RTOL):
            bad.append(f"gradient norm {norm:.5g} compiled vs {eager_norm:.5g} eager")
        where = "the first micro-batch" if step is None else f"step {step + 1}'s micro-batch"
        if bad:
            raise RuntimeError(f"train.compile: the compiled model disagrees with the eager one on {where} "
                               f"({'; '.join(bad)}), a compiler bug at this shape: set train.compile: false "
                               + ("(nothing was trained)" if step is None else "(the checkpoints so far were trained "
                                  "compiled: do not resume from them)"))
        if self.info.rank == 0 and self.cfg.progress:
            print(f"compile check: compiled = eager on {where} (loss {losses[0]:.5g} vs {eager_losses[0]:.5g}, "
                  f"gradient norm {norm:.4g} vs {eager_norm:.4g})", file=sys.stderr)

    def _eager_probe(self, batch: dict[str, torch.Tensor]) -> tuple[list[float], float]:
        """The eager reference pass of the compile check. At the recheck the compiled blocks' CUDA graphs still hold
        their memory pool beside it (33 GiB of an H100 at the small preset's micro-batch 256), and eager keeps more
        activations than the fused blocks: where the whole micro-batch does not fit, it runs in 2, 4, ... equal
        slices (`TrainStep.probe`: the same numbers)."""
        size, parts = len(batch["position"]), 1
        while True:
            try:
                return self.step.probe(batch, parts)
            except torch.cuda.OutOfMemoryError:
                if self.sharded or size % (parts * 2):  # under FSDP2 every rank must run the same passes
                    raise
            # out of the except block: the failed attempt's tensors are released
            for p in self.step.params:
                p.grad = None
            torch.cuda.empty_cache()
            parts *= 2
            if self.info.rank == 0 and self.cfg.progress:
                print(f"compile check: the eager pass runs in {parts} slices of the micro-batch (memory)",
                      file=sys.stderr)

    def _encode_variants(self) -> None:
        """`train.encoded_variants`: every window's K augmented copies through the frozen encoders, once."""
        cfg, data, step = self.cfg, self.device_data, self.step
        show = self.info.rank == 0
        progress = Progress(cfg.encoded_variants * data.windows, enabled=cfg.progress and show, desc="encode copies",
                            unit="window")
        t0 = time.perf_counter()
        with step.compute_dtype():
            data.encode_variants(step.encode, cfg.encoded_variants, min(cfg.micro_batch, ENCODE_BATCH),
                                 progress=lambda n: progress.update(n=n))
        progress.close()
        if show:
            held = sum(t.numel() * t.element_size() for r in data.recordings for t in r.encoded.values())
            print(f"encoded_variants: {cfg.encoded_variants} copies of {data.windows} windows encoded in "
                  f"{time.perf_counter() - t0:.1f} s ({held / 2**30:.2f} GiB on {self.info.device})", file=sys.stderr)

    def _tokenizer(self):
        from ..model.tokenizer import build_tiny_tokenizer, load_tokenizer

        path = Path(self.cfg.tokenizer) if self.cfg.tokenizer else self.out / "tokenizer"
        if not (path / "tokenizer.json").is_file() and self.cfg.preset not in OFFLINE_PRESETS:
            raise DataError(f"tokenizer directory {path} has no tokenizer.json (give train.tokenizer: a local "
                            "copy of google/umt5-xxl)")
        if self.info.rank == 0 and not (path / "tokenizer.json").is_file():
            build_tiny_tokenizer(path)
        # Every rank meets this barrier: a rank that checked for the file after rank 0 wrote it would skip a
        # conditional one, and the ranks would then pair the barrier with an FSDP all-gather and hang.
        if dist.is_initialized():
            dist.barrier()
        return load_tokenizer(path)

    def loader(self, position: int):
        self.stream.position = position
        if self.device_data is not None:
            return self.device_data.batches(self.stream, self.cfg.micro_batch)
        dataset = self.cached if self.cached is not None else MixtureDataset(self.datasets,
                                                                             same_frame_size=not self.cfg.packing)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=self.cfg.micro_batch, sampler=StreamSampler(self.stream),
            collate_fn=self.collate, num_workers=self.cfg.num_workers, pin_memory=self.info.device.type == "cuda",
            worker_init_fn=worker_init_fn if self.cfg.num_workers else None,
            persistent_workers=bool(self.cfg.num_workers))
        if self.video_images is not None:  # decoded on the device, a batch or two ahead of the step
            from ..data.nvdec import Prefetch

            return Prefetch(loader, self.video_images.fill, self.info.device)
        return loader

    # -- the loop ----------------------------------------------------------------------------

    def _rng_states(self) -> dict[str, torch.Tensor]:
        return {"torch": torch.get_rng_state()}  # diffusion noise is seeded per sample position; this is for the rest

    def run(self) -> list[dict]:
        # Rank 0 owns the run directory: a second run on it (or workers orphaned by a killed torchrun) would
        # interleave metrics and overwrite checkpoints.
        if self.info.rank == 0 and not list_checkpoints(self.out):  # a run with checkpoints is dz's own: it resumes
            check_output_dir(self.out, flag="out_dir", overwrite=self.overwrite, command="train")
        lock = (directory_lock(self.out, wait=False, what="another `dz train`") if self.info.rank == 0
                else contextlib.nullcontext())
        with lock:
            if self.info.rank == 0 and not is_ours(self.out, "train"):
                mark(self.out, "train")
            return self._run()

    def _run(self) -> list[dict]:
        cfg, info = self.cfg, self.info
        self.build_model()
        self.build_data()
        if cfg.epochs is not None:
            cfg.steps = steps_for_epochs(cfg, self.num_windows)
            if info.rank == 0 and cfg.progress:
                print(f"train: {cfg.epochs:g} epochs of {self.num_windows} windows at batch {cfg.global_batch} = "
                      f"{cfg.steps} steps", file=sys.stderr)
        start, consumed = 0, 0
        ckpt = latest_checkpoint(self.out)
        if ckpt is not None:
            state, rng = load_checkpoint(ckpt, self.model, self.optimizer, self.step.ema)
            start, consumed = int(state["step"]), resume_position(state, info.world_size)
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
        if start >= cfg.steps:
            return []
        end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
        loader = self.loader(consumed)
        it = iter(loader)
        if cfg.compile and start < end:
            first = next(it)
            self._check_compiled(first)  # before anything is written
            it = itertools.chain([first], it)
        sink = self.sink if self.sink is not None else (JsonlSink(self.out / "metrics.jsonl") if info.rank == 0 else None)
        progress = Progress(cfg.steps, start, enabled=cfg.progress and info.rank == 0)
        history = []
        dev = info.device
        peak = peak_flops(dev)
        samples = self.accum * cfg.micro_batch
        pending: list[tuple[int, float, object]] = []  # (step, lr, StepOutput) not read back yet
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()  # the data's time counts: the loader must keep up
        for step in range(start, end):
            lr = lr_at(step, cfg)
            if cfg.compile and step == start + COMPILE_RECHECK_AFTER:  # again once the weights have moved
                first = next(it)
                self._check_compiled(first, step)
                it = itertools.chain([first], it)
            out = self.step(itertools.islice(it, self.accum), lr)
            consumed += samples
            pending.append((step, lr, out))
            saving = bool(cfg.save_every) and ((step + 1) % cfg.save_every == 0 or step + 1 == end)
            validating = self.val is not None and ((step + 1) % cfg.val_every == 0 if cfg.val_every
                                                   else saving or step + 1 == end)
            # The device is read back once per `log_every` steps (and before a checkpoint or the end), not once per
            # step: between reads the host queues steps ahead and the GPU never waits for Python.
            if (step + 1) % cfg.log_every == 0 or step + 1 == end or saving or validating:
                rows = self._read_back(pending)
                dt = (time.perf_counter() - t0) / len(pending)  # the window's mean step time (the read waited)
                held_out = self.validate() if validating else {}  # after the clock: not a training step's time
                for (s, lr_s, _), (loss, dynamics, action, grad_norm) in zip(pending, rows):
                    metrics = {
                        "loss": loss, "dynamics_loss": dynamics, "action_loss": action,
                        "lr": lr_s, "grad_norm": grad_norm, "step_time_s": dt,
                        "samples_per_s_per_gpu": samples / dt,
                        "peak_mem_gib": peak_memory_gib(dev),
                    }
                    if peak is not None:  # no MFU on a CPU or an unlisted GPU
                        metrics["mfu"] = self.flops_per_sample * samples / dt / peak
                    if s == step:
                        metrics.update(held_out)
                    history.append({"step": s + 1, **metrics})
                    if sink is not None and ((s + 1) % cfg.log_every == 0 or (held_out and s == step)):
                        sink.log(s + 1, metrics)
                    progress.update(metrics)
                pending = []
            if saving:
                all_consumed = self._gather_consumed(consumed)
                save_checkpoint(self.out, step + 1, self.model, self.optimizer,
                                {"step": step + 1, "samples": sum(all_consumed.values()), "consumed": all_consumed,
                                 "world_size": info.world_size, "config": cfg.to_dict(),
                                 # where the config's relative paths are (`dz convert` finds the files from anywhere)
                                 "workdir": os.getcwd(),
                                 **({"base": self.base} if self.base else {})},
                                self._rng_states(), ema=self.step.ema)
            if not pending:  # just read back (and saved): the next window's clock starts here
                t0 = time.perf_counter()
        progress.close()
        if sink is not None and self.sink is None:
            sink.close()
        if hasattr(loader, "close"):  # `video_decode: nvdec`'s prefetching thread
            loader.close()
        return history

    def validate(self) -> dict[str, float]:
        """`train.val_cache`: the mean losses over its samples, eager and without gradients, each sample at fixed
        draws (its index, offset past any training position, seeds them) and with its own prompt (no dropout): the
        same numbers for every run of one seed, whatever its precision or compile settings."""
        from .cache import collate_cached

        step, val, size = self.step, self.val, self.cfg.micro_batch
        sums = torch.zeros(3, dtype=torch.float64, device=self.info.device)
        dropout, step.prompt_dropout = step.prompt_dropout, 0.0
        try:
            with torch.no_grad(), step.eager():
                for start in range(0, len(val), size):
                    rows = range(start, min(start + size, len(val)))
                    batch = collate_cached([val[(0, i, VAL_POSITIONS + i)] for i in rows])
                    with step.compute_dtype():
                        losses = step.losses(batch)
                    sums += torch.stack([losses.loss, losses.dynamics_loss, losses.action_loss]).double() * len(rows)
        finally:
            step.prompt_dropout = dropout
        loss, dynamics, action = (sums / len(val)).tolist()
        return {"val_loss": loss, "val_dynamics_loss": dynamics, "val_action_loss": action}

    def _read_back(self, pending: list) -> list[tuple[float, float, float, float]]:
        """(loss, dynamics, action, grad_norm) of each pending step: one device read for all of them, the losses
        averaged over the ranks."""
        outs = [out for _, _, out in pending]
        dev = outs[0].losses.device
        values = torch.stack([torch.cat([o.losses, o.grad_norm.detach().reshape(1).to(device=dev, dtype=o.losses.dtype)])
                              for o in outs]).cpu()
        if dist.is_initialized():
            losses = values[:, :3].contiguous()
            dist.all_reduce(losses)
            values[:, :3] = losses / self.info.world_size
        return [tuple(float(v) for v in row) for row in values.tolist()]

    def _gather_consumed(self, consumed: int) -> dict[str, int]:
        if not dist.is_initialized():
            return {"0": consumed}
        out: list = [None] * self.info.world_size
        dist.all_gather_object(out, consumed)
        return {str(r): int(c) for r, c in enumerate(out)}


class OneByOne:
    """A collate function for packing: each sample collated alone (a list of one-sample batches)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, samples):
        return [self.collate([s]) for s in samples]


def train(cfg: TrainConfig, sink: MetricsSink | None = None, overwrite: bool = False) -> list[dict]:
    return Trainer(cfg, sink, overwrite).run()
