"""The WAN video DiT (Wan2.1 / Wan2.2), as small modules whose names are the checkpoint keys.

Reference §1.3-1.5. Module attribute names equal the public checkpoint keys
(`blocks.N.self_attn.q.weight`, `head.modulation`, ...), so a WAN checkpoint
loads with a plain strict `load_state_dict`.

Numerics follow WAN: norms compute in fp32, modulation runs in fp32, the time
sinusoid is float64. RoPE angles are built in float64 and applied in fp32
(upstream applies them in float64 complex; the difference is ~1e-7 relative and
fp32 keeps the GPU path fast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .args import WanDiTArgs
from .attention import AttnMask, attention
from .fp8 import Float8InferenceLinear, Float8Linear, float8_linear, frozen_fp8_matmuls
from .weight_stacks import restack, weight_stack

# --- small pieces --------------------------------------------------------------


class WanRMSNorm(nn.Module):
    """RMSNorm over the full model dim (not per head), computed in fp32, with a learned weight. The output keeps
    the input's dtype: with fp32 weights under bf16 autocast (training), q and k would otherwise become fp32 and
    every attention call would read and convert twice their bytes."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed.type_as(x) * self.weight).type_as(x)


class WanLayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 (affine only where WAN has weights: norm3)."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False):
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).type_as(x)


