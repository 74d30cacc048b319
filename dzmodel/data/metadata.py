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

DEFAULT_QUANTILE_BINS = 10_000
DEFAULT_EXACT_THRESHOLD = 1_000_000
DEFAULT_BATCH_ROWS = 65_536
QUANTILES = (0.01, 0.99)


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
# accumulators


class _Stats:
    """Streaming per-dimension statistics for one key: exact moments, exact or histogram quantiles."""

    def __init__(self, name: str, exact_threshold: int, bins: int):
        self.name = name
        self.exact_threshold = exact_threshold
        self.bins = bins
        self.n = 0
        self.mean: np.ndarray | None = None
        self.m2: np.ndarray | None = None
        self.min: np.ndarray | None = None
        self.max: np.ndarray | None = None
        self.buffer: list[np.ndarray] | None = []  # exact mode while n <= exact_threshold
        self.hist: np.ndarray | None = None

    @property
    def dim(self) -> int | None:
        return None if self.mean is None else self.mean.shape[0]

    def update(self, x: np.ndarray) -> None:
        """Pass 1: x float64 [n, d]."""
        n_b = x.shape[0]
        if n_b == 0:
            return
        if self.mean is not None and x.shape[1] != self.dim:
            raise DataError(f"key {self.name!r}: width changed from {self.dim} to {x.shape[1]}")
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by name in `result`
            self._update_moments(x, n_b)
        if self.buffer is not None:
            if self.n <= self.exact_threshold:
                self.buffer.append(x.copy())
            else:
                self.buffer = None  # too many rows: quantiles from a histogram in pass 2

    def _update_moments(self, x: np.ndarray, n_b: int) -> None:
        mean_b = x.mean(axis=0)
        m2_b = ((x - mean_b) ** 2).sum(axis=0)
        if self.mean is None:
            self.n, self.mean, self.m2 = n_b, mean_b, m2_b
            self.min, self.max = x.min(axis=0), x.max(axis=0)
        else:
            n = self.n + n_b
            delta = mean_b - self.mean
            self.mean = self.mean + delta * (n_b / n)
            self.m2 = self.m2 + m2_b + delta**2 * (self.n * n_b / n)
            self.n = n
            self.min = np.minimum(self.min, x.min(axis=0))
            self.max = np.maximum(self.max, x.max(axis=0))

    @property
    def needs_pass2(self) -> bool:
        return self.buffer is None

    def update_hist(self, x: np.ndarray) -> None:
        """Pass 2: histogram over [min, max] per dimension."""
        d, bins = self.dim, self.bins
        if self.hist is None:
            self.hist = np.zeros(d * bins, dtype=np.int64)
        width = self.max - self.min
        scale = np.where(width > 0, bins / np.where(width > 0, width, 1.0), 0.0)
        idx = np.floor((x - self.min) * scale).astype(np.int64)
        np.clip(idx, 0, bins - 1, out=idx)
        idx += np.arange(d, dtype=np.int64)[None, :] * bins
        self.hist += np.bincount(idx.ravel(), minlength=d * bins)

    def _hist_quantile(self, q: float) -> np.ndarray:
        """Estimate numpy.quantile(x, q) (linear method) from the histogram: within one bin width.

        numpy's value is (1-f) x_(i) + f x_(i+1) with pos = q (n-1), i = floor(pos); each order
        statistic is placed inside the bin that holds it (spread evenly over the bin), so each is off
        by at most one bin width and so is their convex combination.
        """
        d, bins, n = self.dim, self.bins, self.n
        hist = self.hist.reshape(d, bins)
        cum = np.cumsum(hist, axis=1)
        pos = q * (n - 1)
        i = math.floor(pos)
        f = pos - i
        width = (self.max - self.min) / bins

        def order_stat(r: int) -> np.ndarray:
            b = np.array([np.searchsorted(cum[j], r, side="right") for j in range(d)])
            b = np.minimum(b, bins - 1)
            before = np.where(b > 0, cum[np.arange(d), np.maximum(b - 1, 0)], 0)
            count = hist[np.arange(d), b]
            frac = (r - before + 0.5) / np.maximum(count, 1)
            return self.min + (b + frac) * width

        lo = order_stat(i)
        hi = order_stat(min(i + 1, n - 1))
        return np.clip((1 - f) * lo + f * hi, self.min, self.max)

    def result(self) -> dict[str, list[float]]:
        if self.n == 0:
            raise DataError(f"key {self.name!r}: no rows to compute statistics from")
        out = self._result()
        overflowed = [name for name, values in out.items() if not all(map(math.isfinite, values))]
        if overflowed:
            largest = max(abs(float(self.min.min())), abs(float(self.max.max())))
            raise DataError(f"{self.name}: the statistics overflow float64 ({', '.join(overflowed)}); the data holds "
                            f"values as large as {largest:.3g}")
        return out

    def _result(self) -> dict[str, list[float]]:
        out = {
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "std": np.sqrt(np.maximum(self.m2 / self.n, 0.0)),
        }
        if self.buffer is not None:
            allx = np.concatenate(self.buffer, axis=0)
            for q in QUANTILES:
                out[f"q{round(q * 100):02d}"] = np.quantile(allx, q, axis=0)
        else:
            if self.hist is None:
                raise DataError(f"key {self.name!r}: histogram pass did not run")
            for q in QUANTILES:
                out[f"q{round(q * 100):02d}"] = self._hist_quantile(q)
        return {k: [float(v) for v in np.asarray(a, dtype=np.float64)] for k, a in out.items()}


