"""Vision pretraining: the offline presets' VAE trained as an autoencoder on the dataset's frames, before SFT.

The tiny and small presets have no WAN weights offline, so their frozen VAE is seeded random and the policy sees
the scene through random features. `pretrain_vae` starts from that very VAE (`frozen_encoders`: same class, same
seeded init, same state-dict keys), trains it to reconstruct short clips of the training episodes as the model
sees them, renormalises its latents, and writes it as a safetensors file that `train.encoder_weights.vae` loads
unchanged (the pipeline's vision stage does exactly that; docs/training.md).

* Clips: the first `clip_frames` (1 + 4k) frames of the SFT training windows (`WindowDataset`: the embodiment's
  crop, resize, colour jitter and multi-view layout, and the windows' frame spacing), from the episodes SFT trains
  on minus `heldout_episodes` more at the end, on which the reconstruction is measured (never trained on).
* Loss: MSE of the decoded clip in [-1, 1] pixels, plus `kl_weight` x KL(q(z|x) || N(0, I)) of the posterior the
  encoder predicts (the latent is then sampled); the KL keeps the latents from drifting or collapsing.
* Normalisation: `encode` returns (mu - mean_c) / std_c with the preset's constants (0 and 1 for tiny and small).
  After training, the per-channel mean and std of mu over training clips are folded into the two 1x1 convs around
  the latent (conv1's mean half, conv2), so `encode` returns unit-scale latents for the DiT and `decode` inverts
  them exactly; the file stays a plain state dict, and the statistics are recorded in its metadata and the report.

Cheap enough not to resume: seconds on a CPU for the tests' tiny frames, a few minutes on one GPU for the small
preset (params.yaml libero_scripted). The outputs are written atomically, so an interrupted run leaves nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..atomic import atomic_write_text
from ..data.check import verify_files
from ..data.dataset import WindowDataset, heldout_split, load_statistics
from ..data.embodiments import get_embodiment, load_embodiments
from ..data.errors import DataError
from ..data.lerobot_format import open_dataset
from ..data.sampling import WindowSpec
from ..data.video import worker_init_fn
from ..model.args import OFFLINE_PRESETS, preset
from ..model.conditioning import video_to_unit_range
from ..model.state_dict import save_safetensors_atomic
from ..model.vae import FRAMES_PER_LATENT
from .config import TrainConfig
from .encoders import frozen_encoders
from .metrics import Progress

VAE_FILE = "vae.safetensors"
REPORT_FILE = "report.json"
STD_FLOOR = 0.05  # of the median channel std: a near-constant channel is not blown up into unit-scale noise


class VisionError(ValueError):
    """The vision stage cannot run as configured; the message names the parameter."""


# --- data -----------------------------------------------------------------------------------------------------

def vision_windows(cfg: TrainConfig, clip_frames: int, heldout_episodes: int, frame_cache_mib: int = 0
                   ) -> tuple[list[WindowDataset], list[WindowDataset]]:
    """(training, held-out) windows of each of `cfg.datasets` as SFT builds them (`training_windows`: views,
    layout, augmentation, frame spacing), long enough for `clip_frames`. Held out: the last
    max(train.heldout_episodes, heldout_episodes) episodes, so SFT's held-out episodes stay unseen too."""
    if not cfg.datasets:
        raise DataError("vision: no dataset (train.datasets is empty)")
    if not cfg.metadata:
        raise DataError("vision: train.metadata is required (run the metadata stage first)")
    args = preset(cfg.preset, **cfg.model_overrides)
    emb = get_embodiment(cfg.embodiment, load_embodiments(cfg.embodiment_files))
    per_chunk = FRAMES_PER_LATENT * args.num_frame_per_block
    if clip_frames > 1 + per_chunk * args.max_chunk_size:
        raise VisionError(f"vision.clip_frames {clip_frames} exceeds the SFT windows' "
                          f"{1 + per_chunk * args.max_chunk_size} frames (preset {cfg.preset!r})")
    # the SFT windows' frame spacing, cut to the chunks a clip covers (a shorter window decodes fewer frames)
    spec = WindowSpec(min(args.max_chunk_size, max(1, math.ceil((clip_frames - 1) / per_chunk))),
                      emb.action_horizon, per_chunk, emb.sampling)
    stats = load_statistics(cfg.metadata, emb.tag)
    held = max(cfg.heldout_episodes, heldout_episodes)
    train_sets, heldout_sets = [], []
    for path in cfg.datasets:
        reader = open_dataset(path)
        verify_files(reader)
        fit, out = heldout_split([e.index for e in reader.episodes], held,
                                 f"vision.heldout_episodes / train.heldout_episodes ({path})")
        common = dict(seed=cfg.seed, skip_missing=cfg.skip_missing, frame_cache_mib=frame_cache_mib)
        train_sets.append(WindowDataset(reader, emb, spec, stats, train=True, episodes=fit, **common))
        heldout_sets.append(WindowDataset(reader, emb, spec, stats, train=False, episodes=out, **common))
    for kind, sets in (("training", train_sets), ("held-out", heldout_sets)):
        if not sum(len(d) for d in sets):
            raise DataError(f"vision: no {kind} windows in {', '.join(cfg.datasets)} (episodes shorter than a "
                            f"window of {spec.span + 1} frames?)")
    return train_sets, heldout_sets


