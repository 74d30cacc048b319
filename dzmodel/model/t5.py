"""The frozen umT5-XXL text encoder that WAN (and DreamZero) condition on.

Encoder only. Module attribute names equal the keys of WAN's
`models_t5_umt5-xxl-enc-bf16.pth` (`token_embedding.weight`,
`blocks.N.attn.q.weight`, `blocks.N.ffn.gate.0.weight`,
`blocks.N.pos_embedding.embedding.weight`, `norm.weight`, ...), so that file
loads with a plain strict `load_state_dict`.

Numerics follow WAN's `wan/modules/t5.py`:
- T5 RMSNorm: no mean subtraction, the mean square in fp32, eps 1e-6; the
  normalised value is cast back to the weight's dtype only for fp16/bf16 weights.
- Attention has NO 1/sqrt(d) scaling (T5 folds it into the init); the relative
  position bias and the key mask (`finfo.min` where mask == 0) are added to the
  logits, and the softmax runs in fp32.
- umT5 gives every block its own relative position embedding (`shared_pos=False`);
  buckets are bidirectional, 32 buckets, max distance 128.
- Feed-forward: `fc2(fc1(x) * gelu_tanh(gate(x)))`.
- Residual sums are clamped to the finite range in fp16 (as upstream); no-op otherwise.
- No dropout (the encoder is frozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "UMT5Config",
    "UMT5_XXL",
    "UMT5_TINY",
    "t5_preset",
    "relative_position_bucket",
    "T5RMSNorm",
    "T5Attention",
    "T5FeedForward",
    "T5RelativeEmbedding",
    "T5Block",
    "UMT5Encoder",
    "zero_beyond_lengths",
    "zero_beyond_length",
]


# --- config --------------------------------------------------------------------


@dataclass(frozen=True)
class UMT5Config:
    vocab: int = 256384
    dim: int = 4096
    dim_attn: int = 4096
    dim_ffn: int = 10240
    num_heads: int = 64
    num_layers: int = 24
    num_buckets: int = 32
    max_distance: int = 128
    shared_pos: bool = False
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.dim_attn % self.num_heads:
            raise ValueError(f"dim_attn {self.dim_attn} is not divisible by num_heads {self.num_heads}")
        if self.num_buckets % 2:
            raise ValueError(f"num_buckets must be even for bidirectional buckets, got {self.num_buckets}")

    @property
    def head_dim(self) -> int:
        return self.dim_attn // self.num_heads


UMT5_XXL = UMT5Config()
UMT5_TINY = UMT5Config(vocab=640, dim=32, dim_attn=32, dim_ffn=48, num_heads=4, num_layers=2,
                       num_buckets=32, max_distance=128)

_PRESETS = {"xxl": UMT5_XXL, "umt5-xxl": UMT5_XXL, "tiny": UMT5_TINY}


def t5_preset(name: str, **overrides) -> UMT5Config:
    """`"xxl"` (umT5-XXL, WAN's text encoder) or `"tiny"` (tests), with field overrides."""
    if name not in _PRESETS:
        raise KeyError(f"unknown umT5 preset {name!r}; known: {', '.join(_PRESETS)}")
    return replace(_PRESETS[name], **overrides)


# --- pieces --------------------------------------------------------------------


def _fp16_clamp(x: torch.Tensor) -> torch.Tensor:
    # Upstream clamps only when an fp16 residual overflowed; other dtypes pass through.
    if x.dtype == torch.float16 and torch.isinf(x).any():
        bound = torch.finfo(torch.float16).max - 1000
        x = x.clamp(min=-bound, max=bound)
    return x


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # The tanh approximation, written out as upstream does (bit-for-bit, any dtype).
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GELUTanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gelu_tanh(x)


def relative_position_bucket(rel_pos: torch.Tensor, num_buckets: int = 32, max_distance: int = 128,
                             bidirectional: bool = True) -> torch.Tensor:
    """T5's bucket of a relative position `key_pos - query_pos` (int64 tensor, any shape).

    Bidirectional: half the buckets for keys after the query (offset num_buckets/2),
    half for keys at or before it. Within a half, distances below half of it are
    exact; larger ones share log-spaced buckets up to `max_distance`, clipped to
    the last bucket.
    """
    if bidirectional:
        half = num_buckets // 2
        buckets = (rel_pos > 0).long() * half
        dist = rel_pos.abs()
    else:
        half = num_buckets
        buckets = torch.zeros_like(rel_pos)
        dist = (-rel_pos).clamp(min=0)
    max_exact = half // 2
    # Same float32 expression and evaluation order as upstream, so borderline
    # distances land in the same bucket. (dist == 0 gives log(0) = -inf here, but
    # those entries take the exact branch below.)
    log_ratio = torch.log(dist.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    large = max_exact + log_ratio.long()
    large = torch.minimum(large, torch.full_like(large, half - 1))
    return buckets + torch.where(dist < max_exact, dist, large)


class T5RMSNorm(nn.Module):
    """T5 LayerNorm: x / rms(x) * weight, the mean square in fp32, no mean subtraction, no bias."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.type_as(self.weight)
        return self.weight * x


class T5RelativeEmbedding(nn.Module):
    """Relative position bias [1, heads, Lq, Lk] from a [num_buckets, heads] table."""

    def __init__(self, num_buckets: int, num_heads: int, bidirectional: bool = True, max_distance: int = 128):
        super().__init__()
        self.num_buckets = num_buckets
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        self.max_distance = max_distance
        self.embedding = nn.Embedding(num_buckets, num_heads)

    def forward(self, lq: int, lk: int) -> torch.Tensor:
        device = self.embedding.weight.device
        rel = torch.arange(lk, device=device).unsqueeze(0) - torch.arange(lq, device=device).unsqueeze(1)
        buckets = relative_position_bucket(rel, self.num_buckets, self.max_distance, self.bidirectional)
        return self.embedding(buckets).permute(2, 0, 1).unsqueeze(0).contiguous()


class T5Attention(nn.Module):
    def __init__(self, dim: int, dim_attn: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim_attn // num_heads
        self.q = nn.Linear(dim, dim_attn, bias=False)
        self.k = nn.Linear(dim, dim_attn, bias=False)
        self.v = nn.Linear(dim, dim_attn, bias=False)
        self.o = nn.Linear(dim_attn, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                pos_bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, C]; mask [B, L] over keys (0 = padding) or [B, Lq, Lk]; pos_bias [1|B, N, Lq, Lk]."""
        b, n, d = x.size(0), self.num_heads, self.head_dim
        q = self.q(x).view(b, -1, n, d)
        k = self.k(x).view(b, -1, n, d)
        v = self.v(x).view(b, -1, n, d)

        bias = x.new_zeros(b, n, q.size(1), k.size(1))
        if pos_bias is not None:
            bias += pos_bias  # in place: the bias keeps x's dtype, as upstream
        if mask is not None:
            if mask.ndim == 2:
                m = mask.view(b, 1, 1, -1)
            elif mask.ndim == 3:
                m = mask.unsqueeze(1)
            else:
                raise ValueError(f"mask must be [B, L] or [B, Lq, Lk], got shape {tuple(mask.shape)}")
            bias = bias.masked_fill(m == 0, torch.finfo(x.dtype).min)

        # No 1/sqrt(head_dim): T5 does not scale its attention logits.
        logits = torch.einsum("binc,bjnc->bnij", q, k) + bias
        probs = F.softmax(logits.float(), dim=-1).type_as(logits)
        out = torch.einsum("bnij,bjnc->binc", probs, v).reshape(b, -1, n * d)
        return self.o(out)


class T5FeedForward(nn.Module):
    """Gated GELU(tanh): fc2(fc1(x) * gelu(gate(x))); `gate` is a Sequential so its key is `gate.0`."""

    def __init__(self, dim: int, dim_ffn: int):
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), GELUTanh())
        self.fc1 = nn.Linear(dim, dim_ffn, bias=False)
        self.fc2 = nn.Linear(dim_ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x) * self.gate(x))


