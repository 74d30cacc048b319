"""Model dimensions as plain dataclasses, and the named presets.

`WanDiTArgs` describes a WAN video DiT (the public Wan2.1/Wan2.2 checkpoints).
`DreamZeroArgs` extends it with DreamZero's action/state register and the
teacher-forcing layout (reference §1.2).

Every dimension is an integer inside its field's range (the metadata, checked by `dzmodel.schema`), and the whole
model must fit what one device holds: `serving_bytes()` (the bf16 weights plus one request's text context, caches
and activations) is at most `max_model_bytes()`, the environment's DZ_MAX_MODEL_BYTES or 80 GB. A config.json, a
preset's overrides and args built in code all pass through these checks before anything is allocated.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..schema import build, field_problems

CrossAttnType = Literal["t2v", "i2v"]

MAX_MODEL_BYTES_ENV = "DZ_MAX_MODEL_BYTES"
DEFAULT_MAX_MODEL_BYTES = 80 * 10**9  # one 80 GB accelerator: the 14B preset in bf16 (~33 GB) fits with room
WEIGHT_BYTES = 2                      # bf16, the dtype inference serves
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _dims(high: int, low: int = 1) -> dict[str, int]:
    """A dimension's range: an integer in [low, high]."""
    return {"min": low, "max": high}


def max_model_bytes() -> int:
    """The most bytes a model may need (`serving_bytes`): DZ_MAX_MODEL_BYTES (bytes, or with a unit: 40GB, 64GiB),
    else 80 GB."""
    text = os.environ.get(MAX_MODEL_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_MODEL_BYTES
    number = text.rstrip("BbIiKkMmGgTt ")
    unit = text[len(number):].strip().upper()
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{MAX_MODEL_BYTES_ENV}={text!r}: expected a positive number of bytes, e.g. 80GB or "
                         f"64GiB or 80000000000")
    return int(value * _UNITS[unit])


