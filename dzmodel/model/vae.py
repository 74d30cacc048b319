"""The WAN video VAEs: Wan2.1 (`WanVideoVAE`, z=16, 8x spatial) and Wan2.2 (`WanVideoVAE38`, z=48, 16x).

Both are causal 3D conv autoencoders with 4x temporal compression: T = 1 + 4k frames become
1 + k latent frames. The first frame is encoded on its own (so a single image is a valid video)
and every later latent frame summarises 4 new frames.

Encode and decode run chunk by chunk, as upstream does: the encoder sees frame 0, then chunks of
4 frames; the decoder sees one latent frame at a time. Causal layers keep what they need from
earlier chunks in a `StreamState`, so memory stays bounded for long videos and the numbers match
the reference implementation (some layers, e.g. the Wan2.2 avg-pool shortcuts, depend on the
chunking, so chunking is part of the model, not an optimisation).

Module and parameter names follow the public checkpoints key for key (see
`specs/wan_state_dict_manifest.json`, entries `wan2.1_vae` and `wan2.2_vae`).

Latents are normalised per channel: encode returns (mu - mean_c) / std_c; decode inverts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn

from .vae_blocks import CausalConv3d, Decoder3d, Encoder3d, StreamState

__all__ = [
    "WAN21_LATENTS_MEAN",
    "WAN21_LATENTS_STD",
    "WAN22_LATENTS_MEAN",
    "WAN22_LATENTS_STD",
    "StreamState",
    "WanVAEConfig",
    "WanVAE38Config",
    "WanVideoVAE",
    "WanVideoVAE38",
    "run_vae_fixture",
]

# Published per-channel latent statistics (Wan2.1 VAE, z=16).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)

# Published per-channel latent statistics (Wan2.2 VAE, z=48).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)

FRAMES_PER_LATENT = 4  # temporal compression; also the encoder's chunk length after frame 0


# --- configs ------------------------------------------------------------------------


def _parse_bools(text: str, key: str) -> tuple[bool, ...]:
    words = {"true": True, "1": True, "false": False, "0": False}
    try:
        return tuple(words[w.strip().lower()] for w in text.split(",") if w.strip())
    except KeyError:
        raise ValueError(f"metadata {key}={text!r}: expected comma-separated True/False") from None


def _parse_ints(text: str, key: str) -> tuple[int, ...]:
    try:
        return tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise ValueError(f"metadata {key}={text!r}: expected comma-separated integers") from None


@dataclass(frozen=True)
class WanVAEConfig:
    """Wan2.1 VAE (the one paired with the 14B DiT). Defaults are the released model.

    `latents_mean` / `latents_std` hold either z_dim values or a single value for all channels.
    `temperal_downsample` keeps upstream's spelling so configs read like the reference.
    """

    dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD

    def __post_init__(self):
        # Accept lists / scalars for convenience; store tuples so the config stays hashable.
        for name in ("dim_mult", "temperal_downsample", "latents_mean", "latents_std"):
            value = getattr(self, name)
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "temperal_downsample", tuple(bool(v) for v in self.temperal_downsample))
        object.__setattr__(self, "latents_mean", tuple(float(v) for v in self.latents_mean))
        object.__setattr__(self, "latents_std", tuple(float(v) for v in self.latents_std))
        self._validate()

    def _validate(self):
        problems = []
        for name in ("dim", "z_dim", "num_res_blocks"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.dim_mult) < 2 or min(self.dim_mult) < 1:
            problems.append(f"dim_mult must hold >= 2 positive ints, got {self.dim_mult}")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            problems.append(f"temperal_downsample needs {len(self.dim_mult) - 1} flags (one per "
                            f"downsampling stage), got {self.temperal_downsample}")
        if sum(self.temperal_downsample) != 2:
            # Chunks of 4 frames must shrink 4 -> 2 -> 1 latent frame.
            problems.append(f"temperal_downsample must hold exactly two True (4x temporal compression), "
                            f"got {self.temperal_downsample}")
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) not in (1, self.z_dim):
                problems.append(f"{name} needs 1 or z_dim={self.z_dim} values, got {len(getattr(self, name))}")
        if any(s == 0 for s in self.latents_std):
            problems.append("latents_std must be non-zero")
        if problems:
            raise ValueError(f"bad {type(self).__name__}: " + "; ".join(problems))

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]):
        """Build from a fixture's safetensors metadata (all strings). Keys absent from the
        metadata keep this preset's value; `scale` is "mean,std" (two scalars) or z_dim means
        followed by z_dim stds. Unknown keys are ignored."""
        updates: dict = {}
        names = {f.name for f in fields(cls)}
        for key in ("dim", "dec_dim", "z_dim", "num_res_blocks"):
            if key in names and key in metadata:
                try:
                    updates[key] = int(metadata[key])
                except ValueError:
                    raise ValueError(f"metadata {key}={metadata[key]!r}: expected an integer") from None
        if "dim_mult" in metadata:
            updates["dim_mult"] = _parse_ints(metadata["dim_mult"], "dim_mult")
        if "temperal_downsample" in metadata:
            updates["temperal_downsample"] = _parse_bools(metadata["temperal_downsample"], "temperal_downsample")
        if "scale" in metadata:
            try:
                values = [float(v) for v in metadata["scale"].split(",") if v.strip()]
            except ValueError:
                raise ValueError(f"metadata scale={metadata['scale']!r}: expected comma-separated numbers") from None
            if len(values) % 2:
                raise ValueError(f"metadata scale has {len(values)} values; expected mean and std halves")
            half = len(values) // 2
            updates["latents_mean"], updates["latents_std"] = tuple(values[:half]), tuple(values[half:])
        elif "z_dim" in updates and updates["z_dim"] != cls.z_dim:
            # The preset's statistics belong to the preset's z_dim; don't silently broadcast them.
            updates["latents_mean"], updates["latents_std"] = (0.0,), (1.0,)
        return replace(cls(), **updates)


@dataclass(frozen=True)
class WanVAE38Config(WanVAEConfig):
    """Wan2.2 VAE (the one paired with the TI2V-5B DiT). Defaults are the released model.
    The decoder has its own width `dec_dim`; the encoder uses `dim`."""

    dim: int = 160
    z_dim: int = 48
    latents_mean: tuple[float, ...] = WAN22_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN22_LATENTS_STD
    dec_dim: int = 256

    def _validate(self):
        if self.dec_dim < 1:
            raise ValueError(f"bad {type(self).__name__}: dec_dim must be >= 1, got {self.dec_dim}")
        super()._validate()

    @property
    def spatial_factor(self) -> int:
        return 2 * 2 ** (len(self.dim_mult) - 1)  # pixel-unshuffle 2, then a stride-2 per stage


# --- the VAEs ------------------------------------------------------------------------------


class _CausalVideoVAE(nn.Module):
    """Shared encode/decode loops. Subclasses build `encoder`/`decoder` and set `patch`."""

    patch = 1  # pixel-(un)shuffle factor applied around the encoder/decoder

    def __init__(self, config: WanVAEConfig, encoder: Encoder3d, decoder: Decoder3d):
        super().__init__()
        self.config = config
        z = config.z_dim
        self.encoder = encoder
        self.conv1 = CausalConv3d(2 * z, 2 * z, 1)  # -> (mu, log_var)
        self.conv2 = CausalConv3d(z, z, 1)
        self.decoder = decoder

    # --- latent normalisation (per channel; tensors made on the fly so meta/assign loads work)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # kept per (dtype, device, statistics): a CUDA graph cannot copy them from the host while it captures
        key = (like.dtype, like.device, self.config.latents_mean, self.config.latents_std)
        cache = self.__dict__.setdefault("_stats_cache", {})
        if key not in cache:
            mean = torch.tensor(self.config.latents_mean, dtype=like.dtype, device=like.device)
            inv_std = 1.0 / torch.tensor(self.config.latents_std, dtype=like.dtype, device=like.device)
            cache[key] = (mean.view(1, -1, 1, 1, 1), inv_std.view(1, -1, 1, 1, 1))
        return cache[key]

    def normalize_latents(self, mu: torch.Tensor) -> torch.Tensor:
        mean, inv_std = self._stats(mu)
        return (mu - mean) * inv_std  # same op order as upstream (multiply by 1/std)

    def denormalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, inv_std = self._stats(latents)
        return latents / inv_std + mean

    # --- input checks

    def _check_video(self, video, continued: bool = False) -> None:
        f = self.config.spatial_factor
        if not isinstance(video, torch.Tensor):
            raise ValueError(f"video must be a torch.Tensor [B, 3, T, H, W], got {type(video).__name__}")
        if video.dim() != 5:
            raise ValueError(f"video must have shape [B, 3, T, H, W] (rank 5), got rank {video.dim()} "
                             f"shape {tuple(video.shape)}")
        b, c, t, h, w = video.shape
        if c != 3:
            raise ValueError(f"video must have 3 (RGB) channels in dim 1, got {c} (shape {tuple(video.shape)})")
        if continued and (t < 1 or t % FRAMES_PER_LATENT):
            raise ValueError(f"a continued video stream takes 4k frames (4, 8, ...), got {t}")
        if not continued and (t < 1 or (t - 1) % FRAMES_PER_LATENT):
            raise ValueError(f"video must have 1 + 4k frames (1, 5, 9, ...), got {t}")
        if h < f or w < f or h % f or w % f:
            raise ValueError(f"video height and width must be positive multiples of {f}, got {h}x{w}")
        if b < 1:
            raise ValueError("video batch is empty")
        if not video.is_floating_point():
            raise ValueError(f"video must be a float tensor in [-1, 1], got {video.dtype}")

    def _check_latents(self, latents) -> None:
        z = self.config.z_dim
        if not isinstance(latents, torch.Tensor):
            raise ValueError(f"latents must be a torch.Tensor [B, {z}, T, h, w], got {type(latents).__name__}")
        if latents.dim() != 5:
            raise ValueError(f"latents must have shape [B, {z}, T, h, w] (rank 5), got rank {latents.dim()} "
                             f"shape {tuple(latents.shape)}")
        if latents.shape[1] != z:
            raise ValueError(f"latents must have z_dim={z} channels in dim 1, got {latents.shape[1]}")
        if min(latents.shape) < 1:
            raise ValueError(f"latents have an empty dimension: shape {tuple(latents.shape)}")
        if not latents.is_floating_point():
            raise ValueError(f"latents must be a float tensor, got {latents.dtype}")

    # --- pixel (un)shuffle (Wan2.2 only); channel order (c, dw, dh) as upstream

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch
        if p == 1:
            return x
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
        return x.reshape(b, c * p * p, t, h // p, w // p)

    def _unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch
        if p == 1:
            return x
        b, c, t, h, w = x.shape
        x = x.reshape(b, c // (p * p), p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
        return x.reshape(b, c // (p * p), t, h * p, w * p)

    # --- public API

    def encode(self, video: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        """[B, 3, 1+4k, H, W] in [-1, 1] -> normalised latent mean [B, z, 1+k, H/f, W/f].

        With a `state` that has seen earlier frames, `video` continues that stream: 4k new frames give k latent
        frames, equal to the last k of encoding the whole video at once (the encoder is causal), so a robot's
        new frames are encoded without re-encoding its history."""
        return self.encode_moments(video, state)[0]

    def encode_moments(self, video: torch.Tensor,
                       state: StreamState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode`'s normalised latent mean, and the posterior's log-variance of the raw (unnormalised) latent,
        which training the VAE needs for its KL term (dzmodel/train/vision.py)."""
        continued = state is not None and state.started
        self._check_video(video, continued)
        x = self._patchify(video.to(self.conv1.weight.dtype))
        state = StreamState() if state is None else state
        # Frame 0 alone, then chunks of 4 frames: one latent frame each.
        first = 0 if continued else 1
        chunks = ([] if continued else [x[:, :, :1]]) + [x[:, :, s:s + FRAMES_PER_LATENT]
                                                         for s in range(first, x.shape[2], FRAMES_PER_LATENT)]
        feats = [self.encoder(chunk, state) for chunk in chunks]
        mu, log_var = self.conv1(torch.cat(feats, dim=2)).chunk(2, dim=1)
        return self.normalize_latents(mu), log_var

    def decode(self, latents: torch.Tensor, clamp: bool = False) -> torch.Tensor:
        """Normalised latents [B, z, 1+k, h, w] -> video [B, 3, 1+4k, h*f, w*f].

        Unclamped by default (the raw decoder output, as the reference module returns); pass
        clamp=True for display, as upstream's pipeline wrappers do."""
        self._check_latents(latents)
        x = self.conv2(self.denormalize_latents(latents.to(self.conv2.weight.dtype)))
        state = StreamState()
        frames = [self.decoder(x[:, :, i:i + 1], state) for i in range(x.shape[2])]
        video = self._unpatchify(torch.cat(frames, dim=2))
        return video.clamp(-1.0, 1.0) if clamp else video


