"""From a LeRobot dataset and an embodiment to training samples, and a loader over several datasets.

`WindowDataset.sample(anchor, position)` returns one sample:
    images  uint8 [1 + f·K, H, W, 3]   the views, transformed and laid out
    state   float32 [K, S]             q99-normalised, one row per chunk anchor
    action  float32 [K·H, A]           q99-normalised (relative keys made relative first)
    prompt  str                        the embodiment's template around the frame's task
Sample randomness (crop, jitter) is seeded by (seed, global position): see transforms.py, whose `EmbodimentIO`
orders the steps (the policy composes the same pipeline for a served request).

`frame_cache_mib` > 0 keeps whole decoded episodes (per camera) in each loader process, least recently used first
out: a window then costs an index instead of a seek and a decode. Small datasets (LIBERO-scale, 128 px) fit whole;
the frames are the ones a per-window decode returns (tests/data/test_end_to_end.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .embodiments import Embodiment
from .errors import DataError
from .sampling import AnchorIndex, SampleStream, WindowSpec, heldout_split, task_segments  # noqa: F401 (re-exported)
from .transforms import EmbodimentIO, embodiment_stats, relative_action_dims


def load_statistics(metadata_path: str | Path, tag: str) -> dict:
    """The `statistics` block of one embodiment tag in a metadata.json (reference §4.2)."""
    path = Path(metadata_path)
    if not path.is_file():
        raise DataError(f"metadata file not found: {path} (run `dz data metadata` first)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON: {exc}") from exc
    if tag not in meta:
        raise DataError(f"{path}: no entry for embodiment {tag!r} (has: {', '.join(meta) or 'none'})")
    if "statistics" not in meta[tag]:
        raise DataError(f"{path}: entry {tag!r} has no 'statistics'")
    return meta[tag]["statistics"]


def embodiment_metadata(dataset: str | Path, emb: Embodiment, out: str | Path | None, merge: bool = False,
                        max_episodes: int | None = None, heldout_episodes: int = 0,
                        skipped_episodes: Sequence[int] = (), reader: Any = None) -> dict:
    """metadata.json for one dataset seen through one embodiment (its keys, slices and relative keys), its
    statistics over the training episodes: all but the last `heldout_episodes` (`heldout_split`) and the
    `skipped_episodes` (those `missing_videos` names, which training with skip_missing leaves out too). The
    dataset's reader (`reader`, or one opened here) checks its files' places and episode lengths first."""
    from .lerobot_format import open_dataset
    from .metadata import compute_metadata

    reader = reader if reader is not None else open_dataset(dataset)
    reader.check_lengths()

    def keys(group):
        return {k.name: (k.column, None if k.start is None else slice(k.start, k.end)) for k in group}

    declared = {(group, k.name): k.dim for group, ks in (("state", emb.state), ("action", emb.action))
                for k in ks if k.dim is not None}
    return compute_metadata(dataset, emb.tag, keys(emb.state), keys(emb.action), out,
                            relative_action_keys=emb.relative_action_keys, action_horizon=emb.action_horizon,
                            video_keys=emb.views, merge=merge, max_episodes=max_episodes, declared_dims=declared,
                            heldout_episodes=heldout_episodes, skipped_episodes=skipped_episodes,
                            allow_outside=getattr(reader, "allow_outside", False))


def missing_videos(reader: Any, emb: Embodiment) -> list[tuple[int, Path]]:
    """(episode, path) of every mp4 of the embodiment's views that the dataset lacks (image views have none)."""
    return reader.missing_video_files(emb.views.values())


def key_vectors(cols: dict, keys, rows) -> np.ndarray:
    """The embodiment keys' values [len(rows), width] from a dataset's columns (`read_columns`), as float64."""
    parts = []
    for k in keys:
        col = np.asarray(cols[k.column], dtype=np.float64)
        col = col.reshape(col.shape[0], -1)
        parts.append(k.take(col[rows], col.shape[1]))
    return np.concatenate(parts, axis=1)


@dataclass
class KeyLayout:
    state_widths: dict[str, int]
    action_widths: dict[str, int]

    @property
    def state_dim(self) -> int:
        return sum(self.state_widths.values())

    @property
    def action_dim(self) -> int:
        return sum(self.action_widths.values())