def sinusoidal_embedding_1d(dim: int, position: torch.Tensor) -> torch.Tensor:
    """WAN's time sinusoid: float64, [cos | sin], base 10000. position: any shape -> [..., dim]."""
    if dim % 2:
        raise ValueError(f"sinusoid dim must be even, got {dim}")
    half = dim // 2
    pos = position.to(torch.float64)
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=pos.device).div(half))
    angles = pos.unsqueeze(-1) * freqs
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def rope_angles(positions: torch.Tensor, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotation angles [..., dim/2] in float64 for integer positions (WAN's rope_params)."""
    inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device).div(dim))
    return positions.to(torch.float64).unsqueeze(-1) * inv_freq


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Rotary dims for (t, h, w): hd - 4(hd//6), 2(hd//6), 2(hd//6). 128 -> 44/42/42."""
    third = head_dim // 6
    return head_dim - 4 * third, 2 * third, 2 * third


def video_rope_angles(grid: tuple[int, int, int], head_dim: int, start_frame: int = 0,
                      theta: float = 10000.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """3D RoPE angles for tokens in (f, h, w) order: [f*h*w, head_dim/2] float64."""
    f, h, w = grid
    dt, dh, dw = rope_split(head_dim)
    at = rope_angles(torch.arange(start_frame, start_frame + f, device=device), dt, theta)
    ah = rope_angles(torch.arange(h, device=device), dh, theta)
    aw = rope_angles(torch.arange(w, device=device), dw, theta)
    return torch.cat([
        at[:, None, None, :].expand(f, h, w, -1),
        ah[None, :, None, :].expand(f, h, w, -1),
        aw[None, None, :, :].expand(f, h, w, -1),
    ], dim=-1).reshape(f * h * w, -1)


class Rope:
    """cos/sin tables for a token sequence, [L, head_dim/2] fp32. Applied to adjacent pairs."""

    def __init__(self, angles: torch.Tensor):
        self.cos = torch.cos(angles).float()
        self.sin = torch.sin(angles).float()

    @staticmethod
    def cat(ropes: list["Rope"]) -> "Rope":
        r = Rope.__new__(Rope)
        r.cos = torch.cat([x.cos for x in ropes])
        r.sin = torch.cat([x.sin for x in ropes])
        return r

    def first(self, n: int) -> "Rope":
        """The tables of the first n tokens (views)."""
        return self.rows(0, n)

    def rows(self, start: int, end: int) -> "Rope":
        """The tables of tokens [start, end) (views)."""
        r = Rope.__new__(Rope)
        r.cos, r.sin = self.cos[start:end], self.sin[start:end]
        return r

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, H, D] -> rotated, same dtype: each pair (x0, x1) becomes (x0·cos - x1·sin, x1·cos + x0·sin),
        written as x·cos + swap_pairs(x)·(-sin, sin) so that a compiled block fuses it into one pointwise kernel
        (no stack or select); the same numbers as the pairwise form."""
        xf = x.float()
        swapped = xf.unflatten(-1, (x.shape[-1] // 2, 2)).flip(-1).flatten(-2)
        cos = self.cos.repeat_interleave(2, dim=-1)[None, :, None, :]
        sin = torch.stack([-self.sin, self.sin], dim=-1).flatten(-2)[None, :, None, :]
        return (xf * cos + swapped * sin).type_as(x)


# --- attention -----------------------------------------------------------------


def project_together(x: torch.Tensor, linears: tuple[nn.Module, ...],
                     stack: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Each of `linears` applied to x. Plain Linears with biases (or all FP8 ones) run as one matmul over their
    stacked weights: x is read (and in FP8 rounded) once, and its gradient is one matmul instead of several summed
    in the compute dtype. Adapted layers (LoRA) run one by one. stack: the weights' stack, kept for inference
    (`weight_stacks.weight_stack`), used as it is for plain Linears."""
    kinds = {type(m) for m in linears}
    if kinds == {Float8InferenceLinear}:  # served in FP8: x rounded once for all
        return tuple(frozen_fp8_matmuls(x, linears))
    if len(kinds) != 1 or not kinds <= {nn.Linear, Float8Linear} or any(m.bias is None for m in linears):
        return tuple(m(x) for m in linears)
    if stack is not None and kinds == {nn.Linear}:
        return F.linear(x, *stack).chunk(len(linears), dim=-1)
    weight = torch.cat([m.weight for m in linears])
    bias = torch.cat([m.bias for m in linears])
    if kinds == {Float8Linear}:
        out = float8_linear(x, weight, bias, keep_input=all(m.keep_input for m in linears))
    else:
        out = F.linear(x, weight, bias)
    return out.chunk(len(linears), dim=-1)


class AttentionProjections(nn.Module):
    """q, k, v, o Linears (with bias) and RMSNorms on q and k over the full dim: WAN's attention weights."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, eps: float = 1e-6):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

        self.register_load_state_dict_post_hook(_restack_after_load)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        restack(self)  # the inference weight stacks stay the Linears' storage (weight_stacks.py)
        return out


def _restack_after_load(module: nn.Module, incompatible_keys) -> None:
    restack(module)


class WanSelfAttention(AttentionProjections):

    stacked_projections = (("q", "k", "v"),)  # one matmul (`project_together`), one weight stack in inference

    def qkv(self, x: torch.Tensor, rope: Rope,
            rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Roped q, k and v as [B, L, H, D]; with `rows`, q of those token rows only."""
        b, s = x.shape[:2]
        n, d = self.num_heads, self.head_dim
        q, k, v = self.project_qkv(x, rows)
        q = (rope if rows is None else rope.rows(*rows)).apply(self.norm_q(q).view(b, q.shape[1], n, d))
        k = rope.apply(self.norm_k(k).view(b, s, n, d))
        return q, k, v.view(b, s, n, d)

    def project_qkv(self, x: torch.Tensor,
                    rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q(x), k(x), v(x), q only of the token `rows` when given; as one matmul where they can
        (`project_together`). The weights keep WAN's names."""
        if rows is None:
            return project_together(x, (self.q, self.k, self.v), weight_stack(self, ("q", "k", "v")))
        return (self.q(x[:, rows[0]:rows[1]]), *project_together(x, (self.k, self.v)))

    def forward(self, x: torch.Tensor, rope: Rope, mask: AttnMask = None,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attend over [past K/V | own K/V]. Returns the output and this call's own roped (k, v).
        rows: the output of these token rows only (their queries); `mask` must be for those rows."""
        q, k, v = self.qkv(x, rope, rows)
        own = (k, v)
        if past_kv is not None and past_kv[0].shape[1]:
            k = torch.cat([past_kv[0], k], dim=1)
            v = torch.cat([past_kv[1], v], dim=1)
        return self.o(attention(q, k, v, mask).flatten(2)), own


def draws_noise(modules: tuple[nn.Module, ...]) -> bool:
    """Whether any of `modules` draws random numbers in this forward (a training LoRA adapter's dropout): then each
    row must be computed on its own, not once for all the rows it equals."""
    return any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for module in modules for m in module.modules())


class PaddedText:
    """A batch's embedded text context [B, length, dim] whose rows from `rows.shape[1]` on are all `pad`: T5 pads
    each prompt with zero rows, and the text embedding maps each zero row to one vector. The cross-attention then
    projects K and V of the distinct rows only (rows.shape[1] a sample, and `pad` once) and repeats the pad's:
    the forward's values of the whole context, for a fraction of its projections (a DROID prompt holds tens of the
    512 rows). In the backward the padding rows' gradients reach the pad row summed (in FP8, rounded to e5m2 once,
    as a sum). Where an adapter's dropout draws noise, the cross-attention projects the whole context instead
    (`draws_noise`). `WanModel.embed_context(text_rows=...)` builds it; the caller vouches for the zero rows."""

    def __init__(self, rows: torch.Tensor, pad: torch.Tensor, length: int):
        if rows.dim() != 3 or pad.shape != (1, 1, rows.shape[-1]) or not 0 < rows.shape[1] < length:
            raise ValueError(f"PaddedText: rows [B, T, dim] with 0 < T < {length} and pad [1, 1, dim], got "
                             f"{tuple(rows.shape)} and {tuple(pad.shape)}")
        self.rows, self.pad, self.length = rows, pad, length

    def distinct(self) -> torch.Tensor:
        """[B·T + 1, dim]: every sample's distinct rows, then the pad row."""
        return torch.cat([self.rows.flatten(0, 1), self.pad.flatten(0, 1).to(self.rows.dtype)])

    def repeat_pad(self, projected: torch.Tensor) -> torch.Tensor:
        """A row-wise function of `distinct()` [B·T + 1, n] -> its value on the whole context [B, length, n]."""
        b, t = self.rows.shape[:2]
        pad = projected[b * t:].view(1, 1, -1).expand(b, self.length - t, -1)
        return torch.cat([projected[:b * t].view(b, t, -1), pad], dim=1)

    def full(self) -> torch.Tensor:
        """The whole context [B, length, dim] (for tests and the paths that take a tensor)."""
        return self.repeat_pad(self.distinct())


class WanT2VCrossAttention(AttentionProjections):
    """Text cross-attention. No RoPE and no key mask: T5 padding rows are zeros and are attended (WAN)."""

    context_projections = ("k", "v")  # the linears that read the context, not the tokens (fp8.Float8Linear)
    stacked_projections = (("k", "v"),)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, self.num_heads, self.head_dim)

    def context_kv(self, text: torch.Tensor | PaddedText,
                   image: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The context's K and V as [B, L, H, D]. They depend on the context only, so a solver computes them once
        per chunk and passes them to every step (`kv`). A PaddedText's are projected for its distinct rows."""
        if isinstance(text, PaddedText) and draws_noise((self.k, self.v)):
            text = text.full()  # each padding row its own dropout draw, as on the whole context
        if isinstance(text, PaddedText):
            k, v = project_together(text.distinct(), (self.k, self.v), weight_stack(self, ("k", "v")))
            return self._heads(text.repeat_pad(self.norm_k(k))), self._heads(text.repeat_pad(v))
        k, v = project_together(text, (self.k, self.v), weight_stack(self, ("k", "v")))
        return self._heads(self.norm_k(k)), self._heads(v)

    def forward(self, x: torch.Tensor, text: torch.Tensor | PaddedText, image: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, ...] | None = None,
                mask: tuple[AttnMask, AttnMask] | None = None) -> torch.Tensor:
        """mask: (text mask, image mask) where a packed sequence's samples each attend their own context only."""
        k, v = self.context_kv(text, image) if kv is None else kv
        q = self._heads(self.norm_q(self.q(x)))
        return self.o(attention(q, k, v, None if mask is None else mask[0]).flatten(2))


class WanI2VCrossAttention(WanT2VCrossAttention):
    """Text + CLIP-image cross-attention: out = o(Attn(q, text) + Attn(q, image))."""

    context_projections = ("k", "v", "k_img", "v_img")
    stacked_projections = (("k", "v"), ("k_img", "v_img"))

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, eps: float = 1e-6):
        super().__init__(dim, num_heads, qk_norm, eps)
        self.k_img = nn.Linear(dim, dim)
        self.v_img = nn.Linear(dim, dim)
        self.norm_k_img = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def context_kv(self, text: torch.Tensor | PaddedText, image: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if image is None:
            raise ValueError("i2v cross-attention needs CLIP image tokens")
        k_img, v_img = project_together(image, (self.k_img, self.v_img), weight_stack(self, ("k_img", "v_img")))
        return (*super().context_kv(text), self._heads(self.norm_k_img(k_img)), self._heads(v_img))

    def forward(self, x: torch.Tensor, text: torch.Tensor | PaddedText, image: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, ...] | None = None,
                mask: tuple[AttnMask, AttnMask] | None = None) -> torch.Tensor:
        k, v, k_img, v_img = self.context_kv(text, image) if kv is None else kv
        q = self._heads(self.norm_q(self.q(x)))
        text_mask, image_mask = (None, None) if mask is None else mask
        out = attention(q, k, v, text_mask).flatten(2) + attention(q, k_img, v_img, image_mask).flatten(2)
        return self.o(out)