class T5Block(nn.Module):
    def __init__(self, cfg: UMT5Config):
        super().__init__()
        self.shared_pos = cfg.shared_pos
        self.norm1 = T5RMSNorm(cfg.dim, cfg.eps)
        self.attn = T5Attention(cfg.dim, cfg.dim_attn, cfg.num_heads)
        self.norm2 = T5RMSNorm(cfg.dim, cfg.eps)
        self.ffn = T5FeedForward(cfg.dim, cfg.dim_ffn)
        self.pos_embedding = None if cfg.shared_pos else T5RelativeEmbedding(
            cfg.num_buckets, cfg.num_heads, bidirectional=True, max_distance=cfg.max_distance)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                pos_bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.pos_embedding is not None:
            pos_bias = self.pos_embedding(x.size(1), x.size(1))
        x = _fp16_clamp(x + self.attn(self.norm1(x), mask=mask, pos_bias=pos_bias))
        x = _fp16_clamp(x + self.ffn(self.norm2(x)))
        return x


# --- the encoder -----------------------------------------------------------------


class UMT5Encoder(nn.Module):
    """umT5 encoder: (ids [B, L] int64, mask [B, L]) -> hidden states [B, L, dim].

    Build the full-size model on `torch.device("meta")` and load a checkpoint with
    `load_state_dict(sd, assign=True)` to avoid initialising 5.7B parameters.
    `forward` does not zero padded positions; use `encode` (or `zero_beyond_lengths`)
    for WAN's conditioning tensor.
    The tiny preset (dim 32) matches the tiny DreamZero preset's text_dim and
    the default `build_tiny_tokenizer` vocabulary (640).
    """

    def __init__(self, cfg: UMT5Config = UMT5_XXL):
        super().__init__()
        self.cfg = cfg
        self.token_embedding = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_embedding = T5RelativeEmbedding(
            cfg.num_buckets, cfg.num_heads, bidirectional=True, max_distance=cfg.max_distance) if cfg.shared_pos else None
        self.blocks = nn.ModuleList([T5Block(cfg) for _ in range(cfg.num_layers)])
        self.norm = T5RMSNorm(cfg.dim, cfg.eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """WAN's T5 init (std scheme of Mesh TF T5); a no-op cost on the meta device."""
        c = self.cfg
        nn.init.normal_(self.token_embedding.weight, std=1.0)
        rel_std = (2 * c.num_buckets * c.num_heads) ** -0.5
        for m in self.modules():
            if isinstance(m, T5RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, T5Attention):
                nn.init.normal_(m.q.weight, std=(c.dim * c.dim_attn) ** -0.5)
                nn.init.normal_(m.k.weight, std=c.dim ** -0.5)
                nn.init.normal_(m.v.weight, std=c.dim ** -0.5)
                nn.init.normal_(m.o.weight, std=(c.num_heads * c.dim_attn) ** -0.5)
            elif isinstance(m, T5FeedForward):
                nn.init.normal_(m.gate[0].weight, std=c.dim ** -0.5)
                nn.init.normal_(m.fc1.weight, std=c.dim ** -0.5)
                nn.init.normal_(m.fc2.weight, std=c.dim_ffn ** -0.5)
            elif isinstance(m, T5RelativeEmbedding):
                nn.init.normal_(m.embedding.weight, std=rel_std)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.token_embedding(ids)
        shared = self.pos_embedding(x.size(1), x.size(1)) if self.pos_embedding is not None else None
        for block in self.blocks:
            x = block(x, mask, pos_bias=shared)
        return self.norm(x)

    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """WAN's text conditioning: `forward`, then every position at or beyond a sample's
        length (number of nonzero mask entries) set to zero, per sample."""
        return zero_beyond_lengths(self(ids, mask), mask)


def zero_beyond_lengths(emb: torch.Tensor, mask_or_lens: torch.Tensor) -> torch.Tensor:
    """Return a copy of `emb` [B, L, C] with `emb[i, len_i:] = 0` for every sample i.

    `mask_or_lens` is a [B, L] attention mask (len_i = its count of nonzero entries,
    as WAN computes `seq_lens = mask.gt(0).sum(1)`) or a [B] tensor of lengths.

    Upstream DreamZero's `encode_prompt` loops `for i, v in enumerate(seq_lens):
    prompt_emb[:, v:] = 0`, zeroing EVERY sample beyond each v, which truncates all
    prompts of a batch to the shortest one. That is a bug; this helper zeroes each
    sample only beyond its own length (identical to upstream when the batch holds
    one prompt, or prompts of equal length).
    """
    if mask_or_lens.ndim == 2:
        lens = mask_or_lens.gt(0).sum(dim=1)
    elif mask_or_lens.ndim == 1:
        lens = mask_or_lens
    else:
        raise ValueError(f"expected a [B, L] mask or [B] lengths, got shape {tuple(mask_or_lens.shape)}")
    if lens.shape[0] != emb.shape[0]:
        raise ValueError(f"batch mismatch: emb has {emb.shape[0]} samples, lengths {lens.shape[0]}")
    pos = torch.arange(emb.shape[1], device=emb.device)
    keep = pos.unsqueeze(0) < lens.to(emb.device).long().unsqueeze(1)  # [B, L]
    return torch.where(keep.unsqueeze(-1), emb, torch.zeros((), dtype=emb.dtype, device=emb.device))


zero_beyond_length = zero_beyond_lengths