class DecodedEpisodes:
    """Whole decoded episode videos, keyed by (episode, camera), within a byte budget (least recently used out).
    An episode larger than the whole budget is not kept."""

    def __init__(self, budget_bytes: int):
        self.budget, self.used = int(budget_bytes), 0
        self._items: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()
        self.decodes = 0  # whole-episode decodes so far (a guard for tests)

    def frames(self, reader: Any, episode: int, key: str, rows: np.ndarray, backend: str) -> np.ndarray:
        whole = self._items.get((episode, key))
        if whole is None:
            whole = reader.read_frames(episode, key, range(reader.episode(episode).length), backend=backend)
            self.decodes += 1
            if whole.nbytes <= self.budget:
                while self.used + whole.nbytes > self.budget:
                    self.used -= self._items.popitem(last=False)[1].nbytes
                self._items[(episode, key)] = whole
                self.used += whole.nbytes
        else:
            self._items.move_to_end((episode, key))
        return whole[rows]


class WindowDataset:
    """One LeRobot dataset seen through one embodiment (`episodes`: only those episode indices; None = all)."""

    def __init__(self, reader: Any, embodiment: Embodiment, spec: WindowSpec, statistics: dict | None,
                 train: bool = True, seed: int = 0, video_backend: str = "auto", skip_missing: bool = False,
                 episodes: Sequence[int] | None = None, frame_cache_mib: int = 0):
        if frame_cache_mib < 0:
            raise ValueError(f"frame_cache_mib must be >= 0, got {frame_cache_mib}")
        self.frame_cache = DecodedEpisodes(frame_cache_mib * 2**20) if frame_cache_mib else None
        self.reader, self.emb, self.spec = reader, embodiment, spec
        self.episodes = None if episodes is None else set(int(e) for e in episodes)
        self.train, self.seed, self.video_backend = train, seed, video_backend
        # False: `sample` names each view's frames (`frame_refs`) instead of decoding them, for a decoder on the
        # training device (`nvdec.VideoImages`)
        self.decode_on_host = True
        self.keys = self._check_keys()
        self.pairs = relative_action_dims(embodiment, self.keys.state_widths, self.keys.action_widths)
        self.missing = self._missing_files()
        if self.missing and not skip_missing:
            shown = "\n  ".join(f"episode {ep}: {path}" for ep, path in self.missing[:10])
            more = f"\n  ... and {len(self.missing) - 10} more" if len(self.missing) > 10 else ""
            raise DataError(f"{reader.root}: {len(self.missing)} video files of the views in use are missing:\n  "
                            f"{shown}{more}\n(skip those episodes with skip_missing=True / --skip-missing)")
        if getattr(reader, "remote", None) is None:  # a remote dataset's files are checked as they arrive
            reader.check_lengths()  # before the declared lengths size anything
        skipped_eps = {ep for ep, _ in self.missing}
        segments = []
        for ep in reader.episodes:
            if ep.index in skipped_eps or (self.episodes is not None and ep.index not in self.episodes):
                continue
            per_frame = reader.task_per_frame(ep.index) if len(set(ep.tasks)) > 1 else None
            segments += task_segments(ep.index, per_frame, ep.length)
        if segments:  # the columns in use hold the widths info.json declares (each episode read checks its own)
            reader.read_columns(segments[0].episode, sorted({k.column for k in embodiment.state + embodiment.action}))
        self.index = AnchorIndex(segments, spec)
        self.state_stats = self.action_stats = None
        if statistics is not None:
            self.state_stats, self.action_stats = embodiment_stats(statistics, embodiment)
        # the input pipeline a served request goes through too (`transforms.EmbodimentIO`)
        self.io = EmbodimentIO(embodiment, self.pairs, self.state_stats, self.action_stats, spec.action_horizon)

    def _missing_files(self) -> list[tuple[int, Path]]:
        """(episode, path) of every mp4 of the views in use that the dataset lacks (image views have none)."""
        return missing_videos(self.reader, self.emb)

    def _check_keys(self) -> KeyLayout:
        feats = self.reader.features
        where = f"{self.reader.root} with embodiment {self.emb.tag!r} ({self.emb.source})"
        for short, key in self.emb.views.items():
            if key not in feats:
                raise DataError(f"{where}: view {short!r} -> {key!r} is not a video/image feature of the dataset "
                                f"(has: {', '.join(sorted(self.reader.video_keys))})")
        layout = KeyLayout({}, {})
        for group, widths in ((self.emb.state, layout.state_widths), (self.emb.action, layout.action_widths)):
            for k in group:
                if k.column not in feats:
                    raise DataError(f"{where}: column {k.column!r} (key {k.name!r}) is not in the dataset")
                shape = tuple(feats[k.column].shape) or (1,)
                col_w = int(np.prod(shape))
                if k.end is not None and k.end > col_w:
                    raise DataError(f"{where}: key {k.name!r} slices [{k.start}:{k.end}] of {k.column!r}, "
                                    f"which has only {col_w} dims")
                w = k.width(col_w)
                if k.dim is not None and w != k.dim:
                    raise DataError(f"{where}: key {k.name!r} expects {k.dim} dims, column {k.column!r} gives {w}")
                widths[k.name] = w
        return layout

    def __len__(self) -> int:
        return len(self.index)

    def _vectors(self, cols: dict[str, np.ndarray], keys, rows: np.ndarray, episode: int) -> np.ndarray:
        parts = []
        for k in keys:
            col = np.asarray(cols[k.column], dtype=np.float64)
            col = col.reshape(col.shape[0], -1)
            part = k.take(col[rows], col.shape[1])
            if not np.isfinite(part).all():
                raise DataError(f"{self.reader.root}: non-finite values in {k.column!r} (key {k.name!r}) "
                                f"of episode {episode}")
            parts.append(part)
        return np.concatenate(parts, axis=1)

    def sample(self, anchor: int, position: int = 0) -> dict:
        w = self.index.window(anchor)
        columns = sorted({k.column for k in self.emb.state + self.emb.action})
        cols = self.reader.read_columns(w.episode, columns)
        state = self._vectors(cols, self.emb.state, w.state_rows, w.episode)
        action = self._vectors(cols, self.emb.action, w.action_rows, w.episode)
        action = self.io.actions(action, state)  # relative to the raw anchor states, then normalised
        state = self.io.state(state)
        task = self.reader.task_per_frame(w.episode)[int(w.start)]
        out = {
            "state": torch.from_numpy(state.astype(np.float32)),
            "action": torch.from_numpy(action.astype(np.float32)),
            "prompt": self.emb.prompt(task),
            "embodiment_id": self.emb.tag_id,
            "has_real_action": True,
        }
        if not self.decode_on_host:
            out["frame_refs"] = {short: self.reader.video_frames(w.episode, key, w.frames.tolist())
                                 for short, key in self.emb.views.items()}
            return out
        rng = np.random.default_rng([self.seed, position])
        views = {}
        for short, key in self.emb.views.items():
            if self.frame_cache is not None and self.reader.features[key].dtype == "video":
                frames = self.frame_cache.frames(self.reader, w.episode, key, np.asarray(w.frames), self.video_backend)
            else:
                frames = self.reader.read_frames(w.episode, key, w.frames.tolist(), backend=self.video_backend)
            views[short] = frames
        return {"images": self.io.images(views, self.train, rng), **out}