CROSS_ATTENTION = {"t2v": WanT2VCrossAttention, "i2v": WanI2VCrossAttention}


# --- block and head ------------------------------------------------------------


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() * (1 + scale) + shift


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x.float() + y.float() * gate


@dataclass(frozen=True)
class GroupedModulation:
    """Time modulation per group of tokens that share a timestep: e0 [B, G, 6, dim] (fp32) and the runs it
    covers, ((groups, tokens per group), ...) in token order. The blocks broadcast each run over its tokens,
    so the per-token [B, L, 6, dim] tensor (2 GB at 14B, L = 15,940), its reads in every block and its
    gradient accumulation are never materialised."""

    e0: torch.Tensor
    runs: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        groups = sum(n for n, _ in self.runs)
        if self.e0.dim() != 4 or self.e0.shape[1] != groups or self.e0.shape[2] != 6:
            raise ValueError(f"grouped modulation: e0 must be [B, {groups}, 6, dim] for runs {self.runs}, "
                             f"got {tuple(self.e0.shape)}")

    @property
    def num_tokens(self) -> int:
        return sum(n * size for n, size in self.runs)

    def rows(self, start: int, end: int) -> "GroupedModulation":
        """The modulation of token rows [start, end): the groups they touch, a group cut by a bound as a run of
        its own."""
        touched: list[tuple[int, int]] = []  # (group, tokens of it inside the rows)
        t0, g = 0, 0
        for groups, size in self.runs:
            for _ in range(groups):
                inside = min(t0 + size, end) - max(t0, start)
                if inside > 0:
                    touched.append((g, inside))
                t0, g = t0 + size, g + 1
        if not touched or not 0 <= start < end <= t0:
            raise ValueError(f"rows [{start}, {end}) are not within the {t0} tokens of the modulation")
        runs: list[list[int]] = []
        for _, size in touched:
            if runs and runs[-1][1] == size:
                runs[-1][0] += 1
            else:
                runs.append([1, size])
        first, last = touched[0][0], touched[-1][0]
        return GroupedModulation(self.e0[:, first:last + 1], tuple((n, size) for n, size in runs))

    def per_token(self) -> torch.Tensor:
        """The equivalent per-token e0 [B, L, 6, dim] (for checks)."""
        sizes = torch.tensor([size for n, size in self.runs for _ in range(n)], device=self.e0.device)
        return self.e0.repeat_interleave(sizes, dim=1)