# ---------------------------------------------------------------------------------------------
# reading


def _load_info(root: Path) -> dict:
    """meta/info.json, with `features` a mapping of feature mappings (what the statistics read from it)."""
    path = root / "meta" / "info.json"
    if not path.is_file():
        raise DataError(f"{path}: not found (is {root} a LeRobot v3.0 dataset?)")
    try:
        info = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(info, dict):
        raise DataError(f"{path}: must hold a JSON object, got {type(info).__name__}")
    features = info.get("features", {})
    if not isinstance(features, dict):
        raise DataError(f"{path}: features: must be an object of features, got {type(features).__name__}")
    for key, feature in features.items():
        if not isinstance(feature, dict):
            raise DataError(f"{path}: features.{key}: must be an object (dtype, shape, ...), got {feature!r:.60}")
    info["_path"] = str(path)  # for messages; never written out
    return info


def _feature_shape(info: dict, column: str) -> list[int] | None:
    """features.<column>.shape as positive integers (None when it is absent)."""
    shape = info["features"].get(column, {}).get("shape")
    if shape is None:
        return None
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise DataError(f"{info['_path']}: features.{column}.shape: must be a list of positive integers, got {shape!r:.60}")
    return shape


def _data_files(root: Path) -> list[Path]:
    files = sorted((root / "data").glob("**/*.parquet"))
    if not files:
        raise DataError(f"{root / 'data'}: no parquet data files")
    return files