def size_text(n: float) -> str:
    """Bytes in decimal units: 12.8 GB."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def count_text(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


@dataclass
class WanDiTArgs:
    dim: int = field(default=3072, metadata=_dims(65536))
    ffn_dim: int = field(default=14336, metadata=_dims(262144))
    num_heads: int = field(default=24, metadata=_dims(1024))
    num_layers: int = field(default=30, metadata=_dims(1024))
    in_dim: int = field(default=48, metadata=_dims(4096))
    out_dim: int = field(default=48, metadata=_dims(4096))
    text_dim: int = field(default=4096, metadata=_dims(65536))
    text_len: int = field(default=512, metadata=_dims(65536))  # tokens of the text context
    freq_dim: int = field(default=256, metadata=_dims(65536, 2))
    patch_size: tuple[int, int, int] = field(default=(1, 2, 2), metadata=_dims(64))
    eps: float = field(default=1e-6, metadata={"gt": 0, "lt": 1})
    # "t2v": text cross-attention only (Wan2.2-TI2V-5B, Wan2.1-T2V).
    # "i2v": text + CLIP image cross-attention (Wan2.1-I2V-14B, every DreamZero model).
    cross_attn_type: CrossAttnType = "t2v"
    clip_dim: int = field(default=1280, metadata=_dims(65536))
    clip_tokens: int = field(default=257, metadata=_dims(65536))
    qk_norm: bool = True
    cross_attn_norm: bool = True
    rope_theta: float = field(default=10000.0, metadata={"gt": 0, "max": 1e12})
    rope_max_positions: int = field(default=1024, metadata=_dims(2**20))

    def __post_init__(self) -> None:
        self.patch_size = tuple(int(p) for p in self.patch_size)  # type: ignore[assignment]
        problems = field_problems(self)  # the ranges, for args built in code (`from_dict` checks types too)
        if problems:
            raise ValueError("; ".join(problems))
        self._check_layout()
        self._check_size()

    def _check_layout(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.cross_attn_type not in ("t2v", "i2v"):
            raise ValueError(f"cross_attn_type must be 't2v' or 'i2v', got {self.cross_attn_type!r}")
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must have 3 entries, got {self.patch_size}")

    def _check_size(self) -> None:
        """The whole model within what one device holds (`max_model_bytes`), by an estimate that allocates
        nothing."""
        limit, weights, request = max_model_bytes(), self.param_count() * WEIGHT_BYTES, self.request_bytes()
        if weights + request <= limit:
            return
        names = self._weight_fields() if weights >= request else self._request_fields()
        lead = ", ".join(f"{name} {getattr(self, name)}" for name in names)
        raise ValueError(f"{lead}: needs ~{size_text(weights + request)} ({size_text(weights)} for "
                         f"{count_text(self.param_count())} parameters in bf16, {size_text(request)} for one request's "
                         f"text context, caches and activations), over the limit of {size_text(limit)} (set "
                         f"{MAX_MODEL_BYTES_ENV} to change it)")

    def _weight_fields(self) -> tuple[str, ...]:
        return ("dim", "ffn_dim", "num_layers")

    def _request_fields(self) -> tuple[str, ...]:
        return ("text_len", "clip_tokens") if self.cross_attn_type == "i2v" else ("text_len",)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def param_count(self) -> int:
        """The parameters `WanModel` holds, counted from the dimensions (equal to the built model's, tested)."""
        d, f, L = self.dim, self.ffn_dim, self.num_layers
        linear = lambda i, o: i * o + o  # noqa: E731 - a Linear with bias
        patch = math.prod(self.patch_size)
        qk_norms = 2 * d if self.qk_norm else 0
        attention = 4 * linear(d, d) + qk_norms
        cross = attention + (2 * linear(d, d) + (d if self.qk_norm else 0) if self.cross_attn_type == "i2v" else 0)
        block = attention + (2 * d if self.cross_attn_norm else 0) + cross + linear(d, f) + linear(f, d) + 6 * d
        embeddings = (self.in_dim * d * patch + d + linear(self.text_dim, d) + linear(d, d)
                      + linear(self.freq_dim, d) + linear(d, d) + linear(d, 6 * d))
        head = linear(d, patch * self.out_dim) + 2 * d
        image = (2 * self.clip_dim + linear(self.clip_dim, self.clip_dim) + linear(self.clip_dim, d) + 2 * d
                 if self.cross_attn_type == "i2v" else 0)
        return embeddings + L * block + head + image

    def request_tokens(self, tokens_per_frame: int = 1) -> int:
        """Self-attention tokens one request keeps (a frame here: WAN's video models run no register)."""
        return tokens_per_frame

    def request_bytes(self, tokens_per_frame: int = 1, dtype_bytes: int = WEIGHT_BYTES) -> int:
        """The memory one request needs beside the weights, estimated: the prompt's token ids, its fp32 text
        embedding and projected rows, the image tokens, every layer's cross-attention K/V and self-attention KV
        cache, and one block's activations. `tokens_per_frame` (latent tokens of a frame: the camera's size, not a
        model dimension) defaults to 1, so the estimate is a lower bound."""
        d = self.dim
        image_tokens = self.clip_tokens if self.cross_attn_type == "i2v" else 0
        context = self.text_len + image_tokens
        tokens = self.request_tokens(tokens_per_frame)
        text = self.text_len * (16 + 4 * self.text_dim + dtype_bytes * d)
        image = image_tokens * (4 * self.clip_dim + dtype_bytes * d)
        caches = self.num_layers * 2 * (context + tokens) * d * dtype_bytes
        activations = tokens * (dtype_bytes * (self.ffn_dim + 4 * d) + 4 * 6 * d)
        return text + image + caches + activations

    def serving_bytes(self, tokens_per_frame: int = 1) -> int:
        """bf16 weights plus one request (`request_bytes`): what `max_model_bytes` bounds."""
        return self.param_count() * WEIGHT_BYTES + self.request_bytes(tokens_per_frame)

    def padded_text_rows(self, text_rows: int | None) -> int | None:
        """`text_rows` where it leaves padding rows out of the text's projections (0 < text_rows < text_len),
        else None: the forward (`WanModel.embed_context`) and the FLOP count (`flops.py`) read it from here."""
        return text_rows if text_rows is not None and 0 < text_rows < self.text_len else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "WanDiTArgs":
        """Args from a mapping (config.json's, a preset's with overrides): unknown keys, wrong types, values out of
        range and a model past `max_model_bytes` are one SchemaError (a ValueError) naming each field."""
        return build(cls, d)


@dataclass
class DreamZeroArgs(WanDiTArgs):
    cross_attn_type: CrossAttnType = "i2v"
    action_dim: int = field(default=32, metadata=_dims(4096))  # max_action_dim: actions are zero-padded to this
    max_state_dim: int = field(default=64, metadata=_dims(4096))
    hidden_size: int = field(default=1024, metadata=_dims(65536))  # width of the state encoder / action decoder MLPs
    num_frame_per_block: int = field(default=2, metadata=_dims(1024))  # latent frames per causal block
    num_action_per_block: int = field(default=24, metadata=_dims(4096))  # = action_horizon
    num_state_per_block: int = field(default=1, metadata=_dims(4096))
    max_chunk_size: int = field(default=4, metadata=_dims(1024))  # blocks per training window -> 1 + 2*4 = 9 latent frames
    concat_first_frame_latent: bool = False  # 14B: concat [mask; first-frame latent] channels
    action_rope_positions: int = field(default=10240, metadata=_dims(2**24))
    state_rope_positions: int = field(default=1024, metadata=_dims(2**24))

    def _check_layout(self) -> None:
        super()._check_layout()
        if self.cross_attn_type != "i2v":
            raise ValueError("DreamZero models use the i2v (text + CLIP) cross-attention")
        for name in ("num_frame_per_block", "num_action_per_block", "num_state_per_block", "max_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def param_count(self) -> int:
        """`DreamZeroWAM`'s parameters: the WAN DiT's plus the state encoder, action encoder and action decoder."""
        d, h = self.dim, self.hidden_size
        linear = lambda i, o: i * o + o  # noqa: E731
        state_encoder = linear(self.max_state_dim, h) + linear(h, d)
        action_encoder = linear(self.action_dim, d) + linear(2 * d, d) + linear(d, d)
        action_decoder = linear(d, h) + linear(h, self.action_dim)
        return super().param_count() + state_encoder + action_encoder + action_decoder

    def request_tokens(self, tokens_per_frame: int = 1) -> int:
        """The local attention window's frames plus the action and state tokens of its blocks."""
        register = self.max_chunk_size * (self.num_action_per_block + self.num_state_per_block)
        return self.local_attn_size * tokens_per_frame + register

    def _request_fields(self) -> tuple[str, ...]:
        return super()._request_fields() + ("num_action_per_block", "max_chunk_size")

    @property
    def num_frames(self) -> int:
        """Latent frames of one training window: frame 0 plus max_chunk_size blocks."""
        return 1 + self.num_frame_per_block * self.max_chunk_size

    @property
    def local_attn_size(self) -> int:
        return self.max_chunk_size * self.num_frame_per_block + 1

    def flops(self, latent_hw: tuple[int, int], num_frames: int | None = None, noisy_first_frame: bool = True,
              text_rows: int | None = None):
        """Forward FLOPs of one sample over a latent grid (H, W before patching), counting what `forward` runs
        (`dzmodel.model.flops`; equal to torch's FlopCounterMode on the tiny preset, tested). With `text_rows`, the
        text's rows projected: those and the pad row, counted per sample though the pad row runs once a batch.
        `.train()` of the result is the training step's model FLOPs per sample (3 x forward)."""
        from .attention import latent_layout
        from .flops import wam_forward_flops

        return wam_forward_flops(self, latent_layout(self, latent_hw, num_frames,
                                                     noisy_first_frame=noisy_first_frame), text_rows)


# --- presets -----------------------------------------------------------------

def _tiny() -> DreamZeroArgs:
    return DreamZeroArgs(
        dim=64, ffn_dim=128, num_heads=2, num_layers=2, in_dim=8, out_dim=8,
        text_dim=32, text_len=16, freq_dim=32, clip_dim=64, clip_tokens=17,
        action_dim=8, max_state_dim=8, hidden_size=32,
        num_frame_per_block=2, num_action_per_block=4, max_chunk_size=2,
    )


def _small() -> DreamZeroArgs:
    # The closed-loop profile's model (params.yaml libero_scripted): 10.5 M parameters, a few thousand steps in
    # about 20 minutes on one H100; tiny-family frozen encoders (seeded random: no WAN weights offline).
    return DreamZeroArgs(
        dim=256, ffn_dim=1024, num_heads=4, num_layers=8, in_dim=16, out_dim=16,
        text_dim=32, text_len=128, freq_dim=256, clip_dim=64, clip_tokens=17,
        action_dim=8, max_state_dim=8, hidden_size=256,
        num_frame_per_block=2, num_action_per_block=16, max_chunk_size=2,
    )


def _dreamzero_5b() -> DreamZeroArgs:
    # Wan2.2-TI2V-5B backbone + image cross-attention (randomly initialised at cold start).
    return DreamZeroArgs(
        dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48,
        num_action_per_block=24, concat_first_frame_latent=False,
    )


def _dreamzero_14b() -> DreamZeroArgs:
    # Wan2.1-I2V-14B backbone: in_dim 36 = 16 noisy + 4 mask + 16 first-frame latent.
    return DreamZeroArgs(
        dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_dim=36, out_dim=16,
        num_action_per_block=24, concat_first_frame_latent=True,
    )


def _wan22_ti2v_5b() -> WanDiTArgs:
    return WanDiTArgs(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48,
                      cross_attn_type="t2v")


def _wan21_i2v_14b() -> WanDiTArgs:
    return WanDiTArgs(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_dim=36, out_dim=16,
                      cross_attn_type="i2v")


PRESETS = {
    "tiny": _tiny,
    "small": _small,
    "dreamzero_5b": _dreamzero_5b,
    "dreamzero_14b": _dreamzero_14b,
    "wan2.2_ti2v_5b": _wan22_ti2v_5b,
    "wan2.1_i2v_14b": _wan21_i2v_14b,
}

# The DreamZero presets in the order `dz embodiment init --preset` lists them (the first is its default: the docs'
# first run trains tiny).
DREAMZERO_PRESETS = ("tiny", "small", "dreamzero_5b", "dreamzero_14b")


def action_horizons() -> dict[str, int]:
    """Each DreamZero preset's num_action_per_block: the action_horizon an embodiment trained with it must have."""
    return {name: PRESETS[name]().num_action_per_block for name in DREAMZERO_PRESETS}


# Presets whose frozen encoders and tokenizer are the project's small offline ones (no WAN files exist for them).
OFFLINE_PRESETS = ("tiny", "small")


def preset(name: str, **overrides: Any) -> WanDiTArgs:
    """A preset's args, with optional field overrides (e.g. num_layers=2 for a cut-down model)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    args = PRESETS[name]()
    if overrides:
        d = args.to_dict()
        unknown = sorted(set(overrides) - set(d))
        if unknown:
            raise ValueError(f"unknown override(s) for preset {name!r}: {unknown}; valid: {', '.join(sorted(d))}")
        d.update(overrides)
        args = type(args).from_dict(d)
    return args