Modulation = Union[torch.Tensor, GroupedModulation]


def modulation_rows(e0: Modulation, start: int, end: int) -> Modulation:
    """The modulation of token rows [start, end), per token or grouped."""
    return e0.rows(start, end) if isinstance(e0, GroupedModulation) else e0[:, start:end]


def per_run(fn, runs: tuple[tuple[int, int], ...] | None, tokens: tuple[torch.Tensor, ...],
            terms: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """fn(*tokens, *terms) with per-group `terms` [B, G, d] broadcast over the token runs of `tokens` [B, L, d].
    runs None: the terms are per token already."""
    if runs is None:
        return fn(*tokens, *terms)
    out, t0, g0 = [], 0, 0
    for groups, size in runs:
        tk = [x[:, t0:t0 + groups * size].unflatten(1, (groups, size)) for x in tokens]
        tm = [m[:, g0:g0 + groups].unsqueeze(2) for m in terms]
        out.append(fn(*tk, *tm).flatten(1, 2))
        t0, g0 = t0 + groups * size, g0 + groups
    if t0 != tokens[0].shape[1]:
        raise ValueError(f"grouped modulation covers {t0} tokens, the sequence has {tokens[0].shape[1]}")
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


class WanAttentionBlock(nn.Module):
    """x += SelfAttn(LN1(x)(1+m1)+m0)·m2 ; x += CrossAttn(LN3(x)) ; x += FFN(LN2(x)(1+m4)+m3)·m5."""

    def __init__(self, args: WanDiTArgs):
        super().__init__()
        dim, eps = args.dim, args.eps
        self.norm1 = WanLayerNorm(dim, eps)
        self.self_attn = WanSelfAttention(dim, args.num_heads, args.qk_norm, eps)
        self.norm3 = WanLayerNorm(dim, eps, elementwise_affine=True) if args.cross_attn_norm else nn.Identity()
        self.cross_attn = CROSS_ATTENTION[args.cross_attn_type](dim, args.num_heads, args.qk_norm, eps)
        self.norm2 = WanLayerNorm(dim, eps)
        self.ffn = nn.Sequential(nn.Linear(dim, args.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(args.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def modulation_terms(self, e0: Modulation) -> tuple[tuple[torch.Tensor, ...], tuple | None]:
        """e0 [B, L, 6, dim] per token, or grouped ([B, G, 6, dim] + runs), fp32 -> six [B, L or G, dim] terms
        (shift/scale/gate for attn and FFN) and the runs (None when per token)."""
        if isinstance(e0, GroupedModulation):
            return (self.modulation.float().unsqueeze(0) + e0.e0.float()).unbind(dim=2), e0.runs
        return (self.modulation.float().unsqueeze(0) + e0.float()).unbind(dim=2), None

    def forward(self, x: torch.Tensor, e0: Modulation, rope: Rope, text: torch.Tensor | PaddedText,
                image: torch.Tensor | None = None, mask: AttnMask = None,
                rows: tuple[int, int] | None = None,
                cross_mask: tuple[AttnMask, AttnMask] | None = None) -> torch.Tensor:
        return self.forward_with_kv(x, e0, rope, text, image, mask, rows=rows, cross_mask=cross_mask)[0]

    def forward_with_kv(self, x: torch.Tensor, e0: Modulation, rope: Rope, text: torch.Tensor | PaddedText,
                        image: torch.Tensor | None = None, mask: AttnMask = None,
                        past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                        cross_kv: tuple[torch.Tensor, ...] | None = None, *,
                        rows: tuple[int, int] | None = None, cross_mask: tuple[AttnMask, AttnMask] | None = None):
        """The block, attending [past_kv | own]; also returns own roped (k, v) for a KV cache.
        cross_kv: the cross-attention's context K/V, precomputed (`cross_attn.context_kv`).
        rows: compute the output of token rows [start, end) only (every token still gives keys and values), for
        a last block whose other rows nothing reads; `mask` is then the mask of those rows (`mask_for_queries`).
        cross_mask: the cross-attention's (text, image) masks, for packed samples that each attend their own."""
        m, runs = self.modulation_terms(e0)
        h = per_run(modulate, runs, (self.norm1(x),), m[0:2]).type_as(x)
        y, own_kv = self.self_attn(h, rope, mask, past_kv, rows)
        if rows is not None:
            x = x[:, rows[0]:rows[1]]
            m, runs = self.modulation_terms(modulation_rows(e0, *rows))
        x = per_run(gated_residual, runs, (x, y), m[2:3]).type_as(x)
        x = x + self.cross_attn(self.norm3(x), text, image, cross_kv, cross_mask)
        y = self.ffn(per_run(modulate, runs, (self.norm2(x),), m[3:5]).type_as(x))
        return per_run(gated_residual, runs, (x, y), m[5:6]).type_as(x), own_kv


class Head(nn.Module):
    """Output head: LN (no affine) -> modulate with (learned [1,2,d] + e) -> Linear(d -> prod(patch)·out)."""

    def __init__(self, dim: int, out_dim: int, patch_size: tuple[int, int, int], eps: float = 1e-6):
        super().__init__()
        self.norm = WanLayerNorm(dim, eps)
        self.head = nn.Linear(dim, math.prod(patch_size) * out_dim)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x [B, L, d], e [B, L, d] (the time embedding before the projection)."""
        shift, scale = (self.modulation.float().unsqueeze(0) + e.float().unsqueeze(2)).unbind(dim=2)
        return self.head(modulate(self.norm(x), shift, scale).type_as(x))


class MLPProj(nn.Module):
    """CLIP token projector: LN -> Linear -> GELU (exact) -> Linear -> LN (both LNs affine, eps 1e-5)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim), nn.GELU(),
                                  nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


# --- the model -----------------------------------------------------------------


class WanModel(nn.Module):
    """The WAN video DiT in plain video mode: full attention, per-token timesteps.

    forward(x [B, C_in, F, H, W], t [B] or [B, L], context [B, L_txt<=text_len, text_dim],
            clip_feature [B, clip_tokens, clip_dim] for i2v) -> [B, C_out, F, H', W']
    """

    def __init__(self, args: WanDiTArgs):
        super().__init__()
        self.args = args
        dim = args.dim
        self.patch_embedding = nn.Conv3d(args.in_dim, dim, kernel_size=args.patch_size, stride=args.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(args.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(args.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList([WanAttentionBlock(args) for _ in range(args.num_layers)])
        self.head = Head(dim, args.out_dim, args.patch_size, args.eps)
        if args.cross_attn_type == "i2v":
            self.img_emb = MLPProj(args.clip_dim, dim)

    # -- shared pieces, also used by the DreamZero model --

    def embed_video(self, latents: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """[B, C, F, H, W] -> tokens [B, F·h·w, dim] (f, h, w order) and the grid (f, h, w)."""
        if latents.dim() != 5 or latents.shape[1] != self.args.in_dim:
            raise ValueError(f"expected latents [B, {self.args.in_dim}, F, H, W], got {tuple(latents.shape)}")
        x = self.patch_embedding(latents.to(self.patch_embedding.weight.dtype))
        grid = tuple(x.shape[2:])
        return x.flatten(2).transpose(1, 2), grid  # type: ignore[return-value]

    def embed_time(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token timesteps [B, L] -> e [B, L, dim] and e0 [B, L, 6, dim], both fp32."""
        sin = sinusoidal_embedding_1d(self.args.freq_dim, t).float()
        w = self.time_embedding[0].weight
        e = self.time_embedding(sin.to(w.dtype)).float()
        e0 = self.time_projection(e.to(w.dtype)).float().unflatten(-1, (6, self.args.dim))
        return e, e0

    def embed_context(self, context: torch.Tensor, clip_feature: torch.Tensor | None,
                      text_rows: int | None = None) -> tuple[torch.Tensor | PaddedText, torch.Tensor | None]:
        """Text [B, L_txt, text_dim] zero-padded to text_len -> [B, text_len, dim]; CLIP -> [B, 257, dim].
        text_rows: the caller knows every row of `context` from this one on to be zero (`conditioning.prompt_rows`
        of its prompts): the text comes back as a PaddedText, whose K and V cost text_rows + 1 rows a sample."""
        a = self.args
        if context.dim() != 3 or context.shape[-1] != a.text_dim:
            raise ValueError(f"expected text context [B, L, {a.text_dim}], got {tuple(context.shape)}")
        if context.shape[1] > a.text_len:
            raise ValueError(f"text context has {context.shape[1]} tokens, more than text_len {a.text_len}")
        w = self.text_embedding[0].weight
        text_rows = a.padded_text_rows(text_rows)
        if text_rows is not None:
            zero = context.new_zeros(1, 1, a.text_dim, dtype=w.dtype)
            text = PaddedText(self.text_embedding(context[:, :text_rows].to(w.dtype)), self.text_embedding(zero),
                              a.text_len)
        else:
            if context.shape[1] < a.text_len:
                context = F.pad(context, (0, 0, 0, a.text_len - context.shape[1]))
            text = self.text_embedding(context.to(w.dtype))
        image = None
        if a.cross_attn_type == "i2v":
            if clip_feature is None:
                raise ValueError("this model has i2v cross-attention: clip_feature [B, clip_tokens, clip_dim] is required")
            if clip_feature.dim() != 3 or clip_feature.shape[-1] != a.clip_dim:
                raise ValueError(f"expected clip_feature [B, {a.clip_tokens}, {a.clip_dim}], got {tuple(clip_feature.shape)}")
            image = self.img_emb(clip_feature.to(self.img_emb.proj[1].weight.dtype))
        return text, image

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, f·h·w, p·q·r·C] -> [B, C, f·p, h·q, w·r]."""
        B = x.shape[0]
        f, h, w = grid
        p, q, r = self.args.patch_size
        c = self.args.out_dim
        x = x.reshape(B, f, h, w, p, q, r, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(B, c, f * p, h * q, w * r)

    def video_rope(self, grid: tuple[int, int, int], start_frame: int = 0) -> Rope:
        return Rope(video_rope_angles(grid, self.args.head_dim, start_frame, self.args.rope_theta,
                                      device=self.patch_embedding.weight.device))

    # -- plain video forward --

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                clip_feature: torch.Tensor | None = None) -> torch.Tensor:
        tokens, grid = self.embed_video(x)
        B, L = tokens.shape[:2]
        if t.dim() == 1:
            t = t[:, None].expand(B, L)
        if t.shape != (B, L):
            raise ValueError(f"timesteps must be [B] or [B, {L}] (one per token), got {tuple(t.shape)}")
        e, e0 = self.embed_time(t)
        text, image = self.embed_context(context, clip_feature)
        rope = self.video_rope(grid)
        for block in self.blocks:
            tokens = block(tokens, e0, rope, text, image)
        return self.unpatchify(self.head(tokens, e), grid)