class ClipDataset(torch.utils.data.Dataset):
    """uint8 clips [clip_frames, H, W, 3]: item i is the start of window `items[i]` = (dataset, anchor, position);
    the position seeds the window's crop and jitter."""

    def __init__(self, datasets: list[WindowDataset], items: list[tuple[int, int, int]], clip_frames: int):
        self.datasets, self.items, self.clip_frames = datasets, items, clip_frames

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        ds, anchor, position = self.items[i]
        return self.datasets[ds].sample(anchor, position)["images"][:self.clip_frames]


def random_items(datasets: list[WindowDataset], count: int, seed: int,
                 first_position: int = 0) -> list[tuple[int, int, int]]:
    """`count` windows drawn uniformly over all windows of `datasets` (seeded), with consecutive positions."""
    sizes = np.array([len(d) for d in datasets])
    flat = np.random.default_rng([seed, 0x7615]).integers(0, int(sizes.sum()), size=count)
    ends = np.cumsum(sizes)
    which = np.searchsorted(ends, flat, side="right")
    anchors = flat - (ends - sizes)[which]
    return [(int(d), int(a), first_position + i) for i, (d, a) in enumerate(zip(which, anchors))]


def spread_items(datasets: list[WindowDataset], count: int) -> list[tuple[int, int, int]]:
    """Up to `count` windows evenly spread over all windows of `datasets` (deterministic: the held-out clips)."""
    items = [(d, a, 0) for d, ds in enumerate(datasets) for a in range(len(ds))]
    if len(items) <= count:
        return items
    return [items[int(i)] for i in np.linspace(0, len(items) - 1, count).round()]


def device_clips(cfg: TrainConfig, datasets: list[WindowDataset], items, batch_size: int, clip_frames: int,
                 device: torch.device, log=print):
    """The clips of `items`, `batch_size` at a time, as uint8 [B, clip_frames, H, W, 3] on `device`: the windows
    decoded once (`DeviceData`; training windows augmented per position there), no loader workers."""
    from ..data.device_dataset import DeviceData

    args = preset(cfg.preset, **cfg.model_overrides)
    t0 = time.perf_counter()
    data = DeviceData(datasets, device, None, 0, args.max_state_dim, args.action_dim,
                      train=all(d.train for d in datasets), seed=cfg.seed)
    log(f"vision: {data.decodes} episode videos decoded to {data.nbytes / 2**30:.2f} GiB on {device} in "
        f"{time.perf_counter() - t0:.1f} s")
    for i in range(0, len(items), batch_size):
        yield data.batch(items[i:i + batch_size])["images"][:, :clip_frames]


def load_clips(datasets: list[WindowDataset], items, clip_frames: int) -> torch.Tensor:
    """uint8 [N, clip_frames, H, W, 3]."""
    clips = ClipDataset(datasets, items, clip_frames)
    return torch.stack([clips[i] for i in range(len(clips))])


# --- measures ---------------------------------------------------------------------------------------------------

def _autocast(device: torch.device):
    # no cast cache: CUDA graphs cannot hold one (the casts are recomputed, the same numbers)
    return (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if device.type == "cuda"
            else contextlib.nullcontext())


