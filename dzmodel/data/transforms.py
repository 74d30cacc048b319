"""The per-embodiment input and output pipeline, and its steps: view crop/resize/colour jitter, multi-view layout,
q99 normalisation, relative actions. Pure torch/numpy so they run in loader workers and on the GPU image alike.

`EmbodimentIO` is the one place that writes the order of the steps (views -> layout; state -> normalise; actions ->
relative -> normalise; and after the model, actions -> un-normalise -> absolute). The CPU loader
(`dataset.WindowDataset`), the device loader (`device_dataset`, the torch path) and the policy (`dzmodel/policy/`)
compose it, so a training sample and a served request for the same frame give the same model input
(tests/policy/test_transforms_skew.py).

It lives in the data layer, not beside the policy: the loaders sit below training, and the policy above it (it reads
a run's training config), so the pipeline both compose must sit below the loaders.

Random choices (crop offset, jitter factors) come from a numpy Generator the caller seeds per sample,
and are shared by every frame of a view (a consistent camera over time), so a sample is a pure
function of (dataset, anchor, seed, position): resuming repeats it bit-exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def normalize(self, x: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """numpy (float64), or a tensor with stats from `to` (the device loader: the same float64 arithmetic)."""
        span = self.q99 - self.q01
        if isinstance(x, torch.Tensor):
            safe = torch.where(span == 0, torch.ones_like(span), span)
            return torch.where(span == 0, x, (2 * (x - self.q01) / safe - 1).clamp(-1, 1))
        safe = np.where(span == 0, 1.0, span)
        out = np.clip(2 * (x - self.q01) / safe - 1, -1, 1)
        return np.where(span == 0, x, out)

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        span = self.q99 - self.q01
        out = (np.clip(x, -1, 1) + 1) / 2 * span + self.q01
        return np.where(span == 0, x, out)

    def to(self, device: torch.device | str) -> "NormStats":
        """The same statistics as float64 tensors on `device`, for `normalize` on tensors."""
        return NormStats(q01=torch.as_tensor(np.asarray(self.q01, dtype=np.float64), device=device),
                         q99=torch.as_tensor(np.asarray(self.q99, dtype=np.float64), device=device))

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


def action_key_stats(stats: dict, emb: Embodiment, source: str = "metadata.json") -> dict[str, NormStats]:
    """Each action key's q99 statistics, in the embodiment's order (relative-action keys take their own group)."""
    rel = set(emb.relative_action_keys)
    return {k.name: NormStats.from_metadata(stats, [k.name], "relative_action" if k.name in rel else "action", source)
            for k in emb.action}


def embodiment_stats(stats: dict, emb: Embodiment, source: str = "metadata.json") -> tuple[NormStats, NormStats]:
    """An embodiment's state and action q99 statistics, keys in its order: the one rule by which training
    normalises and the policy normalises states and un-normalises actions."""
    state = NormStats.from_metadata(stats, [k.name for k in emb.state], "state", source)
    parts = action_key_stats(stats, emb, source).values()
    return state, NormStats(q01=np.concatenate([p.q01 for p in parts]), q99=np.concatenate([p.q99 for p in parts]))


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


def to_relative(actions: np.ndarray | torch.Tensor, states: np.ndarray | torch.Tensor, horizon: int,
                pairs) -> np.ndarray | torch.Tensor:
    """actions [..., K·H, A], states [..., K, S] (raw, un-normalised; numpy or torch): chunk c minus the state at
    its anchor."""
    if isinstance(actions, torch.Tensor):
        out = actions.clone()
        for a, s in pairs:
            out[..., a] -= states[..., s].repeat_interleave(horizon, dim=-2)
        return out
    out = actions.copy()
    for a, s in pairs:
        out[..., a] -= np.repeat(states[..., s], horizon, axis=-2)
    return out


def from_relative(actions: np.ndarray, state: np.ndarray, pairs) -> np.ndarray:
    """Inverse at inference: one chunk [H, A] plus the observed state [S]."""
    out = actions.copy()
    for a, s in pairs:
        out[:, a] += state[s]
    return out


# --- images ----------------------------------------------------------------------------------


_GRAY = torch.tensor([0.299, 0.587, 0.114])
# RGB <-> YIQ: a hue shift is a rotation of the (I, Q) chroma plane.
_YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ_INV = torch.linalg.inv(_YIQ)


def jitter_map(rng: np.random.Generator, brightness=0.0, contrast=0.0, saturation=0.0,
               hue=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw of the jitter's factors, as torchvision's ColorJitter draws them -> (matrix [3, 3], coef [3]) with
    jitter(x) = clamp(matrix @ x + coef * mean_gray(x), 0, 1) per pixel, mean_gray the frame's mean luma.

    brightness b, contrast c (towards each frame's mean gray), saturation s (towards per-pixel gray) and hue h
    (a rotation by 2πh of the YIQ chroma plane, the standard linear approximation of an HSV hue shift) are all
    linear in RGB, so they compose into one 3x3 matrix plus a per-frame offset."""
    b = rng.uniform(1 - brightness, 1 + brightness) if brightness else 1.0
    c = rng.uniform(1 - contrast, 1 + contrast) if contrast else 1.0
    s = rng.uniform(1 - saturation, 1 + saturation) if saturation else 1.0
    h = rng.uniform(-hue, hue) if hue else 0.0
    eye = torch.eye(3)
    sat = s * eye + (1 - s) * torch.ones(3, 1) * _GRAY[None, :]
    cos, sin = float(np.cos(2 * np.pi * h)), float(np.sin(2 * np.pi * h))
    rot = torch.tensor([[1.0, 0.0, 0.0], [0.0, cos, -sin], [0.0, sin, cos]])
    hue_sat = _YIQ_INV @ rot @ _YIQ @ sat
    return hue_sat * (c * b), hue_sat.sum(dim=1) * ((1 - c) * b)


