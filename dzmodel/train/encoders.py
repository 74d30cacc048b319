"""The frozen encoders of a run (VAE, umT5, CLIP), built the same way by the trainer, `dz cache` and the
eval / serve loaders: from the WAN files in `train.encoder_weights`, else seeded random weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..model.args import OFFLINE_PRESETS
from ..model.components import FrozenEncoders, build_encoders, load_encoder_weights
from ..model.state_dict import save_safetensors_atomic, load_strict
from .config import TrainConfig

ENCODER_FILES = {"vae": "vae.safetensors", "text_encoder": "text_encoder.safetensors",
                 "image_encoder": "image_encoder.safetensors"}


def frozen_encoders(cfg: TrainConfig, device: torch.device | str = "cpu") -> FrozenEncoders:
    """Random weights are seeded with `seed + 1`. The offline presets' small encoders are drawn on the CPU and
    then moved, so a run trained on a GPU and evaluated on a CPU (or the reverse), its cache and its evaluation
    all see identical encoders; CUDA's generator would draw other numbers. Random big encoders (benchmarks) are
    drawn on the device. Real runs name the WAN files (reference §2) and load them strictly. Files for only some
    encoders (e.g. the vision stage's VAE) load over the seeded ones: the others keep the very numbers a run
    without files draws."""
    files = {k: v for k, v in cfg.encoder_weights.items() if v}
    every = all(files.get(k) for k in ("vae", "t5", "clip"))
    build_on = "meta" if every else ("cpu" if cfg.preset in OFFLINE_PRESETS else device)
    with torch.random.fork_rng(devices=[]):  # leave the caller's CPU RNG stream where it was
        torch.manual_seed(cfg.seed + 1)
        enc = build_encoders(cfg.preset, device=build_on)
    if files:
        load_encoder_weights(enc, vae=files.get("vae"), t5=files.get("t5"), clip=files.get("clip"))
    enc.to(device)
    return enc.eval_()


def save_encoders(encoders: FrozenEncoders, out_dir: str | Path) -> Path:
    """<out_dir>/{vae,text_encoder,image_encoder}.safetensors, each written atomically (pickle-free)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for attr, name in ENCODER_FILES.items():
        state = {k: v.detach().cpu().contiguous() for k, v in getattr(encoders, attr).state_dict().items()}
        save_safetensors_atomic(state, out / name, {"format": "pt", "module": attr})
    return out


def load_saved_encoders(preset_name: str, encoder_dir: str | Path, device: torch.device | str = "cpu") -> FrozenEncoders:
    """Encoders written by `save_encoders`, loaded strictly (a missing or mismatched tensor is an error)."""
    enc = build_encoders(preset_name, device="meta")
    for attr, name in ENCODER_FILES.items():
        path = Path(encoder_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing encoder weights")
        load_strict(getattr(enc, attr), load_file(str(path)), source=str(path), assign=True)
    return enc.to(device).eval_()