def _column_to_2d(arr, path: Path, column: str, row0: int, episodes: np.ndarray, frames: np.ndarray | None) -> np.ndarray:
    """A pyarrow array (numeric, list or fixed-size list of numbers) -> float64 [n, w]; a NaN or infinity is a
    DataError naming the file, episode, column and frame (`episodes`, `frames`: the batch's rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(arr)
    if arr.null_count:
        row = row0 + int(np.flatnonzero(np.asarray(arr.is_null()))[0])
        raise DataError(f"{path}: column {column!r} row {row} is null")
    t = arr.type
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = np.asarray(pc.list_value_length(arr))
        if n and (lengths != lengths[0]).any():
            bad = int(np.flatnonzero(lengths != lengths[0])[0])
            raise DataError(
                f"{path}: column {column!r} row {row0 + bad} has {lengths[bad]} values, row {row0} has {lengths[0]}"
            )
        width = int(lengths[0]) if n else (t.list_size if pa.types.is_fixed_size_list(t) else 0)
        values = arr.flatten()
        if values.null_count:
            bad = int(np.flatnonzero(np.asarray(values.is_null()))[0]) // max(width, 1)
            raise DataError(f"{path}: column {column!r} row {row0 + bad} has a null value")
        out = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64).reshape(n, width)
    elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        out = np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.float64).reshape(n, 1)
    else:
        raise DataError(f"{path}: column {column!r} has type {t}, not numeric or a list of numbers")
    bad = ~np.isfinite(out)
    if bad.any():
        r, dim = (int(i) for i in np.argwhere(bad)[0])
        frame = int(frames[r]) if frames is not None else f"row {row0 + r}"
        count = int(bad[episodes == episodes[r]].sum())
        raise DataError(f"{path}: episode {int(episodes[r])}, column {column!r}: {out[r, dim]} at frame {frame} "
                        f"(dim {dim}); {count} non-finite value(s) in this episode (states and actions must be finite)")
    return out


def _episode_indices(files: Sequence[Path]) -> list[int]:
    """Every episode index in the data files (only their episode_index column is read)."""
    import pyarrow.parquet as pq

    found: set[int] = set()
    for path in files:
        try:
            column = pq.read_table(path, columns=["episode_index"]).column("episode_index")
        except Exception as e:  # pyarrow raises several types for corrupt files or a missing column
            raise DataError(f"{path}: cannot read column 'episode_index' ({e})") from e
        found.update(np.unique(np.asarray(column.to_numpy(), dtype=np.int64)).tolist())
    return sorted(found)


def _iter_batches(
    files: Sequence[Path], columns: Sequence[str], batch_rows: int, max_episodes: int | None,
    excluded: Sequence[int] = (),
) -> Iterator[tuple[Path, np.ndarray, np.ndarray | None, dict[str, np.ndarray]]]:
    """Yield (file, episode_index [n], frame_index [n] | None, {column: float64 [n, w]}) per batch, without the
    rows of the `excluded` episodes (which do not count towards `max_episodes`)."""
    import pyarrow.parquet as pq

    excluded_arr = np.asarray(sorted(excluded), dtype=np.int64)
    allowed: dict[int, None] = {}
    done = False
    for path in files:
        if done:
            break
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(f"{path}: cannot read parquet ({e})") from e
        names = set(pf.schema_arrow.names)
        for c in columns:
            if c not in names:
                raise DataError(f"{path}: column {c!r} not found (has {sorted(names)})")
        if "episode_index" not in names:
            raise DataError(f"{path}: column 'episode_index' not found")
        want = list(dict.fromkeys([*columns, "episode_index"] + (["frame_index"] if "frame_index" in names else [])))
        row0 = 0
        for batch in pf.iter_batches(batch_size=batch_rows, columns=want):
            n = batch.num_rows
            ep = np.asarray(batch.column("episode_index").to_numpy(zero_copy_only=False), dtype=np.int64)
            keep = ~np.isin(ep, excluded_arr) if excluded_arr.size else None
            if max_episodes is not None:
                for e in dict.fromkeys((ep if keep is None else ep[keep]).tolist()):
                    if e not in allowed and len(allowed) < max_episodes:
                        allowed[e] = None
                within = np.isin(ep, np.fromiter(allowed, dtype=np.int64, count=len(allowed)))
                keep = within if keep is None else keep & within
            if keep is not None and not keep.any():
                if max_episodes is not None and len(allowed) >= max_episodes:
                    done = True  # episodes are contiguous in v3 files: the rest is beyond the limit
                    break
                row0 += n
                continue
            fi = (
                np.asarray(batch.column("frame_index").to_numpy(zero_copy_only=False), dtype=np.int64)
                if "frame_index" in want
                else None
            )
            cols = {c: _column_to_2d(batch.column(c), path, c, row0, ep, fi) for c in columns}
            if keep is not None and not keep.all():
                cols = {c: v[keep] for c, v in cols.items()}
                ep = ep[keep]
                fi = fi[keep] if fi is not None else None
            row0 += n
            yield path, ep, fi, cols


class _EpisodeGrouper:
    """Collects consecutive rows of one episode across batches; yields whole episodes."""

    def __init__(self):
        self.ep: int | None = None
        self.parts: list[tuple[np.ndarray | None, dict[str, np.ndarray]]] = []
        self.finished: set[int] = set()
        self.path: Path | None = None

    def feed(self, path, ep, fi, cols) -> Iterator[dict[str, np.ndarray]]:
        bounds = np.flatnonzero(np.diff(ep)) + 1
        starts = np.concatenate([[0], bounds])
        ends = np.concatenate([bounds, [len(ep)]])
        for s, e in zip(starts, ends):
            e_idx = int(ep[s])
            if e_idx != self.ep:
                if self.ep is not None:
                    yield self._flush()
                if e_idx in self.finished:
                    raise DataError(f"{path}: episode {e_idx} rows are not contiguous (it appears again at a later row)")
                self.ep = e_idx
                self.path = path
            self.parts.append((None if fi is None else fi[s:e], {c: v[s:e] for c, v in cols.items()}))

    def close(self) -> Iterator[dict[str, np.ndarray]]:
        if self.ep is not None:
            yield self._flush()

    def _flush(self) -> dict[str, np.ndarray]:
        cols = {c: np.concatenate([p[1][c] for p in self.parts]) for c in self.parts[0][1]}
        if self.parts[0][0] is not None:
            fi = np.concatenate([p[0] for p in self.parts])
            if (np.diff(fi) < 0).any():
                order = np.argsort(fi, kind="stable")
                cols = {c: v[order] for c, v in cols.items()}
        self.finished.add(self.ep)
        self.ep, self.parts = None, []
        return cols


def _relative_samples(state: np.ndarray, action: np.ndarray, horizon: int) -> Iterator[np.ndarray]:
    """action[a + k] - state[a] for every anchor a and k in 0..horizon-1 with a + k < len."""
    length = state.shape[0]
    for k in range(min(horizon, length)):
        yield action[k:] - state[: length - k]


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
        shape = _feature_shape(info, col) or []
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
    shape = _feature_shape(info, spec.column)
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
    progress: bool = True,
    quantile_bins: int = DEFAULT_QUANTILE_BINS,
    exact_threshold: int = DEFAULT_EXACT_THRESHOLD,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    declared_dims: Mapping[tuple[str, str], int] | None = None,
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
        quantile_bins: histogram bins per dimension for q01/q99 above ``exact_threshold`` rows;
            the error is at most (max - min) / quantile_bins per dimension.
        exact_threshold: at most this many rows (values per dimension) per key -> exact quantiles.
        batch_rows: rows per parquet batch read (memory bound of one pass).
        declared_dims: {(group, key): dim} the embodiment declares; a key whose data has another width is a
            DataError, and nothing is written.

    The entry records the episodes its statistics come from: ``statistics_episodes`` (how many) and
    ``heldout_episodes`` (the indices left out).

    Returns the whole document written (``{tag: entry}``, plus other tags when merging).
    Raises DataError for a missing/bad column, a NaN or null (naming file, column and row), a slice
    that does not fit its column (naming the key), or an out_path inside the dataset.
    """
    root = Path(dataset_root).resolve()
    if not root.is_dir():
        raise DataError(f"{root}: dataset directory not found")
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

    specs = {
        "state": {k: KeySpec.parse(v, k) for k, v in state_keys.items()},
        "action": {k: KeySpec.parse(v, k) for k, v in action_keys.items()},
    }
    for k in relative_action_keys:
        if k not in specs["state"] or k not in specs["action"]:
            raise DataError(f"relative action key {k!r}: must be both a state key and an action key")

    info = _load_info(root)
    files = _data_files(root)
    columns = sorted({s.column for group in specs.values() for s in group.values()})
    heldout: list[int] = []
    if heldout_episodes:
        from .sampling import heldout_split

        _, heldout = heldout_split(_episode_indices(files), heldout_episodes, "train.heldout_episodes")
    used_episodes: set[int] = set()

    stats = {g: {k: _Stats(f"{g}.{k}", exact_threshold, quantile_bins) for k in specs[g]} for g in specs}
    rel = {k: _Stats(f"relative_action.{k}", exact_threshold, quantile_bins) for k in relative_action_keys}
    slices: dict[tuple[str, str], slice] = {}

    def extract(group: str, key: str, cols: dict[str, np.ndarray]) -> np.ndarray:
        spec = specs[group][key]
        x = cols[spec.column]
        sl = slices.get((group, key))
        if sl is None:
            sl = spec.resolve(x.shape[1], key)
            _check_declared_width(info, spec, key, sl)
            slices[(group, key)] = sl
        elif x.shape[1] < sl.stop:
            raise DataError(f"key {key!r}: column {spec.column!r} has width {x.shape[1]}, slice needs {sl.stop}")
        return x[:, sl]

    def episodes_rel(cols: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        for k in relative_action_keys:
            s = extract("state", k, cols)
            a = extract("action", k, cols)
            if s.shape[1] != a.shape[1]:
                raise DataError(
                    f"relative action key {k!r}: state width {s.shape[1]} != action width {a.shape[1]}"
                )
            for r in _relative_samples(s, a, action_horizon):
                yield k, r

    def feed_rel(ep_cols: dict[str, np.ndarray], hist: bool) -> None:
        for k, r in episodes_rel(ep_cols):
            if not hist:
                rel[k].update(r)
            elif rel[k].needs_pass2:
                rel[k].update_hist(r)

    def run_pass(hist: bool) -> int:
        from ..progress import Progress

        want_rel = bool(rel) and (not hist or any(s.needs_pass2 for s in rel.values()))
        grouper = _EpisodeGrouper() if want_rel else None
        rows = 0
        total = None if max_episodes else info.get("total_frames")
        total = total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None
        bar = Progress(total, desc="statistics" + (" (quantiles)" if hist else ""), unit="row",
                       enabled=progress)
        try:  # closed on an error too, so the error starts on its own line
            for path, ep, fi, cols in _iter_batches(files, columns, batch_rows, max_episodes, heldout):
                rows += len(ep)
                used_episodes.update(np.unique(ep).tolist())
                bar.update(n=len(ep))
                for g in specs:
                    for k in specs[g]:
                        st = stats[g][k]
                        if not hist:
                            st.update(extract(g, k, cols))
                        elif st.needs_pass2:
                            st.update_hist(extract(g, k, cols))
                if grouper is not None:
                    for ep_cols in grouper.feed(path, ep, fi, cols):
                        feed_rel(ep_cols, hist)
            if grouper is not None:
                for ep_cols in grouper.close():
                    feed_rel(ep_cols, hist)
        finally:
            bar.close()
        return rows

    if run_pass(hist=False) == 0:
        raise DataError(f"{root}: no data rows")
    all_stats = [*stats["state"].values(), *stats["action"].values(), *rel.values()]
    for (group, key), want in (declared_dims or {}).items():
        got = stats[group][key].dim if key in stats.get(group, {}) else None
        if got is not None and got != want:
            raise DataError(f"{group} key {key!r}: the data has {got} dims (column {specs[group][key].column!r}), "
                            f"the embodiment declares dim {want}; fix the YAML's dim or slice")
    if any(s.needs_pass2 for s in all_stats):
        run_pass(hist=True)

    def modality(group: str) -> dict:
        return {
            k: {"absolute": True, "rotation_type": None, "shape": [stats[group][k].dim], "continuous": True}
            for k in specs[group]
        }

    def results(group: dict[str, _Stats]) -> dict:
        try:
            return {k: s.result() for k, s in group.items()}
        except DataError as e:  # name the dataset the statistics come from
            raise DataError(f"{root}: {e}") from None

    statistics = {"state": results(stats["state"]), "action": results(stats["action"])}
    if rel:
        statistics["relative_action"] = results(rel)
    entry = {
        "statistics": statistics,
        "modalities": {
            "video": _video_modalities(info, video_keys),
            "state": modality("state"),
            "action": modality("action"),
        },
        "embodiment_tag": embodiment_tag,
        "statistics_episodes": len(used_episodes),
        "heldout_episodes": heldout,
    }
    doc = {embodiment_tag: entry}
    if out_path is not None:
        if merge and out.exists():
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
            doc = existing
        atomic_write_text(out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return doc
