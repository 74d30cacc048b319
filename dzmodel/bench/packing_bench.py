"""`dz bench packing`: a mixture of embodiments' samples packed into fixed-size buffers, against padding every sample
to the largest one. Counts the useful share of computed tokens (packing efficiency) and times forward + backward of
the same samples both ways on one device.

Each embodiment contributes its own frame size (its views laid out as `Embodiment.image_size`, or a size given as
NAME=HxW, through the preset's VAE stride and patch); all use the model's action horizon and chunk count. The padded side runs every
sample at the largest sample's shape, which is what padding costs (its masking is not modelled: the cost is the
same).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from ..data.embodiments import load_embodiments
from ..model.args import preset as model_preset
from ..model.attention import latent_layout
from ..model.packing import pack_first_fit, packing_efficiency
from ..model.synthetic import training_sample
from ..model.wam import DreamZeroWAM


def embodiment_latent_hw(args, entry: str, vae_stride: int) -> tuple[int, int]:
    """The latent (H, W), before patching, of an embodiment's multi-view frame (`entry` a registry tag) or of a frame
    size given as NAME=HxW (e.g. g1=128x128: a humanoid's one head camera)."""
    name, _, size = entry.partition("=")
    if size:
        try:
            h, w = (int(x) for x in size.lower().split("x"))
        except ValueError:
            raise ValueError(f"{entry!r}: a frame size is NAME=HxW, e.g. g1=128x128") from None
    else:
        embodiments = load_embodiments()
        if name not in embodiments:
            raise ValueError(f"unknown embodiment {name!r}; known: {', '.join(sorted(embodiments))}, or NAME=HxW")
        h, w = embodiments[name].image_size
    p = args.patch_size
    if h // vae_stride < p[1] or w // vae_stride < p[2]:
        raise ValueError(f"{entry!r}: a {h}x{w} frame is smaller than one patch at VAE stride {vae_stride}")
    return h // vae_stride, w // vae_stride


def _timed(fn, steps: int, warmup: int, device) -> float:
    """Median seconds of `fn` over `steps` runs after `warmup`."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_packing_bench(preset: str = "small", embodiments: Sequence[str] = ("libero_sim_small", "oxe_droid", "g1=128x128"),
                      samples: int = 12, capacity: int = 0, vae_stride: int = 16, steps: int = 3, warmup: int = 1,
                      device: str | None = None, model_overrides: dict | None = None, seed: int = 0,
                      packed_attention: str = "segments") -> dict:
    """embodiments: registry tags or NAME=HxW frame sizes; samples: how many, the embodiments taking turns;
    capacity: tokens per buffer (0: the longest sample's length times the number of embodiments); packed_attention:
    "segments" or "flex" (`DreamZeroWAM.forward_packed`)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    args = model_preset(preset, **(model_overrides or {}))
    shapes = {tag: embodiment_latent_hw(args, tag, vae_stride) for tag in embodiments}
    lengths_by_tag = {tag: latent_layout(args, hw).seq_len for tag, hw in shapes.items()}
    tags = [embodiments[i % len(embodiments)] for i in range(samples)]
    lengths = [lengths_by_tag[t] for t in tags]
    capacity = capacity or max(lengths) * len(embodiments)
    bins = pack_first_fit(lengths, capacity)
    largest = max(shapes, key=lambda t: lengths_by_tag[t])

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DreamZeroWAM(args).to(device=dev, dtype=dtype)
    batch = [training_sample(args, shapes[t], g, dev, dtype) for t in tags]
    padded = [training_sample(args, shapes[largest], g, dev, dtype) for _ in tags]

    def packed_pass():
        model.zero_grad(set_to_none=True)
        for b in bins:
            outs = model.forward_packed([batch[i] for i in b], capacity, attn_backend=packed_attention)
            sum(o.video_pred.float().square().mean() + o.action_pred.float().square().mean() for o in outs).backward()

    def padded_pass():
        model.zero_grad(set_to_none=True)
        for b in bins:  # as many calls as the packed side, each of its samples at the largest shape
            big = {k: torch.cat([padded[i][k] for i in b]) for k in padded[0]}
            out = model(**big, attn_backend="segments" if dev.type == "cuda" else "sdpa")
            (out.video_pred.float().square().mean() + out.action_pred.float().square().mean()).backward()

    packed_s = _timed(packed_pass, steps, warmup, dev)
    padded_s = _timed(padded_pass, steps, warmup, dev)
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "preset": preset, "model_overrides": model_overrides or {}, "dtype": str(dtype).replace("torch.", ""),
        "embodiments": {t: {"latent_hw": list(shapes[t]), "tokens": lengths_by_tag[t]} for t in embodiments},
        "samples": samples, "capacity": capacity, "buffers": len(bins), "packed_attention": packed_attention,
        "packing_efficiency": packing_efficiency(lengths, bins, capacity),
        "padded_efficiency": sum(lengths) / (len(lengths) * max(lengths)),
        "packed_samples_per_s": samples / packed_s, "padded_samples_per_s": samples / padded_s,
        "packed_s": packed_s, "padded_s": padded_s, "steps": steps,
    }
