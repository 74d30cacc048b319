"""The frozen encoders that go with each DreamZero preset (`dzmodel.policy.sessions.build_policy` builds a policy
from them).

| preset        | VAE                      | text encoder     | image encoder      |
| tiny          | Wan2.2-style, z 8, tiny  | umT5 tiny (32)   | CLIP tiny (17x64)  |
| small         | Wan2.2-style, z 16, 16x  | umT5 tiny (32)   | CLIP tiny (17x64)  |
| dreamzero_5b  | Wan2.2 (z 48, 16x)       | umT5-XXL         | CLIP ViT-H/14      |
| dreamzero_14b | Wan2.1 (z 16, 8x)        | umT5-XXL         | CLIP ViT-H/14      |

WAN component files load strictly: `.safetensors` or `.pth` (weights_only). The CLIP checkpoint's
`textual.*` half is dropped, since DreamZero uses only the visual tower.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .args import preset
from .clip import CLIP_TINY, CLIP_VIT_H_14, CLIPVisionConfig, WanCLIPVisual, visual_state_dict
from .state_dict import LoadReport, load_strict, read_weights
from .t5 import UMT5_TINY, UMT5_XXL, UMT5Config, UMT5Encoder
from .vae import WanVAE38Config, WanVAEConfig, WanVideoVAE, WanVideoVAE38

TINY_VAE = WanVAE38Config(dim=8, dec_dim=8, z_dim=8, latents_mean=(0.0,), latents_std=(1.0,))
SMALL_VAE = WanVAE38Config(dim=16, dec_dim=16, z_dim=16, latents_mean=(0.0,), latents_std=(1.0,))


@dataclass(frozen=True)
class EncoderSpec:
    vae: WanVAEConfig
    t5: UMT5Config
    clip: CLIPVisionConfig
    image_size: tuple[int, int]   # model input frames (after multi-view layout and resize)


ENCODERS = {
    "tiny": EncoderSpec(vae=TINY_VAE, t5=UMT5_TINY, clip=CLIP_TINY, image_size=(64, 64)),
    "small": EncoderSpec(vae=SMALL_VAE, t5=UMT5_TINY, clip=CLIP_TINY, image_size=(128, 256)),
    "dreamzero_5b": EncoderSpec(vae=WanVAE38Config(), t5=UMT5_XXL, clip=CLIP_VIT_H_14, image_size=(176, 320)),
    "dreamzero_14b": EncoderSpec(vae=WanVAEConfig(), t5=UMT5_XXL, clip=CLIP_VIT_H_14, image_size=(352, 640)),
}


@dataclass
class FrozenEncoders:
    vae: nn.Module
    text_encoder: UMT5Encoder
    image_encoder: WanCLIPVisual
    spec: EncoderSpec

    def modules(self) -> list[nn.Module]:
        return [self.vae, self.text_encoder, self.image_encoder]

    def to(self, *args, **kwargs) -> "FrozenEncoders":
        """Move or cast all three encoders (nn.Module.to arguments)."""
        for m in self.modules():
            m.to(*args, **kwargs)
        return self

    def eval_(self) -> "FrozenEncoders":
        for m in self.modules():
            m.eval().requires_grad_(False)
        return self


def build_encoders(preset_name: str, device: torch.device | str = "cpu") -> FrozenEncoders:
    """Frozen encoders for a preset (random weights; load real ones with `load_encoder_weights`).
    Pass device="meta" to build the big ones instantly."""
    if preset_name not in ENCODERS:
        raise KeyError(f"no encoders for preset {preset_name!r}; known: {', '.join(ENCODERS)}")
    spec = ENCODERS[preset_name]
    with torch.device(device):
        vae = WanVideoVAE38(spec.vae) if isinstance(spec.vae, WanVAE38Config) else WanVideoVAE(spec.vae)
        enc = FrozenEncoders(vae=vae, text_encoder=UMT5Encoder(spec.t5), image_encoder=WanCLIPVisual(spec.clip), spec=spec)
    return enc.eval_()


def load_encoder_weights(encoders: FrozenEncoders, vae: str | Path | None = None, t5: str | Path | None = None,
                         clip: str | Path | None = None) -> list[LoadReport]:
    """Load WAN component files (e.g. Wan2.2_VAE.pth, models_t5_umt5-xxl-enc-bf16.pth,
    models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth) strictly."""
    reports = []
    meta = any(p.is_meta for m in encoders.modules() for p in m.parameters())
    if vae:
        reports.append(load_strict(encoders.vae, read_weights(vae), source=str(vae), assign=meta))
    if t5:
        reports.append(load_strict(encoders.text_encoder, read_weights(t5), source=str(t5), assign=meta))
    if clip:
        state = visual_state_dict(read_weights(clip))
        reports.append(load_strict(encoders.image_encoder, state, source=str(clip), assign=meta))
    return reports
