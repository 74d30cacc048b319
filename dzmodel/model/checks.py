"""`dz model manifest`: every module we ship vs the public WAN checkpoint manifest, key for key."""

from __future__ import annotations

import re

import torch


def _modules():
    from .args import preset
    from .clip import CLIP_VIT_H_14, WanCLIPVisual
    from .t5 import UMT5_XXL, UMT5Encoder
    from .vae import WanVideoVAE, WanVideoVAE38
    from .wam import DreamZeroWAM
    from .wan_dit import WanModel

    yield "wan2.2_ti2v_5b_dit", lambda: WanModel(preset("wan2.2_ti2v_5b")), None
    yield "wan2.1_i2v_14b_dit", lambda: WanModel(preset("wan2.1_i2v_14b")), None
    yield "wan2.2_vae", WanVideoVAE38, None
    yield "wan2.1_vae", WanVideoVAE, None
    yield "umt5_xxl_encoder", lambda: UMT5Encoder(UMT5_XXL), None
    yield "wan2.1_clip_xlm_roberta_vit_h_14_visual", lambda: WanCLIPVisual(CLIP_VIT_H_14), None
    # DreamZero models: their WAN backbone part must be exactly the WAN checkpoint.
    dz_only = r"^(action_encoder|action_decoder|state_encoder)\."
    image = r"^(img_emb\.|blocks\.\d+\.cross_attn\.(k_img|v_img|norm_k_img)\.)"
    yield "wan2.2_ti2v_5b_dit", lambda: DreamZeroWAM(preset("dreamzero_5b")), f"{dz_only}|{image}"
    yield "wan2.1_i2v_14b_dit", lambda: DreamZeroWAM(preset("dreamzero_14b")), dz_only


def manifest_report() -> tuple[bool, str]:
    from .manifest import compare_shapes, manifest_entry

    lines, ok = [], True
    for entry, build, extra in _modules():
        with torch.device("meta"):
            module = build()
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        label = entry if extra is None else f"{entry} (backbone of {type(module).__name__})"
        if extra:
            shapes = {k: v for k, v in shapes.items() if not re.search(extra, k)}
        diff = compare_shapes(shapes, manifest_entry(entry))
        ok &= diff.ok
        n = sum(p.numel() for p in module.parameters())
        lines.append(f"{label}: {diff.summary()} ({len(shapes)} tensors, {n:,} params in module)")
    lines.append("PASS" if ok else "FAIL")
    return ok, "\n".join(lines)