class WanVideoVAE(_CausalVideoVAE):
    """Wan2.1 video VAE: z=16, 8x spatial, 4x temporal compression."""

    def __init__(self, config: WanVAEConfig | None = None):
        config = WanVAEConfig() if config is None else config
        if type(config) is not WanVAEConfig:
            raise ValueError(f"WanVideoVAE needs a WanVAEConfig, got {type(config).__name__}")
        c = config
        encoder = Encoder3d(3, c.dim, 2 * c.z_dim, c.dim_mult, c.num_res_blocks, c.temperal_downsample, staged=False)
        decoder = Decoder3d(c.dim, c.z_dim, 3, c.dim_mult, c.num_res_blocks, c.temperal_downsample[::-1],
                            staged=False)
        super().__init__(config, encoder, decoder)


class WanVideoVAE38(_CausalVideoVAE):
    """Wan2.2 video VAE: z=48, 16x spatial (pixel-unshuffle 2 then 3 stride-2 stages), 4x temporal,
    with avg-pool / duplicate shortcuts around each down / up stage."""

    patch = 2

    def __init__(self, config: WanVAE38Config | None = None):
        config = WanVAE38Config() if config is None else config
        if not isinstance(config, WanVAE38Config):
            raise ValueError(f"WanVideoVAE38 needs a WanVAE38Config, got {type(config).__name__}")
        c, pixels = config, 3 * self.patch**2
        encoder = Encoder3d(pixels, c.dim, 2 * c.z_dim, c.dim_mult, c.num_res_blocks, c.temperal_downsample,
                            staged=True)
        decoder = Decoder3d(c.dec_dim, c.z_dim, pixels, c.dim_mult, c.num_res_blocks, c.temperal_downsample[::-1],
                            staged=True)
        super().__init__(config, encoder, decoder)


# --- parity fixture ---------------------------------------------------------------------


def run_vae_fixture(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
    """tensors: the whole fixture file (keys 'weights.*', 'input.*', 'output.*'). Build the Wan2.2 VAE
    from metadata, load weights.* strictly, run encode (mean) and decode in fp32, and return
    {"latent_mu": ..., "decoded": ...}. Raises ValueError (StateDictError) listing missing /
    unexpected / mis-shaped keys, KeyError if input.video is absent."""
    from .state_dict import load_strict

    config = WanVAE38Config.from_metadata(metadata)
    with torch.device("meta"):
        vae = WanVideoVAE38(config)
    weights = {k[len("weights."):]: v.float() for k, v in tensors.items() if k.startswith("weights.")}
    load_strict(vae, weights, source="fixture weights.*", assign=True)
    vae.eval()
    if "input.video" not in tensors:
        raise KeyError("fixture has no input.video")
    with torch.no_grad():
        latent_mu = vae.encode(tensors["input.video"].float())
        decoded = vae.decode(latent_mu)
    return {"latent_mu": latent_mu, "decoded": decoded}