def color_jitter(x: torch.Tensor, rng: np.random.Generator, brightness=0.0, contrast=0.0, saturation=0.0,
                 hue=0.0) -> torch.Tensor:
    """x float [T, 3, H, W] in [0, 1]; one set of factors for all frames (`jitter_map`), applied as ONE affine colour
    map: one pass over the pixels instead of torchvision's four (about 15x faster on a CPU core)."""
    matrix, coef = (t.to(x.dtype) for t in jitter_map(rng, brightness, contrast, saturation, hue))
    mean_gray = x.mean(dim=(-2, -1)) @ _GRAY.to(x.dtype)                       # [T]
    offset = coef[None, :] * mean_gray[:, None]                                # [T, 3]
    # three fused multiply-adds per output channel (faster on CPU than einsum or a 1x1 conv)
    r, g, bl = x.unbind(1)
    out = torch.stack([r * matrix[i, 0] + g * matrix[i, 1] + bl * matrix[i, 2] + offset[:, i, None, None]
                       for i in range(3)], dim=1)
    return out.clamp(0, 1)


def color_jitter_uint8(x: torch.Tensor, rng: np.random.Generator, **jitter: float) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> uint8, the map of `color_jitter` (the same draws; within one level where the two round
    differently). With OpenCV one saturating 3x4 affine pass per frame (`cv2.transform`) on the uint8 pixels: at
    DROID's 176x320 views about 30x less CPU than converting to float, mapping and converting back, which was
    the loader's largest cost per sample. Without OpenCV, the float path."""
    try:
        import cv2
    except ImportError:
        planar = x.permute(0, 3, 1, 2).float().contiguous() / 255.0
        return (color_jitter(planar, rng, **jitter) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    matrix, coef = (t.double().numpy() for t in jitter_map(rng, **jitter))
    frames = x.contiguous().numpy()
    out = np.empty_like(frames)
    luma = _GRAY.double().numpy()
    for i, frame in enumerate(frames):
        mean_gray = float(np.asarray(cv2.mean(frame)[:3]) @ luma)  # in 0..255, as the pixels
        cv2.transform(frame, np.concatenate([matrix, (coef * mean_gray)[:, None]], axis=1), dst=out[i])
    return torch.from_numpy(out)


def transform_view(frames: np.ndarray | torch.Tensor, size: tuple[int, int], train: bool, rng: np.random.Generator,
                   crop_scale: float = 0.95, jitter: dict | None = None) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> uint8 [T, size_h, size_w, 3]: crop (random in train, centre in eval), resize,
    colour jitter (train only). All in uint8: torch's vectorised antialiased uint8 resize (~7x faster than float on
    CPU), then the jitter as one affine pass per frame (`color_jitter_uint8`)."""
    x = torch.as_tensor(frames)
    if x.dim() != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8:
        raise DataError(f"expected uint8 frames [T, H, W, 3], got {tuple(x.shape)} {x.dtype}")
    x = x.permute(0, 3, 1, 2)
    H, W = x.shape[-2:]
    ch, cw = max(1, round(H * crop_scale)), max(1, round(W * crop_scale))
    if train:
        top, left = int(rng.integers(0, H - ch + 1)), int(rng.integers(0, W - cw + 1))
    else:
        top, left = (H - ch) // 2, (W - cw) // 2
    x = x[..., top:top + ch, left:left + cw]
    if tuple(x.shape[-2:]) != tuple(size):
        # on the NHWC (channels-last) view: torch's fastest CPU path for uint8 antialiased resize
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    x = x.permute(0, 2, 3, 1).contiguous()  # channels-last already: no copy
    return color_jitter_uint8(x, rng, **jitter) if train and jitter else x


def compose_layout(emb: Embodiment, views: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-view uint8 [..., h, w, 3] (a window [T, ...] or a batch [B, T, ...]) -> [..., rows·h, cols·w, 3]
    following emb.layout, each cell written once into one frame. A view stretched over several widths is resized
    bilinearly: in uint8 on the CPU, on its channels-last view (no planar copy), in float on a GPU (which has no
    uint8 resize)."""
    h, w = emb.view_size
    first = views[emb.layout[0][0].view]
    lead = first.shape[:-3]
    cols = sum(cell.width for cell in emb.layout[0])
    out = torch.empty(*lead, len(emb.layout) * h, cols * w, 3, dtype=first.dtype, device=first.device)
    for r, row in enumerate(emb.layout):
        c0 = 0
        for cell in row:
            v = views[cell.view]
            if cell.width != 1:
                x = v.reshape(-1, h, w, 3).permute(0, 3, 1, 2)
                if x.device.type == "cpu":
                    x = F.interpolate(x, size=(h, w * cell.width), mode="bilinear", align_corners=False)
                else:
                    x = F.interpolate(x.float(), size=(h, w * cell.width), mode="bilinear", align_corners=False)
                    x = x.round_().clamp_(0, 255).to(torch.uint8)
                v = x.permute(0, 2, 3, 1).reshape(*lead, h, w * cell.width, 3)
            out[..., r * h:(r + 1) * h, c0 * w:(c0 + cell.width) * w, :] = v
            c0 += cell.width
    return out


