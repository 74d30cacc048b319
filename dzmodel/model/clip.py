"""The frozen CLIP ViT-H/14 image tower WAN2.1 I2V (and DreamZero) condition on.

This is the `visual` half of WAN's `clip_xlm_roberta_vit_h_14`
(open-clip-xlm-roberta-large-vit-huge-14). `WanCLIPVisual` holds it as its
`visual` child, so its state dict keys equal the `visual.*` keys of WAN's
`models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` (that file also holds
`textual.*` and `log_scale`: pass it through `visual_state_dict` first).

Numerics follow WAN's `wan/modules/clip.py` VisionTransformer:
- patch embedding is a stride-14 conv without bias (pre_norm=True), then a class
  token, the learned position embedding, and `pre_norm`;
- pre-norm residual blocks (the blocks' own post_norm flag is False for this model),
  LayerNorm eps 1e-5 computed in fp32, exact (erf) GELU, attention with the usual
  1/sqrt(head_dim) scaling and no mask;
- `visual.post_norm` and `visual.head` exist (checkpoint keys) but WAN/DreamZero's
  `use_31_block=True` path never uses them: it runs blocks 0..30 and returns
  the tokens [B, 257, 1280].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "CLIPVisionConfig",
    "CLIP_VIT_H_14",
    "CLIP_TINY",
    "clip_preset",
    "CLIP_MEAN",
    "CLIP_STD",
    "CLIPLayerNorm",
    "CLIPSelfAttention",
    "CLIPAttentionBlock",
    "CLIPVisionTransformer",
    "WanCLIPVisual",
    "preprocess_images",
    "visual_state_dict",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class CLIPVisionConfig:
    image_size: int = 224
    patch_size: int = 14
    dim: int = 1280
    mlp_dim: int = 5120
    out_dim: int = 1024          # `visual.head` [dim, out_dim]; unused by the 31-block path
    num_heads: int = 16
    num_layers: int = 32
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """Patches plus the class token: 257 for ViT-H/14 at 224."""
        return self.num_patches + 1


CLIP_VIT_H_14 = CLIPVisionConfig()
# tiny: 4x4 patches + cls = 17 tokens of dim 64, as the tiny DreamZero preset (clip_tokens, clip_dim)
CLIP_TINY = CLIPVisionConfig(image_size=28, patch_size=7, dim=64, mlp_dim=128, out_dim=16, num_heads=4, num_layers=3)

_PRESETS = {"vit-h-14": CLIP_VIT_H_14, "vit_h_14": CLIP_VIT_H_14, "tiny": CLIP_TINY}


def clip_preset(name: str, **overrides) -> CLIPVisionConfig:
    """`"vit-h-14"` (WAN2.1's CLIP image tower) or `"tiny"` (tests), with field overrides."""
    if name not in _PRESETS:
        raise KeyError(f"unknown CLIP preset {name!r}; known: {', '.join(_PRESETS)}")
    return replace(_PRESETS[name], **overrides)


class CLIPLayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 and cast back to the input dtype (as WAN's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).type_as(x)


class CLIPSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.to_qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        # to_qkv's output is [q | k | v], each [heads, head_dim].
        q, k, v = self.to_qkv(x).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head_dim), no mask
        return self.proj(out.transpose(1, 2).reshape(b, s, c))


class CLIPAttentionBlock(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.norm1 = CLIPLayerNorm(cfg.dim, eps=cfg.eps)
        self.attn = CLIPSelfAttention(cfg.dim, cfg.num_heads)
        self.norm2 = CLIPLayerNorm(cfg.dim, eps=cfg.eps)
        # keys mlp.0 / mlp.2: Linear, exact GELU, Linear
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.mlp_dim), nn.GELU(), nn.Linear(cfg.mlp_dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CLIPVisionTransformer(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig = CLIP_VIT_H_14):
        super().__init__()
        self.cfg = cfg
        gain = 1.0 / math.sqrt(cfg.dim)
        self.patch_embedding = nn.Conv2d(3, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.cls_embedding = nn.Parameter(gain * torch.randn(1, 1, cfg.dim))
        self.pos_embedding = nn.Parameter(gain * torch.randn(1, cfg.num_tokens, cfg.dim))
        self.pre_norm = CLIPLayerNorm(cfg.dim, eps=cfg.eps)
        self.transformer = nn.Sequential(*[CLIPAttentionBlock(cfg) for _ in range(cfg.num_layers)])
        self.post_norm = CLIPLayerNorm(cfg.dim, eps=cfg.eps)
        self.head = nn.Parameter(gain * torch.randn(cfg.dim, cfg.out_dim))

    def forward(self, x: torch.Tensor, use_31_block: bool = True) -> torch.Tensor:
        """x: normalised images [B, 3, image_size, image_size] -> tokens [B, num_tokens, dim].

        `use_31_block=True` (WAN/DreamZero): all blocks but the last, no post_norm or head.
        False: every block, still without post_norm/head (as upstream's forward).
        """
        b = x.size(0)
        x = self.patch_embedding(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_embedding.expand(b, -1, -1).to(x.dtype), x], dim=1)
        if x.size(1) != self.pos_embedding.size(1):
            raise ValueError(f"got {x.size(1)} tokens, the position embedding has {self.pos_embedding.size(1)}: "
                             f"images must be {self.cfg.image_size}x{self.cfg.image_size}")
        x = self.pre_norm(x + self.pos_embedding.to(x.dtype))
        blocks = self.transformer[:-1] if use_31_block else self.transformer
        return blocks(x)


def preprocess_images(images: torch.Tensor, image_size: int = 224) -> torch.Tensor:
    """WAN's CLIP preprocessing: frames in [-1, 1] [N, 3, H, W] -> normalised [N, 3, S, S].

    Bicubic resize with `F.interpolate(..., mode="bicubic", align_corners=False)`
    (no antialias, no clamping), then `x * 0.5 + 0.5` and `(x - mean) / std`.
    Runs in fp32 (or fp64 if given fp64).
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [N, 3, H, W], got shape {tuple(images.shape)}")
    x = images if images.dtype == torch.float64 else images.float()
    x = F.interpolate(x, size=(image_size, image_size), mode="bicubic", align_corners=False)
    x = x * 0.5 + 0.5
    # per channel with Python scalars: no host-to-device copy, so a CUDA graph can capture it (the same values)
    return torch.cat([(x[:, c:c + 1] - m) / s for c, (m, s) in enumerate(zip(CLIP_MEAN, CLIP_STD))], dim=1)


class WanCLIPVisual(nn.Module):
    """WAN's CLIP image encoder (visual tower only). State dict keys: `visual.*`.

    Build full size on `torch.device("meta")` and load with `assign=True`.
    """

    def __init__(self, cfg: CLIPVisionConfig = CLIP_VIT_H_14):
        super().__init__()
        self.cfg = cfg
        self.visual = CLIPVisionTransformer(cfg)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.encode_images(images)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Frames in [-1, 1] -> CLIP tokens from block 31 of 32, in one batched call.

        images: [B, 3, H, W] -> [B, 257, 1280]; or [B, T, 3, H, W] -> [B*T, 257, 1280]
        (DreamZero passes the first frame as [B, 1, 3, H, W] and gets [B, 257, 1280];
        upstream resizes each sample separately and concatenates, which equals one
        batched resize). The preprocessed images are cast to the weights' dtype.
        """
        if images.ndim == 5:
            images = images.flatten(0, 1)
        x = preprocess_images(images, self.cfg.image_size)
        x = x.to(self.visual.patch_embedding.weight.dtype)
        return self.visual(x, use_31_block=True)


def visual_state_dict(state_dict: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Keep only the `visual.*` entries of a CLIP checkpoint (drops `textual.*`, `log_scale`).

    `prefix` is stripped first when present (e.g. `"model."` for DreamZero's
    `image_encoder.model.*` layout: pass `"image_encoder.model."`).
    """
    out = {}
    for k, v in state_dict.items():
        if prefix:
            if not k.startswith(prefix):
                continue
            k = k[len(prefix):]
        if k.startswith("visual."):
            out[k] = v
    return out
