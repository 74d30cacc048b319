"""Per-sample transforms: view crop/resize/colour jitter, multi-view layout, q99 normalisation,
relative actions. Pure torch/numpy so they run in loader workers and on the GPU image alike.

Random choices (crop offset, jitter factors) come from a numpy Generator the caller seeds per sample,
and are shared by every frame of a view (a consistent camera over time), so a sample is a pure
function of (dataset, anchor, seed, position): resuming repeats it bit-exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .embodiments import Embodiment
from .errors import DataError

# --- normalisation -------------------------------------------------------------------------


@dataclass
class NormStats:
    """q99 normalisation: x̂ = clip(2(x − q01)/(q99 − q01) − 1, −1, 1); identity where q01 == q99."""

    q01: np.ndarray
    q99: np.ndarray

    def normalize(self, x: np.ndarray) -> np.ndarray:
        span = self.q99 - self.q01
        safe = np.where(span == 0, 1.0, span)
        out = np.clip(2 * (x - self.q01) / safe - 1, -1, 1)
        return np.where(span == 0, x, out)

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        span = self.q99 - self.q01
        out = (np.clip(x, -1, 1) + 1) / 2 * span + self.q01
        return np.where(span == 0, x, out)

    @classmethod
    def from_metadata(cls, stats: dict, keys: list[str], group: str, source: str = "metadata.json") -> "NormStats":
        """Concatenate per-key q01/q99 of `stats[group]` in `keys` order."""
        if group not in stats:
            raise DataError(f"{source}: no '{group}' statistics")
        q01, q99 = [], []
        for k in keys:
            if k not in stats[group]:
                raise DataError(f"{source}: no statistics for {group} key {k!r}")
            q01.append(np.asarray(stats[group][k]["q01"], dtype=np.float64))
            q99.append(np.asarray(stats[group][k]["q99"], dtype=np.float64))
        return cls(q01=np.concatenate(q01), q99=np.concatenate(q99))


# --- relative actions ------------------------------------------------------------------------


def relative_action_dims(emb: Embodiment, state_widths: dict[str, int],
                         action_widths: dict[str, int]) -> list[tuple[slice, slice]]:
    """(action slice, state slice) pairs, in the concatenated action/state vectors, of the relative keys."""
    def offsets(keys, widths):
        out, pos = {}, 0
        for k in keys:
            out[k.name] = slice(pos, pos + widths[k.name])
            pos += widths[k.name]
        return out

    a_off = offsets(emb.action, action_widths)
    s_off = offsets(emb.state, state_widths)
    pairs = []
    for key in emb.relative_action_keys:
        a, s = a_off[key], s_off[key]
        if a.stop - a.start != s.stop - s.start:
            raise DataError(f"embodiment {emb.tag!r}: relative key {key!r} has {a.stop - a.start} action dims "
                            f"but {s.stop - s.start} state dims")
        pairs.append((a, s))
    return pairs


def to_relative(actions: np.ndarray, states: np.ndarray, horizon: int, pairs) -> np.ndarray:
    """actions [K·H, A], states [K, S] (raw, un-normalised): chunk c minus the state at its anchor."""
    out = actions.copy()
    for a, s in pairs:
        out[:, a] -= np.repeat(states[:, s], horizon, axis=0)
    return out


def from_relative(actions: np.ndarray, state: np.ndarray, pairs) -> np.ndarray:
    """Inverse at inference: one chunk [H, A] plus the observed state [S]."""
    out = actions.copy()
    for a, s in pairs:
        out[:, a] += state[s]
    return out


# --- images ----------------------------------------------------------------------------------


def _rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(-3)
    maxc, _ = x.max(-3)
    minc, _ = x.min(-3)
    v = maxc
    delta = maxc - minc
    s = torch.where(maxc > 0, delta / maxc.clamp_min(1e-8), torch.zeros_like(maxc))
    d = delta.clamp_min(1e-8)
    h = torch.where(maxc == r, ((g - b) / d) % 6, torch.where(maxc == g, (b - r) / d + 2, (r - g) / d + 4))
    h = torch.where(delta > 0, h / 6, torch.zeros_like(h))
    return torch.stack([h, s, v], -3)


def _hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    h, s, v = x.unbind(-3)
    i = torch.floor(h * 6)
    f = h * 6 - i
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    i = i.long() % 6
    choices = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)]
    out = [torch.zeros_like(v) for _ in range(3)]
    for k, (rr, gg, bb) in enumerate(choices):
        m = i == k
        out[0] = torch.where(m, rr, out[0])
        out[1] = torch.where(m, gg, out[1])
        out[2] = torch.where(m, bb, out[2])
    return torch.stack(out, -3)


def color_jitter(x: torch.Tensor, rng: np.random.Generator, brightness=0.0, contrast=0.0, saturation=0.0,
                 hue=0.0) -> torch.Tensor:
    """x float [T, 3, H, W] in [0, 1]; one set of factors for all frames."""
    gray_w = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype).view(1, 3, 1, 1)
    if brightness:
        x = (x * rng.uniform(1 - brightness, 1 + brightness)).clamp(0, 1)
    if contrast:
        mean = (x * gray_w).sum(1, keepdim=True).mean(dim=(-2, -1), keepdim=True)
        c = rng.uniform(1 - contrast, 1 + contrast)
        x = (c * x + (1 - c) * mean).clamp(0, 1)
    if saturation:
        gray = (x * gray_w).sum(1, keepdim=True)
        s = rng.uniform(1 - saturation, 1 + saturation)
        x = (s * x + (1 - s) * gray).clamp(0, 1)
    if hue:
        hsv = _rgb_to_hsv(x)
        hsv[:, 0] = (hsv[:, 0] + rng.uniform(-hue, hue)) % 1.0
        x = _hsv_to_rgb(hsv).clamp(0, 1)
    return x


def transform_view(frames: np.ndarray, size: tuple[int, int], train: bool, rng: np.random.Generator,
                   crop_scale: float = 0.95, jitter: dict | None = None) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> uint8 [T, size_h, size_w, 3]: crop (random in train, centre in eval), resize,
    colour jitter (train only)."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise DataError(f"expected frames [T, H, W, 3], got {frames.shape}")
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255.0
    H, W = x.shape[-2:]
    ch, cw = max(1, round(H * crop_scale)), max(1, round(W * crop_scale))
    if train:
        top, left = int(rng.integers(0, H - ch + 1)), int(rng.integers(0, W - cw + 1))
    else:
        top, left = (H - ch) // 2, (W - cw) // 2
    x = x[..., top:top + ch, left:left + cw]
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    if train and jitter:
        x = color_jitter(x.clamp(0, 1), rng, **jitter)
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


def compose_layout(emb: Embodiment, views: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-view uint8 [T, h, w, 3] -> one frame [T, rows·h, cols·w, 3] following emb.layout."""
    h, w = emb.view_size
    rows = []
    for row in emb.layout:
        cells = []
        for cell in row:
            v = views[cell.view]
            if cell.width != 1:
                x = v.permute(0, 3, 1, 2).float()
                v = F.interpolate(x, size=(h, w * cell.width), mode="bilinear", align_corners=False)
                v = v.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
            cells.append(v)
        rows.append(torch.cat(cells, dim=2))
    return torch.cat(rows, dim=1)