# --- the pipeline --------------------------------------------------------------------------------


@dataclass
class EmbodimentIO:
    """One embodiment's input and output pipeline: the order of the steps between a robot's (or a recording's)
    frames, state and actions and the model's inputs and outputs, written once.

        inputs   views   -> crop, resize (random crop and colour jitter in training only) -> layout   `images`
                 state   -> normalise                                                               `state`
                 actions -> relative to the chunk's anchor state -> normalise (training targets)   `actions`
        outputs  actions -> un-normalise (`action_stats`, in the policy's sessions) -> absolute    `absolute`

    The vector steps take numpy arrays or, with the statistics on a device (`to`), tensors. Without statistics
    (a loader built before metadata exists) the vectors stay raw. They need no embodiment when `horizon` is given
    (one chunk's target, as the action-error evaluation computes it)."""

    emb: Embodiment | None
    pairs: list = field(default_factory=list)   # (action slice, state slice) of the relative keys
    state_stats: NormStats | None = None
    action_stats: NormStats | None = None
    horizon: int | None = None                  # actions per chunk: the windows' (default the embodiment's)

    def images(self, views: dict, train: bool, rng: np.random.Generator) -> torch.Tensor:
        """Per view name uint8 [T, H, W, 3] (numpy or tensor) -> the laid-out frames uint8 [T, rows·h, cols·w, 3]."""
        missing = [v for v in self.emb.views if v not in views]
        if missing:
            raise ValueError(f"embodiment {self.emb.tag!r} needs views {missing} (got {sorted(views)})")
        out = {name: transform_view(views[name], tuple(self.emb.view_size), train, rng, self.emb.crop_scale,
                                    self.emb.color_jitter)
               for name in self.emb.views}
        return compose_layout(self.emb, out)

    def state(self, state):
        """Raw state [..., S] -> what the model reads."""
        return state if self.state_stats is None else self.state_stats.normalize(state)

    def actions(self, actions, states):
        """Raw actions [..., K·H, A] and the raw states of their chunks' anchors [..., K, S] -> training targets."""
        if self.pairs:
            actions = to_relative(actions, states, self.horizon or self.emb.action_horizon, self.pairs)
        return actions if self.action_stats is None else self.action_stats.normalize(actions)

    def absolute(self, actions: np.ndarray, state: np.ndarray) -> np.ndarray:
        """The last output step: the model's chunk [H, A], un-normalised (the policy's sessions do that with
        `action_stats`), and the observed raw state [S] -> absolute actions (relative keys plus the state)."""
        return from_relative(actions, state, self.pairs) if self.pairs else actions

    def to(self, device: torch.device | str) -> "EmbodimentIO":
        """The pipeline with its statistics as tensors on `device` (the vector steps then take tensors)."""
        def move(ns):
            return None if ns is None else ns.to(device)
        return EmbodimentIO(self.emb, self.pairs, move(self.state_stats), move(self.action_stats), self.horizon)
