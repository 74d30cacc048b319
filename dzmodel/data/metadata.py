"""Normalisation statistics and modality metadata (``metadata.json``) for one embodiment.

Output format (one entry per embodiment tag; other tags in the file are kept with ``merge=True``)::

    {
      "<embodiment_tag>": {
        "statistics": {
          "state":  {"<key>": S, ...},
          "action": {"<key>": S, ...},
          "relative_action": {"<key>": S, ...}      # only when relative_action_keys are given
        },
        "modalities": {
          "video":  {"<short>": {"resolution": [H, W], "channels": 3, "fps": 15.0}, ...},
          "state":  {"<key>": {"absolute": true, "rotation_type": null, "shape": [n], "continuous": true}},
          "action": {"<key>": {...same...}}
        },
        "embodiment_tag": "<embodiment_tag>"
      }
    }

with ``S = {"min", "max", "mean", "std", "q01", "q99"}``, each a list with one float per dimension.

Keys. A key names a dataset column and optionally a ``[start:end]`` slice of it (GR00T
``modality.json`` style), so one column can be split into sub-keys, e.g. for DROID::

    state_keys = {"joint_position": "observation.state[7:14]",
                  "gripper_position": ("observation.state", slice(14, 15))}

A spec is a :class:`KeySpec`, a string ``"column"`` or ``"column[start:end]"``, or a tuple
``(column, slice | None)``.

Statistics (all float64 internally, streamed over the data parquet files with bounded memory):

* ``min``, ``max``, ``mean``, ``std`` (population std, ddof=0) are exact: per-batch moments merged
  with Chan et al.'s parallel update of Welford's algorithm.
* ``q01``, ``q99`` are **exact** (``numpy.quantile``, linear interpolation) when a key has at most
  ``exact_threshold`` rows (default 1,000,000 values per dimension). Above that they come from a
  second pass that fills a ``quantile_bins``-bin histogram per dimension spanning that
  dimension's ``[min, max]``; the estimate then differs from ``numpy.quantile`` by at most one
  bin width, ``(max - min) / quantile_bins`` per dimension (10,000 bins by default:
  0.01 % of the range), up to float rounding.

Relative actions. For every key in ``relative_action_keys`` (it must be both a state key and an
action key, with the same width), every anchor frame ``a`` of every episode and every offset
``k = 0 .. action_horizon - 1`` with ``a + k < episode length``, the sample
``action[a + k] - state[a]`` enters ``statistics.relative_action[key]`` (computed one episode at a
time, so memory is bounded by the longest episode x horizon).

Held-out episodes. ``heldout_episodes=N`` leaves out the last N episodes by index (the split training and the
held-out evaluation use, ``dzmodel.data.dataset.heldout_split``): the statistics come from the training episodes
only, and the entry says which (``statistics_episodes``: how many were used; ``heldout_episodes``: the indices).
``skipped_episodes`` leaves out more (those whose videos are missing, which training with ``skip_missing`` skips),
recorded under that name when there are any.

Every number must be finite: a NaN or infinity in a state or action column is a DataError naming the file, episode,
column and frame, and so are statistics that overflow float64; metadata.json is strict JSON (no NaN, no Infinity).

Nothing is ever written inside the dataset directory: an ``out_path`` there is a DataError.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dzmodel.atomic import atomic_write_text
from dzmodel.data.errors import DataError
from dzmodel.data.metadata_scan import (EpisodeGrouper, RunningStats, data_files, episode_indices, feature_shape,
                                        iter_batches, load_info, relative_samples)

DEFAULT_QUANTILE_BINS = 10_000
DEFAULT_EXACT_THRESHOLD = 1_000_000
DEFAULT_BATCH_ROWS = 65_536


@dataclass(frozen=True)
class KeySpec:
    """A dataset column and an optional ``[start:end]`` slice of its last dimension."""

    column: str
    start: int | None = None
    end: int | None = None

    @classmethod
    def parse(cls, spec: KeySpec | str | tuple, name: str = "?") -> KeySpec:
        if isinstance(spec, KeySpec):
            return spec
        if isinstance(spec, str):
            m = re.fullmatch(r"\s*(.+?)\s*(?:\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\])?\s*", spec)
            if not m:
                raise DataError(f"key {name!r}: cannot parse spec {spec!r} (want 'column' or 'column[start:end]')")
            col, a, b = m.groups()
            return cls(col, int(a) if a else None, int(b) if b else None)
        if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str):
            col, sl = spec
            if sl is None:
                return cls(col)
            if isinstance(sl, slice) and sl.step in (None, 1):
                return cls(col, sl.start, sl.stop)
            if isinstance(sl, (tuple, list)) and len(sl) == 2:
                return cls(col, sl[0], sl[1])
        raise DataError(f"key {name!r}: bad spec {spec!r} (want 'column', 'column[start:end]' or (column, slice))")

    def resolve(self, width: int, name: str) -> slice:
        """The concrete slice into a column of ``width`` values; DataError naming ``name`` if it does not fit."""
        start = 0 if self.start is None else self.start
        end = width if self.end is None else self.end
        if start < 0:
            start += width
        if end < 0:
            end += width
        if not (0 <= start < end <= width):
            raise DataError(
                f"key {name!r}: slice [{self.start}:{self.end}] does not fit column {self.column!r} "
                f"of width {width}"
            )
        return slice(start, end)





# ---------------------------------------------------------------------------------------------
# main entry point


def _video_modalities(info: dict, video_keys: Mapping[str, str] | None) -> dict:
    feats, where = info["features"], info["_path"]
    if video_keys is None:
        cols = [k for k, f in feats.items() if f.get("dtype") == "video"]
        video_keys = {c.split(".")[-1]: c for c in cols}
    out = {}
    for short, col in video_keys.items():
        ft = feats.get(col)
        if ft is None or ft.get("dtype") not in ("video", "image"):
            raise DataError(f"{where}: video key {short!r} -> feature {col!r} is not a video/image feature")
        shape = feature_shape(info, col) or []
        names = ft.get("names") or ["height", "width", "channels"]
        if len(shape) != 3:
            raise DataError(f"{where}: features.{col}.shape: {shape} is not [H, W, C]")
        dims = dict(zip(names, shape)) if isinstance(names, list) and all(isinstance(n, str) for n in names) else {}
        h, w, c = (dims.get(n, shape[i]) for i, n in enumerate(("height", "width", "channels")))
        vinfo = ft.get("info") if isinstance(ft.get("info"), dict) else {}
        fps = vinfo.get("video.fps", info.get("fps"))
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 1000:
            raise DataError(f"{where}: features.{col}: its fps (info.video.fps, else fps) must be a number in (0, 1000], "
                            f"got {fps!r}")
        out[short] = {"resolution": [int(h), int(w)], "channels": int(c), "fps": float(fps)}
    return out


def _nonfinite_field(value, path: str) -> str | None:
    """The dotted path of the first NaN or infinity inside decoded JSON (None: there is none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} is {value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _nonfinite_field(item, f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}".lstrip("."))
        if found:
            return found
    return None


def _check_declared_width(info: dict, spec: KeySpec, name: str, sl: slice) -> None:
    shape = feature_shape(info, spec.column)
    if shape:
        declared = int(np.prod(shape))
        if sl.stop > declared:
            raise DataError(
                f"key {name!r}: slice [{sl.start}:{sl.stop}] exceeds column {spec.column!r} shape {shape} in meta/info.json"
            )


def compute_metadata(
    dataset_root: str | os.PathLike,
    embodiment_tag: str,
    state_keys: Mapping[str, KeySpec | str | tuple],
    action_keys: Mapping[str, KeySpec | str | tuple],
    out_path: str | os.PathLike | None = None,
    *,
    relative_action_keys: Sequence[str] = (),
    action_horizon: int = 1,
    video_keys: Mapping[str, str] | None = None,
    merge: bool = False,
    max_episodes: int | None = None,
    heldout_episodes: int = 0,
    skipped_episodes: Sequence[int] = (),
    progress: bool = True,
    quantile_bins: int = DEFAULT_QUANTILE_BINS,
    exact_threshold: int = DEFAULT_EXACT_THRESHOLD,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    declared_dims: Mapping[tuple[str, str], int] | None = None,
    allow_outside: bool = False,
) -> dict:
    """Compute the ``metadata.json`` entry of ``embodiment_tag`` for a LeRobot v3.0 dataset.

    Args:
        dataset_root: the dataset directory (``meta/info.json``, ``data/**/*.parquet``). Read only.
        embodiment_tag: the top-level key of the entry.
        state_keys / action_keys: ``{key: spec}``; a spec is ``"column"``, ``"column[start:end]"``,
            ``(column, slice | None)`` or a :class:`KeySpec`.
        out_path: where to write metadata.json (atomically); None = compute only. Must not be inside
            ``dataset_root``.
        relative_action_keys: keys present in both ``state_keys`` and ``action_keys`` (same width)
            whose relative actions ``action[a + k] - state[a]`` (k < ``action_horizon``) get stats.
        action_horizon: H for the relative-action stats.
        video_keys: ``{short: feature}`` for the video modalities; default: every video feature,
            short name = the part after the last dot.
        merge: keep the other embodiment tags of an existing ``out_path`` (same tag replaced).
        max_episodes: use only the first N episodes met in the data files (quick looks).
        heldout_episodes: leave out the last N episodes by index, as training does (``train.heldout_episodes``,
            ``heldout_split``), so the held-out evaluation's episodes do not shape the normalisation.
        skipped_episodes: leave out these episodes too (those whose videos are missing, which training with
            ``skip_missing`` skips); the entry records them as ``skipped_episodes``.
        quantile_bins: histogram bins per dimension for q01/q99 above ``exact_threshold`` rows;
            the error is at most (max - min) / quantile_bins per dimension.
        exact_threshold: at most this many rows (values per dimension) per key -> exact quantiles.
        batch_rows: rows per parquet batch read (memory bound of one pass).
        declared_dims: {(group, key): dim} the embodiment declares; a key whose data has another width is a
            DataError, and nothing is written.
        allow_outside: read data files that symlinks place outside ``dataset_root`` (by default a DataError).

    The entry records the episodes its statistics come from: ``statistics_episodes`` (how many) and
    ``heldout_episodes`` (the indices left out).

    Returns the whole document written (``{tag: entry}``, plus other tags when merging).
    Raises DataError for a missing/bad column, a NaN or null (naming file, column and row), a slice
    that does not fit its column (naming the key), or an out_path inside the dataset.
    """
    root = Path(dataset_root).resolve()
    out = _check_metadata_arguments(root, out_path, embodiment_tag, action_horizon, quantile_bins, max_episodes,
                                    heldout_episodes, state_keys, action_keys)
    specs = {
        "state": {k: KeySpec.parse(v, k) for k, v in state_keys.items()},
        "action": {k: KeySpec.parse(v, k) for k, v in action_keys.items()},
    }
    for k in relative_action_keys:
        if k not in specs["state"] or k not in specs["action"]:
            raise DataError(f"relative action key {k!r}: must be both a state key and an action key")

    acc = _Statistics(root, specs, relative_action_keys, action_horizon, heldout_episodes, max_episodes, batch_rows,
                      exact_threshold, quantile_bins, progress, skipped_episodes, allow_outside)
    if acc.run_pass(hist=False) == 0:
        raise DataError(f"{root}: no data rows")
    for (group, key), want in (declared_dims or {}).items():
        got = acc.stats[group][key].dim if key in acc.stats.get(group, {}) else None
        if got is not None and got != want:
            raise DataError(f"{group} key {key!r}: the data has {got} dims (column {specs[group][key].column!r}), "
                            f"the embodiment declares dim {want}; fix the YAML's dim or slice")
    if acc.needs_pass2():
        acc.run_pass(hist=True)

    def modality(group: str) -> dict:
        return {
            k: {"absolute": True, "rotation_type": None, "shape": [acc.stats[group][k].dim], "continuous": True}
            for k in specs[group]
        }

    entry = {
        "statistics": acc.results(),
        "modalities": {
            "video": _video_modalities(acc.info, video_keys),
            "state": modality("state"),
            "action": modality("action"),
        },
        "embodiment_tag": embodiment_tag,
        "statistics_episodes": len(acc.used_episodes),
        "heldout_episodes": acc.heldout,
        **({"skipped_episodes": acc.skipped} if acc.skipped else {}),
    }
    doc = {embodiment_tag: entry}
    if out is not None:
        doc = _merged(out, embodiment_tag, entry) if merge and out.exists() else doc
        atomic_write_text(out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return doc


def _check_metadata_arguments(root: Path, out_path, embodiment_tag, action_horizon: int, quantile_bins: int,
                              max_episodes, heldout_episodes: int, state_keys, action_keys) -> Path | None:
    """compute_metadata's argument checks; returns the resolved out_path (None: compute only)."""
    if not root.is_dir():
        raise DataError(f"{root}: dataset directory not found")
    out = None
    if out_path is not None:
        out = Path(out_path).resolve()
        if out == root or out.is_relative_to(root):
            raise DataError(
                f"out_path {out}: is inside the dataset directory {root}; metadata is never written into a dataset"
            )
    if not embodiment_tag or not isinstance(embodiment_tag, str):
        raise DataError(f"embodiment_tag: must be a non-empty string, got {embodiment_tag!r}")
    if action_horizon < 1:
        raise DataError(f"action_horizon: must be >= 1, got {action_horizon}")
    if quantile_bins < 1:
        raise DataError(f"quantile_bins: must be >= 1, got {quantile_bins}")
    if max_episodes is not None and max_episodes < 1:
        raise DataError(f"max_episodes: must be >= 1, got {max_episodes}")
    if heldout_episodes < 0:
        raise DataError(f"heldout_episodes: must be >= 0, got {heldout_episodes}")
    if not state_keys and not action_keys:
        raise DataError("state_keys / action_keys: none configured")
    return out


def _merged(out: Path, embodiment_tag: str, entry: dict) -> dict:
    """The metadata document at `out` with `embodiment_tag`'s entry replaced (merge=True)."""
    try:
        existing = json.loads(out.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{out}: existing metadata is not valid JSON ({e}); cannot merge") from e
    if not isinstance(existing, dict):
        raise DataError(f"{out}: existing metadata is not a JSON object; cannot merge")
    bad = _nonfinite_field(existing, "")
    if bad:
        raise DataError(f"{out}: {bad}; metadata must hold finite numbers (fix or remove it), cannot merge")
    existing[embodiment_tag] = entry
    return existing


class _Statistics:
    """The running statistics of every state and action key (and relative action) over a dataset's data files:
    a first pass of exact statistics, and a second one of histograms where a key has too many rows for exact
    quantiles (`RunningStats`)."""

    def __init__(self, root: Path, specs: dict, relative_action_keys, action_horizon: int, heldout_episodes: int,
                 max_episodes, batch_rows: int, exact_threshold: int, quantile_bins: int, progress: bool,
                 skipped: Sequence[int] = (), allow_outside: bool = False):
        self.root, self.specs = root, specs
        self.relative_action_keys, self.action_horizon = tuple(relative_action_keys), action_horizon
        self.max_episodes, self.batch_rows, self.progress = max_episodes, batch_rows, progress
        self.info = load_info(root, allow_outside)
        self.files = data_files(root, allow_outside)
        self.columns = sorted({s.column for group in specs.values() for s in group.values()})
        self.heldout: list[int] = []
        if heldout_episodes:
            from .sampling import heldout_split

            _, self.heldout = heldout_split(episode_indices(self.files), heldout_episodes, "train.heldout_episodes")
        self.skipped = sorted(set(int(e) for e in skipped) - set(self.heldout))
        self.used_episodes: set[int] = set()
        self.stats = {g: {k: RunningStats(f"{g}.{k}", exact_threshold, quantile_bins) for k in specs[g]}
                      for g in specs}
        self.rel = {k: RunningStats(f"relative_action.{k}", exact_threshold, quantile_bins)
                    for k in self.relative_action_keys}
        self.slices: dict[tuple[str, str], slice] = {}

    def extract(self, group: str, key: str, cols: dict[str, np.ndarray]) -> np.ndarray:
        spec = self.specs[group][key]
        x = cols[spec.column]
        sl = self.slices.get((group, key))
        if sl is None:
            sl = spec.resolve(x.shape[1], key)
            _check_declared_width(self.info, spec, key, sl)
            self.slices[(group, key)] = sl
        elif x.shape[1] < sl.stop:
            raise DataError(f"key {key!r}: column {spec.column!r} has width {x.shape[1]}, slice needs {sl.stop}")
        return x[:, sl]

    def _relative(self, cols: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        for k in self.relative_action_keys:
            s = self.extract("state", k, cols)
            a = self.extract("action", k, cols)
            if s.shape[1] != a.shape[1]:
                raise DataError(
                    f"relative action key {k!r}: state width {s.shape[1]} != action width {a.shape[1]}"
                )
            for r in relative_samples(s, a, self.action_horizon):
                yield k, r

    def _feed_relative(self, ep_cols: dict[str, np.ndarray], hist: bool) -> None:
        for k, r in self._relative(ep_cols):
            if not hist:
                self.rel[k].update(r)
            elif self.rel[k].needs_pass2:
                self.rel[k].update_hist(r)

    def needs_pass2(self) -> bool:
        return any(s.needs_pass2 for g in self.stats.values() for s in g.values()) or \
            any(s.needs_pass2 for s in self.rel.values())

    def run_pass(self, hist: bool) -> int:
        """One pass over the data files (the histogram pass with `hist`); returns the rows read."""
        from ..progress import Progress

        want_rel = bool(self.rel) and (not hist or any(s.needs_pass2 for s in self.rel.values()))
        grouper = EpisodeGrouper() if want_rel else None
        rows = 0
        total = None if self.max_episodes else self.info.get("total_frames")
        total = total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None
        bar = Progress(total, desc="statistics" + (" (quantiles)" if hist else ""), unit="row", enabled=self.progress)
        try:  # closed on an error too, so the error starts on its own line
            for path, ep, fi, cols in iter_batches(self.files, self.columns, self.batch_rows, self.max_episodes,
                                                   self.heldout + self.skipped):
                rows += len(ep)
                self.used_episodes.update(np.unique(ep).tolist())
                bar.update(n=len(ep))
                for g in self.specs:
                    for k in self.specs[g]:
                        st = self.stats[g][k]
                        if not hist:
                            st.update(self.extract(g, k, cols))
                        elif st.needs_pass2:
                            st.update_hist(self.extract(g, k, cols))
                if grouper is not None:
                    for ep_cols in grouper.feed(path, ep, fi, cols):
                        self._feed_relative(ep_cols, hist)
            if grouper is not None:
                for ep_cols in grouper.close():
                    self._feed_relative(ep_cols, hist)
        finally:
            bar.close()
        return rows

    def results(self) -> dict:
        """The statistics entry: {"state": .., "action": .. [, "relative_action": ..]}."""
        def of(group: dict[str, RunningStats]) -> dict:
            try:
                return {k: s.result() for k, s in group.items()}
            except DataError as e:  # name the dataset the statistics come from
                raise DataError(f"{self.root}: {e}") from None

        statistics = {"state": of(self.stats["state"]), "action": of(self.stats["action"])}
        if self.rel:
            statistics["relative_action"] = of(self.rel)
        return statistics
