"""Model dimensions as plain dataclasses, and the named presets.

`WanDiTArgs` describes a WAN video DiT (the public Wan2.1/Wan2.2 checkpoints).
`DreamZeroArgs` extends it with DreamZero's action/state register and the
teacher-forcing layout (reference §1.2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

CrossAttnType = Literal["t2v", "i2v"]


@dataclass
class WanDiTArgs:
    dim: int = 3072
    ffn_dim: int = 14336
    num_heads: int = 24
    num_layers: int = 30
    in_dim: int = 48
    out_dim: int = 48
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    # "t2v": text cross-attention only (Wan2.2-TI2V-5B, Wan2.1-T2V).
    # "i2v": text + CLIP image cross-attention (Wan2.1-I2V-14B, every DreamZero model).
    cross_attn_type: CrossAttnType = "t2v"
    clip_dim: int = 1280
    clip_tokens: int = 257
    qk_norm: bool = True
    cross_attn_norm: bool = True
    rope_theta: float = 10000.0
    rope_max_positions: int = 1024

    def __post_init__(self) -> None:
        self.patch_size = tuple(int(p) for p in self.patch_size)  # type: ignore[assignment]
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.cross_attn_type not in ("t2v", "i2v"):
            raise ValueError(f"cross_attn_type must be 't2v' or 'i2v', got {self.cross_attn_type!r}")
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must have 3 entries, got {self.patch_size}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def padded_text_rows(self, text_rows: int | None) -> int | None:
        """`text_rows` where it leaves padding rows out of the text's projections (0 < text_rows < text_len),
        else None: the forward (`WanModel.embed_context`) and the FLOP count (`flops.py`) read it from here."""
        return text_rows if text_rows is not None and 0 < text_rows < self.text_len else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WanDiTArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown config keys {unknown}")
        return cls(**d)


@dataclass
class DreamZeroArgs(WanDiTArgs):
    cross_attn_type: CrossAttnType = "i2v"
    action_dim: int = 32            # max_action_dim: actions are zero-padded to this
    max_state_dim: int = 64
    hidden_size: int = 1024         # width of the state encoder / action decoder MLPs
    num_frame_per_block: int = 2    # latent frames per causal block
    num_action_per_block: int = 24  # = action_horizon
    num_state_per_block: int = 1
    max_chunk_size: int = 4         # blocks per training window -> 1 + 2*4 = 9 latent frames
    concat_first_frame_latent: bool = False  # 14B: concat [mask; first-frame latent] channels
    action_rope_positions: int = 10240
    state_rope_positions: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cross_attn_type != "i2v":
            raise ValueError("DreamZero models use the i2v (text + CLIP) cross-attention")
        for name in ("num_frame_per_block", "num_action_per_block", "num_state_per_block", "max_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

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
