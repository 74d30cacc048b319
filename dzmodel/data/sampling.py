"""Training windows: which frames, actions and states one sample takes, and in what order samples come.

A window is K action chunks of H steps starting at frame s:
  actions  rows s .. s + K·H − 1
  states   rows s + c·H (one per chunk, at the chunk's anchor)
  video    frame s, then for each chunk c the frames s + c·H + ⌊j·H / f⌋ for j = 1..f  (f = 4·frames per block)
so the video has 1 + f·K frames, ending at s + K·H, and the VAE's latent block c (video frames 1+f·c ..
f·(c+1)) covers exactly the span of action chunk c. Upstream's fixed offsets 0,3,…,21 only line up for
H = 24; with LIBERO's H = 16 they interleave frames across chunks (reference §4.3). Ours stay aligned for any H.

Anchors (step-level sampling): every frame of every long-enough segment (an episode, split where the
task string changes) is an anchor.
  multi_anchor  the window is placed around the anchor: it starts ⌊K/2⌋ chunks before it when the
                segment allows, and is shifted to fit inside the segment.
  fixed_window  the window starts at the anchor; anchors too close to the segment end are skipped.

`SampleStream` turns anchors of one or several datasets into an infinite, seeded, per-rank stream.
Its position is a plain integer, so resuming at a saved position repeats the exact same samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import DataError


@dataclass(frozen=True)
class WindowSpec:
    num_chunks: int           # K = the model's max_chunk_size
    action_horizon: int       # H
    frames_per_chunk: int = 8  # 4 video frames per latent frame x num_frame_per_block
    mode: str = "multi_anchor"

    def __post_init__(self) -> None:
        if self.mode not in ("multi_anchor", "fixed_window"):
            raise DataError(f"sampling mode must be multi_anchor or fixed_window, got {self.mode!r}")
        if min(self.num_chunks, self.action_horizon, self.frames_per_chunk) < 1:
            raise DataError(f"bad window spec {self}")

    @property
    def span(self) -> int:
        """Frames from the first to the last video frame: K·H (the window needs span + 1 frames)."""
        return self.num_chunks * self.action_horizon

    def video_offsets(self) -> np.ndarray:
        H, f = self.action_horizon, self.frames_per_chunk
        within = [(j * H) // f for j in range(1, f + 1)]
        return np.array([0] + [c * H + o for c in range(self.num_chunks) for o in within], dtype=np.int64)


@dataclass(frozen=True)
class Window:
    episode: int
    start: int
    frames: np.ndarray        # [1 + f·K] frame indices within the episode
    action_rows: np.ndarray   # [K·H]
    state_rows: np.ndarray    # [K]


@dataclass(frozen=True)
class Segment:
    episode: int
    start: int   # first frame
    end: int     # one past the last frame


def task_segments(episode: int, tasks_per_frame: Sequence[str] | None, length: int) -> list[Segment]:
    """Split an episode where its language annotation changes (windows never cross a task change)."""
    if not tasks_per_frame:
        return [Segment(episode, 0, length)]
    out, start = [], 0
    for i in range(1, length + 1):
        if i == length or tasks_per_frame[i] != tasks_per_frame[start]:
            out.append(Segment(episode, start, i))
            start = i
    return out


class AnchorIndex:
    """Every valid (episode, frame) anchor of one dataset, and the window each one maps to."""

    def __init__(self, segments: Sequence[Segment], spec: WindowSpec):
        self.spec = spec
        need = spec.span + 1
        self.segments = [s for s in segments if s.end - s.start >= need]
        self.skipped = [s for s in segments if s.end - s.start < need]
        counts = []
        for s in self.segments:
            n = s.end - s.start if spec.mode == "multi_anchor" else s.end - s.start - spec.span
            counts.append(n)
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if not self.segments:
            longest = max((s.end - s.start for s in segments), default=0)
            fits = (longest - 1) // spec.action_horizon
            hint = (f"at most {fits} chunk{'s' if fits != 1 else ''} of {spec.action_horizon} fit: use a model whose "
                    f"max_chunk_size is {fits} or less (`dz data check --chunks {fits}`)" if fits else
                    f"not even one chunk of {spec.action_horizon} fits: lower the embodiment's action_horizon")
            raise DataError(f"no segment is long enough for a window of {need} frames "
                            f"({spec.num_chunks} chunks x {spec.action_horizon} steps + 1): the longest has "
                            f"{longest} frames, so {hint}")

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def anchor(self, i: int) -> tuple[Segment, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"anchor {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self._offsets, i, side="right") - 1)
        seg = self.segments[k]
        return seg, seg.start + int(i - self._offsets[k])

    def window(self, i: int) -> Window:
        seg, a = self.anchor(i)
        spec = self.spec
        H = spec.action_horizon
        if spec.mode == "fixed_window":
            start = a
        else:
            back = min(spec.num_chunks // 2, (a - seg.start) // H)
            start = a - back * H
            start = min(start, seg.end - 1 - spec.span)  # shift to fit inside the segment
        frames = start + spec.video_offsets()
        return Window(episode=seg.episode, start=start, frames=frames,
                      action_rows=start + np.arange(spec.span, dtype=np.int64),
                      state_rows=start + H * np.arange(spec.num_chunks, dtype=np.int64))


class SampleStream:
    """An infinite, seeded stream of (dataset id, anchor index) for one rank.

    Global position p -> epoch p // N and slot p % N, N = total anchors. One dataset: a fresh
    permutation per epoch (every anchor once per epoch). Several datasets: slot-seeded draws, a
    dataset by weight then a uniform anchor (upstream's mixture rule). Rank r of W takes global
    positions r, r + W, r + 2W, ...; `position` counts this rank's samples, so a checkpoint that stores
    it resumes bit-exactly.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float] | None = None, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True):
        if not sizes or min(sizes) < 1:
            raise DataError(f"every dataset needs at least one anchor, got sizes {list(sizes)}")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        self.sizes = [int(s) for s in sizes]
        w = np.ones(len(sizes)) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != (len(sizes),) or (w < 0).any() or w.sum() <= 0:
            raise DataError(f"mixture weights must be {len(sizes)} non-negative numbers, not all zero; got {weights}")
        self.probs = w / w.sum()
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.total = sum(self.sizes)
        self.position = 0
        self._perm_epoch, self._perm = -1, None

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "world_size"):
            if state.get(key) != getattr(self, key):
                raise DataError(f"cannot resume the sample stream: saved {key} {state.get(key)} != {getattr(self, key)}")
        self.position = int(state["position"])

    def _at(self, global_pos: int) -> tuple[int, int]:
        epoch, slot = divmod(global_pos, self.total)
        if len(self.sizes) == 1:
            if not self.shuffle:
                return 0, slot
            if self._perm_epoch != epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.total)
                self._perm_epoch = epoch
            return 0, int(self._perm[slot])
        rng = np.random.default_rng([self.seed, epoch, slot])
        ds = int(rng.choice(len(self.sizes), p=self.probs))
        return ds, int(rng.integers(self.sizes[ds]))

    def peek(self, local_position: int) -> tuple[int, int, int]:
        """(dataset id, anchor, global position) of this rank's sample number `local_position`."""
        g = self.rank + self.world_size * local_position
        ds, i = self._at(g)
        return ds, i, g

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, int, int]:
        item = self.peek(self.position)
        self.position += 1
        return item


def heldout_split(episodes: Sequence[int], heldout: int, where: str = "train.heldout_episodes") -> tuple[list[int], list[int]]:
    """(training, held-out) episode indices: the last `heldout` episodes by index are held out. Deterministic,
    so training and the held-out evaluation, given the same count, split the same way."""
    order = sorted(int(e) for e in episodes)
    if heldout < 0 or heldout >= len(order):
        raise DataError(f"{where}: {heldout} held-out episodes must leave at least one of the dataset's "
                        f"{len(order)} episodes to train on")
    cut = len(order) - heldout
    return order[:cut], order[cut:]