@torch.no_grad()
def reconstruction_mse(vae, clips: torch.Tensor, device: torch.device | str = "cpu", batch_size: int = 8) -> float:
    """Mean squared error of decode(encode(clip)) in [-1, 1] pixels over uint8 clips [N, T, H, W, 3], in fp32."""
    was_training = vae.training
    vae.eval()
    total, count = 0.0, 0
    for start in range(0, len(clips), batch_size):
        video = video_to_unit_range(clips[start:start + batch_size]).to(device)
        recon = vae.decode(vae.encode(video))
        total += float(F.mse_loss(recon.float(), video, reduction="sum"))
        count += video.numel()
    vae.train(was_training)
    return total / count


def mean_colour_mse(clips: torch.Tensor) -> float:
    """The error of the trivial reconstruction: each frame replaced by its own mean colour (a reference: an
    autoencoder below it reconstructs the scene's structure, not just its colours)."""
    video = video_to_unit_range(clips)
    return float(F.mse_loss(video.mean(dim=(-2, -1), keepdim=True).expand_as(video), video))


@torch.no_grad()
def latent_statistics(vae, clips: torch.Tensor, device: torch.device | str = "cpu",
                      batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (float64, CPU) of `encode`'s output over uint8 clips [N, T, H, W, 3]."""
    was_training = vae.training
    vae.eval()
    s1 = s2 = None
    n = 0
    for start in range(0, len(clips), batch_size):
        z = vae.encode(video_to_unit_range(clips[start:start + batch_size]).to(device)).double()
        z = z.transpose(0, 1).reshape(z.shape[1], -1)
        s1 = z.sum(1) if s1 is None else s1 + z.sum(1)
        s2 = z.pow(2).sum(1) if s2 is None else s2 + z.pow(2).sum(1)
        n += z.shape[1]
    vae.train(was_training)
    mean = s1 / n
    return mean.cpu(), (s2 / n - mean.pow(2)).clamp_min(0).sqrt().cpu()


@torch.no_grad()
def fold_latent_normalisation(vae, mean: torch.Tensor, std: torch.Tensor) -> None:
    """Make `encode` return (z - mean) / std per channel and `decode` take that back, by rewriting the 1x1 convs
    around the latent: conv1 (mu half, and its log-variance half to match) and conv2. Exact up to rounding:
    decode(encode(x)) is unchanged. Needs the preset's latent constants to be the identity (0 and 1)."""
    cfg = vae.config
    if set(cfg.latents_mean) != {0.0} or set(cfg.latents_std) != {1.0}:
        raise VisionError(f"fold_latent_normalisation: the VAE's config has latent statistics "
                          f"({cfg.latents_mean[:2]}..., {cfg.latents_std[:2]}...); only the identity (0, 1) of the "
                          f"offline presets can take folded ones")
    z = cfg.z_dim
    dtype = vae.conv1.weight.dtype
    m, s = mean.to(vae.conv1.weight.device, torch.float64), std.to(vae.conv1.weight.device, torch.float64)
    w1, b1 = vae.conv1.weight.double(), vae.conv1.bias.double()
    w1[:z] /= s.view(-1, 1, 1, 1, 1)
    b1[:z] = (b1[:z] - m) / s
    b1[z:] -= 2 * s.log()  # the posterior's variance, in the new units
    w2, b2 = vae.conv2.weight.double(), vae.conv2.bias.double()
    b2 += w2[:, :, 0, 0, 0] @ m
    w2 *= s.view(1, -1, 1, 1, 1)
    for param, value in ((vae.conv1.weight, w1), (vae.conv1.bias, b1), (vae.conv2.weight, w2), (vae.conv2.bias, b2)):
        param.copy_(value.to(dtype))


# --- training ---------------------------------------------------------------------------------------------------

def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise VisionError(f"vision.device {device!r}: no CUDA device here (use cpu or auto)")
    return torch.device(device)


def _lr_at(step: int, steps: int, lr: float) -> float:
    warmup = max(1, min(100, steps // 10))
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to a tenth


class VAELoss(torch.nn.Module):
    """The VAE's training loss on clips [B, 3, T, H, W] in [-1, 1] and the posterior's noise `eps` (drawn by the
    caller, the shape of the latents): (reconstruction MSE + kl_weight · KL, MSE, KL), in fp32. One module, so that
    on CUDA its forward and backward replay as two CUDA graphs: the small VAE's step is ~7,700 small kernels, more
    host time to launch than GPU time to run."""

    def __init__(self, vae, kl_weight: float):
        super().__init__()
        self.vae, self.kl_weight = vae, kl_weight

    def forward(self, video: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with _autocast(video.device):
            mu, log_var = self.vae.encode_moments(video)
            log_var = log_var.float().clamp(-30.0, 20.0)
            # sample the posterior (the preset's latent statistics are the identity)
            z = mu.float() + (0.5 * log_var).exp() * eps if self.kl_weight > 0 else mu
            recon = self.vae.decode(z)
        mse = F.mse_loss(recon.float(), video)
        kl = 0.5 * (mu.float().pow(2) + log_var.exp() - 1 - log_var).mean()
        return mse + self.kl_weight * kl, mse.detach(), kl.detach()

    def latent_shape(self, video: torch.Tensor) -> tuple[int, ...]:
        b, _, t, h, w = video.shape
        f = self.vae.config.spatial_factor
        return b, self.vae.config.z_dim, 1 + (t - 1) // FRAMES_PER_LATENT, h // f, w // f


def _train_steps(vae, loader, optimizer, steps: int, lr: float, kl_weight: float, dev: torch.device, bar,
                 seed: int, cuda_graphs: bool = True) -> list[dict]:
    """The VAE's training loop: reconstruction MSE + kl_weight · KL, one row of losses per step. cuda_graphs (CUDA
    only): the loss's forward and backward captured at the first batch's shape and replayed (the same kernels;
    a batch of another shape runs eagerly)."""
    noise = torch.Generator(device=dev).manual_seed(seed)
    loss_fn = VAELoss(vae, kl_weight)
    graphed, graphed_shape = None, None
    history = []
    for step, batch in enumerate(loader):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps, lr)
        video = video_to_unit_range(batch).to(dev, non_blocking=True)
        shape = loss_fn.latent_shape(video)
        eps = torch.randn(shape, generator=noise, device=dev) if kl_weight > 0 else torch.zeros(shape, device=dev)
        if cuda_graphs and dev.type == "cuda" and graphed is None:
            graphed, graphed_shape = torch.cuda.make_graphed_callables(loss_fn, (video, eps)), video.shape
        run = graphed if graphed is not None and video.shape == graphed_shape else loss_fn
        loss, mse, kl = run(video, eps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        values = torch.stack([loss, mse, kl]).detach().tolist()  # the step's one device read
        row = {"step": step + 1, "loss": values[0], "mse": values[1], "kl": values[2]}
        history.append(row)
        bar.update({"loss": row["mse"], "samples_per_s_per_gpu": len(batch) / (time.perf_counter() - t0)})
    return history


def _normalise_latents(vae, clips: torch.Tensor, dev: torch.device):
    """Fold the latents' per-channel statistics on `clips` into the VAE (`fold_latent_normalisation`), each std
    floored at STD_FLOOR × the median (a channel the VAE left unused is not blown up). Returns the statistics
    folded, how many stds were floored, and the latents' mean and std after."""
    mean, std = latent_statistics(vae, clips, dev)
    floor = STD_FLOOR * float(std.median())
    floored = int((std < floor).sum())
    std = std.clamp_min(max(floor, 1e-8))
    fold_latent_normalisation(vae, mean, std)
    after_mean, after_std = latent_statistics(vae, clips, dev)
    return mean, std, floored, after_mean, after_std


def pretrain_vae(cfg: TrainConfig, out_dir: str | Path, *, steps: int, batch_size: int, lr: float,
                 clip_frames: int, kl_weight: float = 1e-5, heldout_episodes: int = 1, device: str = "auto",
                 num_workers: int = 0, frame_cache_mib: int = 0, eval_clips: int = 16, norm_clips: int = 64,
                 data_on_device: bool = False, cuda_graphs: bool = True, progress: bool = True, log=print) -> dict:
    """Train cfg.preset's seeded VAE on cfg.datasets' frames; write <out_dir>/vae.safetensors and report.json
    (returned). `cfg` is the SFT run's train config with its seeded random VAE (no encoder_weights.vae).
    data_on_device: the training recording decoded once onto the device and each step's clips gathered and augmented
    there (`data.device_dataset`, as `train.data_on_device`), instead of loader workers decoding every clip.
    cuda_graphs: on CUDA, each step's loss replays as CUDA graphs (`VAELoss`)."""
    started = time.time()
    if cfg.preset not in OFFLINE_PRESETS:
        raise VisionError(f"vision: preset {cfg.preset!r} runs with the WAN VAE; vision pretraining replaces the "
                          f"seeded random VAE of the offline presets ({', '.join(OFFLINE_PRESETS)}) only")
    if cfg.encoder_weights.get("vae"):
        raise VisionError(f"vision: train.encoder_weights.vae is set ({cfg.encoder_weights['vae']}); pretraining "
                          "starts from the seeded random VAE (set vision.enabled: false to keep the given one)")
    if clip_frames < 1 or (clip_frames - 1) % FRAMES_PER_LATENT:
        raise VisionError(f"vision.clip_frames must be 1 + 4k (1, 5, 9, ...), got {clip_frames}")
    dev = resolve_device(device)
    train_sets, heldout_sets = vision_windows(cfg, clip_frames, heldout_episodes, frame_cache_mib)

    vae = frozen_encoders(replace(cfg, encoder_weights={}), "cpu").vae  # the SFT run's seeded random VAE
    vae.float().to(dev).requires_grad_(True)
    heldout = load_clips(heldout_sets, spread_items(heldout_sets, eval_clips), clip_frames)
    random_mse = reconstruction_mse(vae, heldout, dev)
    log(f"vision: {cfg.preset} VAE on {sum(len(d) for d in train_sets)} training windows, "
        f"{len(heldout)} held-out clips of {clip_frames} frames {tuple(heldout.shape[2:4])}, {dev}; "
        f"random VAE held-out MSE {random_mse:.4f}")

    items = random_items(train_sets, steps * batch_size, cfg.seed)
    if data_on_device:
        loader = device_clips(cfg, train_sets, items, batch_size, clip_frames, dev, log)
    else:
        loader = torch.utils.data.DataLoader(ClipDataset(train_sets, items, clip_frames), batch_size=batch_size,
                                             shuffle=False, num_workers=num_workers,
                                             worker_init_fn=worker_init_fn if num_workers else None,
                                             pin_memory=dev.type == "cuda")
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=1e-4)
    bar = Progress(steps, enabled=progress, desc="vision")
    vae.train()
    history = _train_steps(vae, loader, optimizer, steps, lr, kl_weight, dev, bar, seed=cfg.seed,
                           cuda_graphs=cuda_graphs)
    bar.close()

    norm_set = load_clips(train_sets, random_items(train_sets, norm_clips, cfg.seed + 1, steps * batch_size),
                          clip_frames)
    mean, std, floored, after_mean, after_std = _normalise_latents(vae, norm_set, dev)
    trained_mse = reconstruction_mse(vae, heldout, dev)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in vae.state_dict().items()}
    stats_text = {"latents_mean": json.dumps([round(float(x), 6) for x in mean]),
                  "latents_std": json.dumps([round(float(x), 6) for x in std])}
    save_safetensors_atomic(state, out / VAE_FILE, {"format": "pt", "module": "vae", "preset": cfg.preset,
                                                    "source": "dz vision pretraining", "steps": str(steps),
                                                    "folded_normalisation": "true", **stats_text})
    last = history[-min(len(history), 10):]
    report = {
        "preset": cfg.preset, "steps": steps, "batch_size": batch_size, "lr": lr, "clip_frames": clip_frames,
        "kl_weight": kl_weight, "device": str(dev), "frame_size": list(heldout.shape[2:4]),
        "heldout_clips": len(heldout), "heldout_episodes": [e for d in heldout_sets for e in sorted(d.episodes or [])],
        "heldout_mse": trained_mse, "heldout_mse_random": random_mse,
        "heldout_mse_ratio": trained_mse / random_mse if random_mse else None,
        "heldout_mse_mean_colour": mean_colour_mse(heldout),
        "train_mse_last": float(np.mean([r["mse"] for r in last])),
        "latents_mean": [float(x) for x in mean], "latents_std": [float(x) for x in std],
        "latents_std_floored_channels": floored,
        "latents_after": {"mean_abs_max": float(after_mean.abs().max()), "std_min": float(after_std.min()),
                          "std_max": float(after_std.max())},
        "seconds": round(time.time() - started, 2),
        "history": history[:: max(1, len(history) // 200)],
    }
    atomic_write_text(out / REPORT_FILE, json.dumps(report, indent=1) + "\n")
    log(f"vision: {steps} steps in {report['seconds']:.1f} s; held-out MSE {trained_mse:.4f} (random VAE "
        f"{random_mse:.4f}, mean colour {report['heldout_mse_mean_colour']:.4f}) -> {out / VAE_FILE}")
    return report
