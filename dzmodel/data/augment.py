"""View augmentation for a whole micro-batch at once, on the training device (the device-resident data path).

The same transforms as the CPU loader's `transforms.transform_view`, batched: a crop of `crop_scale` of the stored
frame (a random offset in training, the centre otherwise), an antialiased bilinear resize to the view size, and
colour jitter (brightness, contrast, saturation, hue as one affine colour map, `transforms.color_jitter`). One crop
and one set of jitter factors per (sample, view), shared by every frame of the sample's window (a consistent camera
over time); every view draws its own.

Random choices are a pure function of (seed, stream position, view): `uniforms` hashes them with splitmix64 on the
host, vectorised over the micro-batch (no generator object per sample, no device read), and only the few numbers per
(sample, view) travel to the device. So a sample's augmentation does not depend on the micro-batch, accumulation or
world size, and a resumed run repeats it exactly. The draws follow the CPU loader's distributions (integer crop
offsets uniform over the valid range, factors uniform in [1 - x, 1 + x], hue in [-h, h]) but not its numpy streams,
so the two paths augment the same sample differently; with augmentation off (`train=False`) they give the same
images (tests/data/test_device_dataset.py).

Quantisation follows the CPU path: uint8 after the resize, float in [0, 1] for the jitter, rounded back to uint8
(the batch contract's dtype). On a CPU the resize is torch's uint8 antialiased kernel, exactly as the loader's; on a
GPU (which has no uint8 antialiased resize) it runs in float and is rounded, within one level of the CPU's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .transforms import _GRAY, _YIQ, _YIQ_INV

DRAWS_PER_VIEW = 6  # crop top, crop left, brightness, contrast, saturation, hue
_SALT = 0x5DEECE66D  # keeps these draws apart from any other hash of (seed, position)


# --- counter-based draws ------------------------------------------------------------------------


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """One splitmix64 step on a uint64 array (numpy arrays wrap on overflow)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seed: int, positions, count: int) -> np.ndarray:
    """[len(positions), count] float64 uniforms in [0, 1): number k of position p is a pure function of
    (seed, p, k), whatever else is in the batch."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1).astype(np.uint64)
    key = _splitmix64(np.array([(int(seed) ^ _SALT) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    key = _splitmix64(key ^ pos)                                     # [B]
    k = np.arange(1, count + 1, dtype=np.uint64)
    z = _splitmix64(key[:, None] ^ _splitmix64(k)[None, :])          # [B, count]
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# --- parameters -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViewAugment:
    """One view's transform: stored frames of `source` (H, W) -> `size` (the embodiment's view_size)."""

    source: tuple[int, int]
    size: tuple[int, int]
    crop_scale: float = 0.95
    jitter: dict[str, float] = field(default_factory=dict)

    @property
    def crop(self) -> tuple[int, int]:
        """(height, width) of the crop, as `transform_view` computes it."""
        H, W = self.source
        return max(1, round(H * self.crop_scale)), max(1, round(W * self.crop_scale))


@dataclass
class AugmentParams:
    """Per (sample, view) on the host: crop offsets and the jitter's colour map (None: no jitter)."""

    top: np.ndarray                 # int64 [B, V]
    left: np.ndarray                # int64 [B, V]
    matrix: np.ndarray | None       # float32 [B, V, 3, 3]: out = matrix @ rgb + coef * mean gray of the frame
    coef: np.ndarray | None         # float32 [B, V, 3]


def jitter_factors(u: np.ndarray, jitter: dict[str, float]) -> np.ndarray:
    """Uniforms [N, 4] -> (brightness, contrast, saturation, hue) [N, 4], drawn as `transforms.color_jitter` draws
    them: a factor in [1 - x, 1 + x] (1 when x is 0), the hue in [-h, h] (0 when h is 0)."""
    out = np.empty_like(u, dtype=np.float64)
    for i, name in enumerate(("brightness", "contrast", "saturation")):
        x = float(jitter.get(name, 0.0))
        out[:, i] = 1 - x + 2 * x * u[:, i] if x else 1.0
    h = float(jitter.get("hue", 0.0))
    out[:, 3] = -h + 2 * h * u[:, 3] if h else 0.0
    return out