class MixtureDataset(torch.utils.data.Dataset):
    """Index with (dataset id, anchor, global position) tuples from a `StreamSampler`."""

    def __init__(self, datasets: Sequence[WindowDataset], same_frame_size: bool = True):
        """same_frame_size: refuse datasets whose frames differ (a collated batch stacks them); packing
        (`train.packing`) runs samples of any size."""
        if not datasets:
            raise DataError("a mixture needs at least one dataset")
        sizes = {tuple(d.emb.image_size) for d in datasets}
        if same_frame_size and len(sizes) > 1:
            raise DataError(f"datasets in one mixture must lay out to the same frame size, got {sorted(sizes)}: "
                            "set train.packing: true to train them together")
        self.datasets = list(datasets)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, item: tuple[int, int, int]) -> dict:
        ds, anchor, position = item
        sample = self.datasets[ds].sample(anchor, position)
        sample["position"] = position  # seeds this sample's diffusion noise (batch-size independent)
        if "frame_refs" in sample:
            sample["dataset"] = ds  # the decoder on the device augments each dataset's views
        return sample


class StreamSampler(torch.utils.data.Sampler):
    """Feeds a DataLoader from a SampleStream, starting at the stream's saved position."""

    def __init__(self, stream: SampleStream, num_samples: int | None = None):
        self.stream = stream
        self.num_samples = num_samples

    def __iter__(self):
        start = self.stream.position
        n = 0
        while self.num_samples is None or n < self.num_samples:
            yield self.stream.peek(start + n)
            n += 1

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError("an endless StreamSampler has no length")
        return self.num_samples
