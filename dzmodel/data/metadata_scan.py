"""What `compute_metadata` (dzmodel/data/metadata.py) reads and accumulates: a LeRobot dataset's info and parquet
columns, batch by batch and grouped per episode, and streaming per-dimension statistics (exact moments, exact or
histogram quantiles)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import check_column_sizes, check_inside, file_kind_problem, load_json

QUANTILES = (0.01, 0.99)  # the statistics' q01 and q99


# ---------------------------------------------------------------------------------------------
# accumulators


class RunningStats:
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


def load_info(root: Path, allow_outside: bool = False) -> dict:
    """meta/info.json, with `features` a mapping of feature mappings (what the statistics read from it): a regular
    file inside the dataset after symlinks (unless allow_outside)."""
    path = root / "meta" / "info.json"
    if not path.is_file():
        raise DataError(f"{path}: not found (is {root} a LeRobot v3.0 dataset?)")
    check_inside(root, path, allow_outside)
    info = load_json(path)
    if not isinstance(info, dict):
        raise DataError(f"{path}: must hold a JSON object, got {type(info).__name__}")
    features = info.get("features", {})
    if not isinstance(features, dict):
        raise DataError(f"{path}: features: must be an object of features, got {type(features).__name__}")
    for key, feature in features.items():
        if not isinstance(feature, dict):
            raise DataError(f"{path}: features.{key[:100]}: must be an object (dtype, shape, ...), got {feature!r:.60}")
    info["_path"] = str(path)  # for messages; never written out
    return info


def feature_shape(info: dict, column: str) -> list[int] | None:
    """features.<column>.shape as positive integers (None when it is absent)."""
    shape = info["features"].get(column, {}).get("shape")
    if shape is None:
        return None
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise DataError(f"{info['_path']}: features.{column}.shape: must be a list of positive integers, got {shape!r:.60}")
    return shape


def data_files(root: Path, allow_outside: bool = False) -> list[Path]:
    """Every parquet file under root/data; one that a symlink places outside the dataset is a DataError (unless
    allow_outside)."""
    files = []
    for path in sorted((root / "data").glob("**/*.parquet")):
        check_inside(root, path, allow_outside)
        if file_kind_problem(path) is None:  # a FIFO or device named *.parquet is not data (reading one never ends)
            files.append(path)
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


def episode_indices(files: Sequence[Path]) -> list[int]:
    """Every episode index in the data files (only their episode_index column is read)."""
    import pyarrow.parquet as pq

    found: set[int] = set()
    for path in files:
        check_column_sizes(path, ["episode_index"])
        try:
            column = pq.read_table(path, columns=["episode_index"]).column("episode_index")
        except Exception as e:  # pyarrow raises several types for corrupt files or a missing column
            raise DataError(f"{path}: cannot read column 'episode_index' ({e})") from e
        found.update(np.unique(np.asarray(column.to_numpy(), dtype=np.int64)).tolist())
    return sorted(found)


def iter_batches(
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
        check_column_sizes(path, want)
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


class EpisodeGrouper:
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


def relative_samples(state: np.ndarray, action: np.ndarray, horizon: int) -> Iterator[np.ndarray]:
    """action[a + k] - state[a] for every anchor a and k in 0..horizon-1 with a + k < len."""
    length = state.shape[0]
    for k in range(min(horizon, length)):
        yield action[k:] - state[: length - k]