_GRAY64 = _GRAY.double().numpy()
_G1 = np.ones((3, 1)) * _GRAY64[None, :]                 # x -> its luma in every channel (saturation 0)
_TO_YIQ, _FROM_YIQ = _YIQ.double().numpy(), _YIQ_INV.double().numpy()
# the hue rotation by angle a in YIQ, back in RGB: _HUE[0] + cos(a) _HUE[1] + sin(a) _HUE[2]
_HUE = np.stack([_FROM_YIQ @ m @ _TO_YIQ for m in (np.diag([1.0, 0.0, 0.0]), np.diag([0.0, 1.0, 1.0]),
                                                     np.array([[0.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]]))])
_HUE_G1 = _HUE @ _G1


def jitter_affine(factors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(b, c, s, h) [N, 4] -> the colour map of `transforms.color_jitter`: matrix [N, 3, 3] and coef [N, 3], so that
    jitter(x) = clamp(matrix @ x + coef * mean_gray(x), 0, 1) per pixel, mean_gray the frame's mean luma.
    There: matrix = hue @ sat * (c b) with sat = s I + (1 - s) G1 and hue the YIQ rotation by 2 pi h; the offset
    is rowsum(hue @ sat) (1 - c) b mean_gray. Both are expanded here over constant matrices (no per-sample matmul)."""
    b, c, s, h = (factors[:, i, None, None] for i in range(4))
    cos, sin = np.cos(2 * np.pi * h), np.sin(2 * np.pi * h)
    hue = _HUE[0] + cos * _HUE[1] + sin * _HUE[2]                       # [N, 3, 3]
    hue_g1 = _HUE_G1[0] + cos * _HUE_G1[1] + sin * _HUE_G1[2]           # hue @ G1
    hs = s * hue + (1 - s) * hue_g1                                     # hue @ sat
    return hs * (c * b), hs.sum(axis=2) * ((1 - c) * b)[:, :, 0]


def draw(seed: int, positions, views: list[ViewAugment], train: bool) -> AugmentParams:
    """Every (sample, view)'s crop and colour map; eval (`train=False`): centre crops and no jitter."""
    B, V = len(positions), len(views)
    top = np.empty((B, V), dtype=np.int64)
    left = np.empty((B, V), dtype=np.int64)
    u = uniforms(seed, positions, DRAWS_PER_VIEW * V).reshape(B, V, DRAWS_PER_VIEW) if train else None
    any_jitter = train and any(v.jitter for v in views)
    matrix = np.zeros((B, V, 3, 3), dtype=np.float32) if any_jitter else None  # views without jitter skip it
    coef = np.zeros((B, V, 3), dtype=np.float32) if any_jitter else None
    for j, view in enumerate(views):
        (H, W), (ch, cw) = view.source, view.crop
        if train:
            top[:, j] = np.minimum(np.floor(u[:, j, 0] * (H - ch + 1)), H - ch)
            left[:, j] = np.minimum(np.floor(u[:, j, 1] * (W - cw + 1)), W - cw)
        else:
            top[:, j], left[:, j] = (H - ch) // 2, (W - cw) // 2
        if any_jitter and view.jitter:
            matrix[:, j], coef[:, j] = jitter_affine(jitter_factors(u[:, j, 2:], view.jitter))
    return AugmentParams(top, left, matrix, coef)


# --- applying them on the device --------------------------------------------------------------------


def crop_gather(frames: torch.Tensor, index: torch.Tensor, top: torch.Tensor, left: torch.Tensor,
                crop: tuple[int, int]) -> torch.Tensor:
    """frames uint8 [N, H, W, 3] (a whole recording), index [B, T] rows of it, top/left [B]: the cropped windows
    uint8 [B, T, ch, cw, 3], read in one gather (only the crops' pixels)."""
    ch, cw = crop
    rows = top[:, None] + torch.arange(ch, device=frames.device)       # [B, ch]
    cols = left[:, None] + torch.arange(cw, device=frames.device)      # [B, cw]
    return frames[index[:, :, None, None], rows[:, None, :, None], cols[:, None, None, :]]


def resize(x: torch.Tensor, size: tuple[int, int], uint8_kernel: bool | None = None) -> torch.Tensor:
    """uint8 [B, T, h, w, 3] -> uint8 [B, T, size, 3], antialiased bilinear (identity at the same size). A CPU uses
    torch's uint8 kernel on the channels-last view, as `transform_view` does; other devices (no uint8 antialiased
    kernel) resize in float and round. uint8_kernel: force one or the other (tests)."""
    B, T, h, w, _ = x.shape
    if (h, w) == tuple(size):
        return x
    planes = x.reshape(B * T, h, w, 3).permute(0, 3, 1, 2)
    if uint8_kernel if uint8_kernel is not None else x.device.type == "cpu":
        out = F.interpolate(planes, size=size, mode="bilinear", align_corners=False, antialias=True)
    else:
        out = F.interpolate(planes.float(), size=size, mode="bilinear", align_corners=False, antialias=True)
        out = out.round_().clamp_(0, 255).to(torch.uint8)
    return out.permute(0, 2, 3, 1).reshape(B, T, *size, 3)


def color_jitter(x: torch.Tensor, matrix: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """uint8 [B, T, H, W, 3], one colour map per sample (matrix [B, 3, 3], coef [B, 3]) -> uint8, as
    `transforms.color_jitter` maps one view: in [0, 1], offset by each frame's mean gray, clamped, rounded."""
    xf = x.float().div_(255.0)
    mean_gray = xf.mean(dim=(2, 3)) @ _GRAY.to(xf.device)                                   # [B, T]
    offset = coef[:, None, :] * mean_gray[:, :, None]                                       # [B, T, 3]
    out = torch.einsum("btxyj,bij->btxyi", xf, matrix) + offset[:, :, None, None, :]
    return out.clamp_(0, 1).mul_(255).round_().to(torch.uint8)


def augment_view(frames: torch.Tensor, index: torch.Tensor, view: ViewAugment, top: torch.Tensor,
                 left: torch.Tensor, matrix: torch.Tensor | None = None, coef: torch.Tensor | None = None) -> torch.Tensor:
    """One view of a micro-batch: gather + crop, resize to the view size, jitter when a colour map is given.
    -> uint8 [B, T, view h, view w, 3]."""
    x = resize(crop_gather(frames, index, top, left, view.crop), view.size)
    if matrix is not None and view.jitter:
        x = color_jitter(x, matrix, coef)
    return x


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on the device without waiting: pinned and copied asynchronously on CUDA."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def params_to_device(aug: AugmentParams, device: torch.device, ints: np.ndarray | None = None):
    """The draws on `device` in at most two asynchronous copies -> (ints, top, left, matrix, coef): `ints`, extra
    int64 columns [B, k] of the caller (e.g. each window's first row) that travel with the crop offsets, or None;
    top/left [B, V]; matrix [B, V, 3, 3] and coef [B, V, 3], or None without jitter."""
    B, V = aug.top.shape
    k = 0 if ints is None else ints.shape[1]
    packed = to_device(np.concatenate(([] if ints is None else [ints]) + [aug.top, aug.left], axis=1), device)
    matrix = coef = None
    if aug.matrix is not None:
        floats = to_device(np.concatenate([aug.matrix.reshape(B, -1), aug.coef.reshape(B, -1)], axis=1), device)
        matrix, coef = floats[:, :9 * V].reshape(B, V, 3, 3), floats[:, 9 * V:].reshape(B, V, 3)
    return (packed[:, :k] if k else None), packed[:, k:k + V], packed[:, k + V:], matrix, coef


def augment_views(frames: dict[str, torch.Tensor], index: torch.Tensor, views: dict[str, ViewAugment],
                  top: torch.Tensor, left: torch.Tensor, matrix: torch.Tensor | None,
                  coef: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Every view of a micro-batch (`augment_view`), view j taking column j of the draws (`params_to_device`)."""
    return {short: augment_view(frames[short], index, view, top[:, j], left[:, j],
                                None if matrix is None else matrix[:, j], None if coef is None else coef[:, j])
            for j, (short, view) in enumerate(views.items())}


def stored_size(source: tuple[int, int], view: tuple[int, int], crop_scale: float) -> tuple[int, int]:
    """The size frames are kept at on the device: as recorded, unless larger than a crop of `crop_scale` needs to
    reach the view size (then downscaled once, at load, to ceil(view / crop_scale): the crop margin stays, the
    memory is bounded)."""
    need = tuple(math.ceil(v / crop_scale) for v in view)
    if source[0] <= need[0] and source[1] <= need[1]:
        return tuple(source)
    return need
