"""One reader over LeRobot dataset layouts: v3.0, v2.1/v2.0 (mp4 videos) and image-in-parquet.

Layouts (``meta/info.json`` ``codebase_version``):
  v3.0  many episodes per data parquet and per mp4 (episodes concatenated; frame i of an episode
        is at ``videos/<key>/from_timestamp + i / fps``); episode table in
        ``meta/episodes/chunk-*/file-*.parquet``; tasks in ``meta/tasks.parquet``.
  v2.x  one parquet and one mp4 per episode (``episode_chunk = episode_index // chunks_size``);
        ``meta/episodes.jsonl`` and ``meta/tasks.jsonl``.
  image features (dtype "image", either version): the data parquet column is a struct
        {bytes, path} holding PNG/JPEG bytes; no mp4.

pyarrow is imported lazily (the GPU image's model code must import without it).
"""

from __future__ import annotations

import json
import os
import re
import stat
import string
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dzmodel.data.errors import DataError
from dzmodel.data.remote import S3Mirror, is_remote
from dzmodel.schema import bounded_repr

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
INFO_PATH = "meta/info.json"
V3_TASKS_PATH = "meta/tasks.parquet"
V3_EPISODES_DIR = "meta/episodes"
V2_EPISODES_PATH = "meta/episodes.jsonl"
V2_TASKS_PATH = "meta/tasks.jsonl"
STATS_PATH = "meta/stats.json"
_TABLE_CACHE_FILES = 4
MAX_EPISODES = 1_000_000  # rows of an episode table
MAX_TASKS = 1_000_000  # rows of a tasks table, and task texts named by an episode table in all
MAX_TASKS_PER_EPISODE = 64
MAX_TASK_CHARS = 64 * 1024
MAX_COLUMN_BYTES = 256 * 2**20  # uncompressed bytes of one column of one parquet file (read whole)
MAX_INDEX = 2**63 - 1  # an episode or task index (int64)
MAX_JSON_BYTES = 4 * 2**20  # meta/info.json, meta/stats.json: read whole, parsed whole
MAX_JSONL_LINE_BYTES = 4 * 2**20 + 64 * 1024  # a line of episodes.jsonl / tasks.jsonl (its task texts and the rest)
MAX_FROM_TIMESTAMP_S = 10_000_000  # where an episode starts in its v3.0 video file, in seconds
_COUNT_BATCH_ROWS = 1 << 20  # rows of an episode_index column counted at a time
_IMAGE_ROW_GROUPS_CACHED = 8


@dataclass(frozen=True)
class Feature:
    key: str
    dtype: str
    shape: tuple[int, ...]
    names: Any = None


@dataclass(frozen=True)
class Episode:
    index: int
    length: int
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class _EpisodeLoc:
    """Where an episode's rows and frames live."""

    data_file: str  # relative to root
    video_files: dict[str, str]  # video key -> relative path
    from_timestamps: dict[str, float]  # video key -> start of the episode in that mp4


class _Strings:
    """Distinct strings, each stored once: `add` gives a string's id."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.values: list[str] = []

    def add(self, value: str) -> int:
        i = self.ids.get(value)
        if i is None:
            i = self.ids[value] = len(self.values)
            self.values.append(value)
        return i


class EpisodeIndex(Sequence):
    """The episode table as columns (numpy arrays and one list of distinct strings), sorted by episode index: a
    few dozen bytes per episode whatever the dataset's size, and no Python object per episode, so the loader
    workers that fork from the trainer share its pages instead of copying them. Reads as a sequence of `Episode`.

    index, length [N]; tasks as ids into `strings`, episode i's from task_ids[task_ptr[i]:task_ptr[i + 1]];
    data_file [N] and video_file {key: [N]}: ids into `strings` (paths relative to the root); from_timestamp
    {key: [N]}. An episode listed twice keeps its last row, as a dict of rows would."""

    def __init__(self, index, length, task_ptr, task_ids, data_file, video_file: dict, from_timestamp: dict,
                 strings: list[str]):
        index = np.asarray(index, dtype=np.int64)
        order = np.argsort(index, kind="stable")
        last = np.ones(len(order), dtype=bool)  # the last row of each episode index
        last[:-1] = index[order][1:] != index[order][:-1]
        keep = order[last]
        starts, ends = np.asarray(task_ptr[:-1])[keep], np.asarray(task_ptr[1:])[keep]
        self.index = index[keep]
        self.length = np.asarray(length, dtype=np.int64)[keep]
        self.task_ptr = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(ends - starts, out=self.task_ptr[1:])
        task_ids = np.asarray(task_ids, dtype=np.int32)
        self.task_ids = (np.concatenate([task_ids[a:b] for a, b in zip(starts, ends)]) if len(keep)
                         else np.zeros(0, dtype=np.int32)).astype(np.int32)
        self.data_file = np.asarray(data_file, dtype=np.int32)[keep]
        self.video_file = {k: np.asarray(v, dtype=np.int32)[keep] for k, v in video_file.items()}
        self.from_timestamp = {k: np.asarray(v, dtype=np.float64)[keep] for k, v in from_timestamp.items()}
        self.strings = strings

    @classmethod
    def from_rows(cls, rows: dict[int, tuple[int, tuple[str, ...], _EpisodeLoc]],
                  video_keys: Sequence[str]) -> "EpisodeIndex":
        """rows: episode index -> (length, tasks, where its files are), as the v2 loader reads them."""
        strings = _Strings()
        items = list(rows.items())
        tasks = [[strings.add(t) for t in r[1]] for _, r in items]
        return cls([ep for ep, _ in items], [r[0] for _, r in items],
                   np.concatenate([[0], np.cumsum([len(t) for t in tasks], dtype=np.int64)]),
                   [i for t in tasks for i in t], [strings.add(r[2].data_file) for _, r in items],
                   {k: [strings.add(r[2].video_files[k]) for _, r in items] for k in video_keys},
                   {k: [r[2].from_timestamps[k] for _, r in items] for k in video_keys}, strings.values)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        a, b = self.task_ptr[i], self.task_ptr[i + 1]
        return Episode(int(self.index[i]), int(self.length[i]), tuple(self.strings[t] for t in self.task_ids[a:b]))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def position(self, episode: int) -> int | None:
        """Where episode `episode` sits in the table (None: not in it)."""
        i = int(np.searchsorted(self.index, episode))
        return i if i < len(self.index) and self.index[i] == episode else None

    def loc(self, position: int) -> _EpisodeLoc:
        return _EpisodeLoc(self.strings[self.data_file[position]],
                           {k: self.strings[v[position]] for k, v in self.video_file.items()},
                           {k: float(v[position]) for k, v in self.from_timestamp.items()})

    def nbytes(self) -> int:
        """The arrays' bytes (the distinct strings not counted: files and tasks, not episodes)."""
        arrays = [self.index, self.length, self.task_ptr, self.task_ids, self.data_file,
                  *self.video_file.values(), *self.from_timestamp.values()]
        return sum(a.nbytes for a in arrays)


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"pyarrow is required to read LeRobot datasets ({e}); `pip install pyarrow`") from e
    return pa, pq


class _ColumnCache:
    """Small LRU of parquet files -> {column: pyarrow ChunkedArray}; columns load on demand."""

    def __init__(self, max_files: int = _TABLE_CACHE_FILES):
        self.max_files = max_files
        self._files: OrderedDict[Path, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def columns(self, path: Path, names: Sequence[str]) -> dict[str, Any]:
        with self._lock:
            cols = self._files.get(path)
            if cols is None:
                cols = self._files[path] = {}
            self._files.move_to_end(path)
            while len(self._files) > self.max_files:
                self._files.popitem(last=False)
            missing = [n for n in dict.fromkeys(names) if n not in cols]
        if missing:
            have = set(read_parquet_schema(path).names)
            absent = [n for n in missing if n not in have]
            if absent:
                raise DataError(f"{path}: no column(s) {absent}; it has {sorted(have)}")
            check_column_sizes(path, missing)
            table = read_parquet(path, columns=missing)
            with self._lock:
                for n in missing:
                    cols[n] = table.column(n)
        return {n: cols[n] for n in names}

    def clear(self) -> None:
        with self._lock:
            self._files.clear()


def read_parquet(path: Path, columns: Sequence[str] | None = None):
    """pyarrow Table of ``path``; a missing, truncated or corrupt file is a DataError naming it."""
    _, pq = _pa()
    if not path.is_file():
        raise DataError(f"{path}: parquet file is missing")
    try:
        return pq.read_table(path, columns=list(columns) if columns is not None else None)
    except Exception as e:  # ArrowInvalid, OSError on truncation, ...
        raise DataError(f"{path}: cannot read parquet (truncated or corrupt?): {type(e).__name__}: {e}") from e


def check_column_sizes(path: Path, columns: Sequence[str] | None = None) -> None:
    """A DataError naming the file and column when a column would take more than MAX_COLUMN_BYTES once read (from
    the footer, `_chunk_bytes`, over every row group: the readers read a file's column whole). A small,
    well-compressed file can otherwise unpack to more memory than the machine has. `columns`: the top-level columns
    to be read (None: all)."""
    _, pq = _pa()
    try:
        pf = pq.ParquetFile(path)
        md = pf.metadata
        names = list(pf.schema_arrow.names if columns is None else columns)
    except Exception as e:
        raise DataError(f"{path}: cannot read parquet (truncated or corrupt?): {type(e).__name__}: {e}") from e
    sizes: dict[str, int] = {}
    for i in range(md.num_row_groups):
        group = md.row_group(i)
        for j in range(group.num_columns):
            chunk = group.column(j)
            name = _top_column(chunk.path_in_schema, names)
            if name is not None:
                sizes[name] = sizes.get(name, 0) + _chunk_bytes(chunk)
    for name, size in sizes.items():
        if size > MAX_COLUMN_BYTES:
            raise DataError(f"{path}: column {_short(repr(name), 100)} holds {size / 2**20:.0f} MiB once read; at "
                            f"most {MAX_COLUMN_BYTES // 2**20} MiB of one column of one file are read")


_VALUE_BYTES = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


def _chunk_bytes(chunk) -> int:
    """What one column chunk takes once read, from the footer: its values at their width (dictionary and run-length
    encoding shrink a page of repeated values to almost nothing, so the encoded size alone says little), and for
    strings and binaries their encoded bytes too."""
    values = max(int(chunk.num_values), 0)
    width = _VALUE_BYTES.get(chunk.physical_type, 8)  # byte arrays: an offset each, plus their bytes below
    extra = max(int(chunk.total_uncompressed_size), 0) if chunk.physical_type not in _VALUE_BYTES else 0
    return values * width + extra


def _top_column(leaf: str, names: Sequence[str]) -> str | None:
    """Which of the top-level column `names` a parquet leaf path ("a.b.list.element") belongs to (names may hold
    dots themselves: the longest that prefixes the path), or None."""
    found = [n for n in names if leaf == n or leaf.startswith(n + ".")]
    return max(found, key=len) if found else None


def _leaf_values(path: Path, column: str) -> int:
    """How many values (list items, nulls included) top-level `column` of a parquet file holds, from its footer."""
    _, pq = _pa()
    md = pq.ParquetFile(path).metadata
    names = pq.ParquetFile(path).schema_arrow.names
    return sum(int(md.row_group(i).column(j).num_values) for i in range(md.num_row_groups)
               for j in range(md.num_columns) if _top_column(md.row_group(i).column(j).path_in_schema, names) == column)


def _rows_per_episode(path: Path) -> dict[int, int]:
    """How many rows each episode has in a data file: its episode_index column counted batch by batch (a file of
    tens of millions of rows is never read whole)."""
    _, pq = _pa()
    counts: dict[int, int] = {}
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_COUNT_BATCH_ROWS, columns=["episode_index"])
        for batch in batches:
            episodes = _column_to_numpy(batch.column(0), f"{path}: episode_index")
            values, n = np.unique(episodes.astype(np.int64), return_counts=True)
            for value, rows in zip(values.tolist(), n.tolist(), strict=True):
                counts[value] = counts.get(value, 0) + rows
    except DataError:
        raise
    except Exception as e:  # a missing column, a truncated or corrupt file
        raise DataError(f"{path}: cannot read column 'episode_index': {type(e).__name__}: {_short(str(e), 200)}") from e
    return counts


def read_parquet_schema(path: Path):
    """pyarrow Schema of ``path`` (reads only the footer); DataError naming the file if unreadable."""
    _, pq = _pa()
    if not path.is_file():
        raise DataError(f"{path}: parquet file is missing")
    try:
        return pq.read_schema(path)
    except Exception as e:
        raise DataError(f"{path}: cannot read parquet (truncated or corrupt?): {type(e).__name__}: {e}") from e


def _num_rows(path: Path) -> int:
    _, pq = _pa()
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as e:
        raise DataError(f"{path}: cannot read parquet (truncated or corrupt?): {type(e).__name__}: {e}") from e


def load_json(path: Path) -> Any:
    """A JSON file's value; a file of more than MAX_JSON_BYTES (refused before it is parsed: parsed JSON takes up to
    twenty times its bytes), unreadable, invalid or too deeply nested JSON (or a number of thousands of digits) is a
    DataError naming the file."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            data = fh.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError as e:
        raise DataError(f"{path}: missing") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from e
    if len(data) > MAX_JSON_BYTES:
        raise DataError(f"{path}: {max(size, len(data))} bytes; at most {MAX_JSON_BYTES} bytes of a metadata JSON file "
                        "are read")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise DataError(f"{path}: invalid JSON: {_short(str(e), 200)}") from e


def _jsonl_lines(path: Path) -> Iterator[bytes]:
    """The lines of a JSON-lines file, read one at a time; a line of more than MAX_JSONL_LINE_BYTES is a DataError
    naming the file and line."""
    try:
        with open(path, "rb") as fh:
            n = 0
            while line := fh.readline(MAX_JSONL_LINE_BYTES + 1):
                n += 1
                if len(line) > MAX_JSONL_LINE_BYTES:
                    raise DataError(f"{path}:{n}: a line of more than {MAX_JSONL_LINE_BYTES} bytes; at most "
                                    f"{MAX_JSONL_LINE_BYTES} are read")
                yield line
    except OSError as e:
        raise DataError(f"{path}: cannot read: {_short(str(e), 200)}") from e


def _load_jsonl(path: Path, max_lines: int) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line, parsed one at a time. More than `max_lines` lines or a line too
    long (both found before any line is parsed), or a line that is not JSON, is a DataError naming the file (and
    line)."""
    if not path.is_file():
        raise DataError(f"{path}: missing")
    count = sum(1 for _ in _jsonl_lines(path))
    if count > max_lines:
        raise DataError(f"{path}: {count} lines; at most {max_lines} are read")
    return _parsed_lines(path)


def _parsed_lines(path: Path) -> Iterator[tuple[int, Any]]:
    for n, line in enumerate(_jsonl_lines(path), 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                raise DataError(f"{path}:{n}: invalid JSON line: {_short(str(e), 200)}") from e


def _column_to_numpy(col, where: str) -> np.ndarray:
    """A pyarrow (Chunked)Array of scalars, lists or fixed-size lists -> numpy [T] or [T, ...]."""
    pa, _ = _pa()
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    n = len(col)
    t = col.type
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        if col.null_count:
            raise DataError(f"{where}: has null rows")
        if pa.types.is_fixed_size_list(t):
            width = t.list_size
        else:
            offsets = np.asarray(col.offsets)
            lengths = np.diff(offsets)
            if n and not np.all(lengths == lengths[0]):
                raise DataError(f"{where}: rows have different lengths {sorted(set(lengths.tolist()))[:5]}")
            width = int(lengths[0]) if n else 0
        inner = _column_to_numpy(col.flatten(), where)
        return inner.reshape((n, width) + inner.shape[1:])
    if pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t):
        if col.null_count:
            raise DataError(f"{where}: has null values")
        return col.to_numpy(zero_copy_only=False)
    raise DataError(f"{where}: unsupported column type {t} for a numeric read")


MIN_FPS = 0.1
MAX_FPS = 1000
MAX_EPISODE_LENGTH = 10_000_000  # frames: more than three days at 30 fps
MAX_TEMPLATE_WIDTH = 32  # digits of a zero-padded field in data_path / video_path
# the fields each layout formats its path templates with
TEMPLATE_FIELDS = {
    "v2": {"data_path": ("episode_chunk", "episode_index", "chunk_index"),
           "video_path": ("episode_chunk", "episode_index", "chunk_index", "video_key")},
    "v3": {"data_path": ("chunk_index", "file_index"),
           "video_path": ("chunk_index", "file_index", "video_key")},
}
_WIDTH_SPEC = re.compile(r"(0?)(\d*)(d?)")


def template_problem(template: str, fields: Sequence[str]) -> str | None:
    """What makes a path template unusable, or None. A template is a relative path whose replacement fields are
    among `fields`, each bare or with a width (`{episode_index:06d}`, at most MAX_TEMPLATE_WIDTH digits; a
    `video_key` without one): no conversions, attributes, indexes, nested fields or other format specs."""
    if os.path.isabs(template) or template.startswith("\\"):
        return "an absolute path; a template is a path inside the dataset"
    if "\0" in template:
        return "holds a NUL character"
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        return f"not a format template ({e})"
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in fields:
            return f"field {{{name:.40}}} is not one of {', '.join(fields)}"
        if conversion:
            return f"{{{name}!{conversion:.10}}}: a conversion is not supported"
        if not spec:
            continue
        width = _WIDTH_SPEC.fullmatch(spec)
        if width is None or name == "video_key":
            return (f"format spec {_short(repr(spec), 40)} of {{{name}}}: only a width is supported, such as "
                    "{episode_index:06d}" + (" (none on video_key)" if name == "video_key" else ""))
        digits = width.group(2).lstrip("0")
        if len(digits) > 2 or int(digits or 0) > MAX_TEMPLATE_WIDTH:
            return f"{{{name}}} has width {digits[:12]}{'...' if len(digits) > 12 else ''}; at most {MAX_TEMPLATE_WIDTH}"
    return None


def _resolve_in(root: str, rel: str, parents: dict[str, str]) -> str:
    """`root`/`rel` with every symlink resolved (os.path.realpath); the directories' resolutions are kept in
    `parents`, so a file costs one lstat."""
    head, tail = os.path.split(rel)
    parent = parents.get(head)
    if parent is None:
        parent = parents[head] = os.path.realpath(os.path.join(root, head))
    path = os.path.join(parent, tail)
    if tail in ("", ".", "..") or os.path.islink(path):
        path = os.path.realpath(path)
    return path


OUTSIDE_HINT = ("(a dataset whose files live elsewhere: copy them in with `dz data fetch PATH`, or pass "
                "--allow-outside-root)")


def check_inside(root: str | Path, path: str | Path, allow_outside: bool = False) -> None:
    """A DataError naming `path` when it resolves outside the dataset folder `root` after symlinks (unless
    allow_outside): what every reader of a dataset's files runs before opening one."""
    if allow_outside:
        return
    real, resolved = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([real, resolved]) != real:
        raise DataError(f"{path}: resolves to {_short(resolved)}, outside the dataset {_short(real)} {OUTSIDE_HINT}")


def file_kind_problem(path: str | Path) -> str | None:
    """None for a regular file (after symlinks); else why it is not one ("cannot read: ..." when it cannot be
    looked at, "not a regular file" for a FIFO, a device, a socket or a directory: reading one may never end)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"cannot read: {e}"
    return None if stat.S_ISREG(mode) else "not a regular file"


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _check_task_texts(path: Path, texts) -> None:
    """A column of task texts (strings, nulls allowed): each at most MAX_TASK_CHARS long (read before any is
    turned into a Python string)."""
    pa, _ = _pa()
    import pyarrow.compute as pc

    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type) or pa.types.is_null(texts.type)):
        return  # other types are turned into text by str(): bounded by the column-size check
    if len(texts) and not pa.types.is_null(texts.type):
        longest = pc.max(pc.binary_length(texts)).as_py()
        if longest is not None and longest > MAX_TASK_CHARS:
            raise DataError(f"{path}: a task text of {longest} bytes; at most {MAX_TASK_CHARS}")


MISSING_SHOWN = 20  # missing files named in the error; a longer list goes to a file


def _check_width(path: Path, key: str, values: np.ndarray, feature: Feature, episode: int) -> None:
    """A column's values per row against info.json's features.<key>.shape."""
    declared, held = int(np.prod(feature.shape)), int(np.prod(values.shape[1:]))
    if declared != held and len(values):
        raise DataError(f"{path}: column {key!r} holds {held} values per row (episode {episode}) but {INFO_PATH} "
                        f"declares features.{key}.shape {list(feature.shape)}")


def _missing_files_report(missing: list[str], episodes: "EpisodeIndex") -> str:
    """Every missing file (or the first MISSING_SHOWN and a file with all of them), and how to train on the rest
    where only videos are missing."""
    text = f"{len(missing)} missing file(s): " + ", ".join(missing[:MISSING_SHOWN])
    if len(missing) > MISSING_SHOWN:
        import tempfile

        try:
            fd, listing = tempfile.mkstemp(prefix="dz-missing-files-", suffix=".txt")
            with os.fdopen(fd, "w") as fh:
                fh.write("\n".join(missing) + "\n")
            text += f" and {len(missing) - MISSING_SHOWN} more (all {len(missing)} listed in {listing})"
        except OSError:  # no writable temp dir: the data error still comes out, with the count
            text += f" and {len(missing) - MISSING_SHOWN} more"
    videos = {episodes.strings[i] for v in episodes.video_file.values() for i in np.unique(v)}
    if all(rel in videos for rel in missing):
        text += (" [only video files are missing: `--skip-missing` (dz data check, dz data fetch) or "
                 "train.skip_missing: true uses the episodes that have all their videos]")
    return text


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_length(table: Path, episode: Any, length: Any) -> None:
    """An episode table's declared length: an integer in 0..MAX_EPISODE_LENGTH (nothing is sized by it before it
    is checked against the data parquet's rows, `LeRobotReader.length_problems`)."""
    if not (_is_int(length, 0) and length <= MAX_EPISODE_LENGTH):
        raise DataError(f"{table}: episode {_short(str(episode), 40)}: length {bounded_repr(length, 40)} must be an "
                        f"integer in 0..{MAX_EPISODE_LENGTH}")


def _check_indices(table: Path, col: dict[str, np.ndarray], names: Sequence[str]) -> None:
    """Index columns of a v3.0 episode table (episode_index, chunk_index, file_index): whole numbers in 0..MAX_INDEX,
    else a DataError naming the table, the column and the row (a NaN would turn into an arbitrary index)."""
    for name in names:
        values = col[name]
        if values.dtype.kind == "b":
            continue
        if values.dtype.kind in "iu":
            bad = np.flatnonzero((values < 0) | (values > MAX_INDEX))
        else:
            with np.errstate(invalid="ignore"):
                v = values.astype(np.float64)
                bad = np.flatnonzero(~((v >= 0) & (v < 2.0**63) & (v == np.floor(v))))
        if bad.size:
            raise DataError(f"{table}: {name}: row {int(bad[0])}: {values[bad[0]].item()!r} must be an integer in "
                            f"0..{MAX_INDEX}")


def _start_times(table: Path, name: str, col: dict[str, np.ndarray]) -> np.ndarray:
    """A v3.0 episode table's `from_timestamp` column as float64: every value a time in seconds in
    0..MAX_FROM_TIMESTAMP_S (a NaN or an infinity would stop training at its first frame), else a DataError naming
    the table, the column and the episode."""
    values = col[name].astype(np.float64)
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~((values >= 0) & (values <= MAX_FROM_TIMESTAMP_S)))
    if bad.size:
        episode = col["episode_index"][bad[0]]
        raise DataError(f"{table}: {name}: episode {_short(str(episode), 40)}: {values[bad[0]]!r} is not a start time; "
                        f"it must be a number of seconds in 0..{MAX_FROM_TIMESTAMP_S}")
    return values


def _bad_lengths(lengths: np.ndarray, episodes: np.ndarray) -> list[tuple[Any, Any]]:
    """(length, episode) of the first length of a column that `_check_length` refuses (none: [])."""
    values = lengths.astype(np.float64)
    bad = np.flatnonzero((values < 0) | (values > MAX_EPISODE_LENGTH) | (values != np.floor(values)))
    if not bad.size:
        return []
    value = lengths[bad[0]].item()
    return [(value if not float(value).is_integer() else int(value), int(episodes[bad[0]]))]


def info_problems(info: Any) -> list[str]:
    """The meta/info.json fields the reader parses, each of the type and range it needs ("field: ...")."""
    if not isinstance(info, dict):
        return [f"must hold a JSON object, got {type(info).__name__}"]
    problems = []
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not MIN_FPS <= fps <= MAX_FPS:
        problems.append(f"fps: must be a number in [{MIN_FPS}, {MAX_FPS}], got {bounded_repr(fps, 60)}")
    for key in ("data_path", "video_path"):
        if key in info and not isinstance(info[key], str) and not (key == "video_path" and info[key] is None):
            problems.append(f"{key}: must be a path template string, got {bounded_repr(info[key], 60)}")
    for key, minimum in (("chunks_size", 1), ("total_episodes", 0), ("total_frames", 0)):
        if info.get(key) is not None and not _is_int(info[key], minimum):
            problems.append(f"{key}: must be an integer >= {minimum}, got {bounded_repr(info[key], 60)}")
    features = info.get("features")
    if not isinstance(features, dict):
        return problems + [f"features: must be an object of features, got {type(features).__name__}"]
    for key, feature in features.items():
        if not isinstance(feature, dict) or not isinstance(feature.get("dtype"), str):
            problems.append(f"features.{_short(key, 100)}: must be an object with a string 'dtype', got "
                            f"{bounded_repr(feature, 60)}")
            continue
        shape = feature.get("shape")  # LeRobot's own reader needs one on every feature
        if not (isinstance(shape, list) and all(_is_int(n, 0) for n in shape)):
            problems.append(f"features.{_short(key, 100)}.shape: must be a list of integers >= 0, got "
                            f"{bounded_repr(shape, 60)}")
    return problems


class LeRobotReader:
    """Reads one LeRobot dataset directory. Open with ``open_dataset(root)``.

    Attributes: ``root``, ``version``, ``fps``, ``features`` (key -> Feature), ``episodes``
    (sorted by index), ``tasks`` (task_index -> text), ``video_keys`` (dtype video or image),
    ``info`` (the raw info.json).
    """

    def __init__(self, root: str | Path, allow_outside: bool = False):
        """allow_outside: read files that the path templates place outside the dataset's folder (after symlinks);
        by default such a path is a DataError before any file is read."""
        self.allow_outside = allow_outside
        # an s3:// URI reads through a local cache of bounded size: `root` is then its local mirror
        self.remote = S3Mirror(str(root)) if is_remote(root) else None
        self.root = self.remote.root if self.remote is not None else Path(root)
        info_path = self.root / INFO_PATH
        if not info_path.is_file():
            raise DataError(f"{info_path}: missing; {self.root} is not a LeRobot dataset")
        info = load_json(self.meta_file(INFO_PATH))
        if not isinstance(info, dict):
            raise DataError(f"{info_path}: must hold a JSON object")
        self.info: dict = info
        self.version = str(info.get("codebase_version", ""))
        if self.version not in SUPPORTED_VERSIONS:
            raise DataError(
                f"{info_path}: codebase_version {self.version or None!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_VERSIONS)})"
            )
        for field in ("fps", "features", "data_path"):
            if field not in info:
                raise DataError(f"{info_path}: field {field!r} is missing")
        problems = info_problems(info)
        if problems:
            raise DataError(f"{info_path}: {problems[0]}" if len(problems) == 1 else
                            f"{info_path}: {len(problems)} problems:\n  " + "\n  ".join(problems))
        try:
            self.fps = float(info["fps"])
        except (TypeError, ValueError) as e:
            raise DataError(f"{info_path}: field 'fps' must be a number, got {info['fps']!r}") from e
        if not self.fps > 0:
            raise DataError(f"{info_path}: field 'fps' must be > 0, got {info['fps']!r}")
        if not isinstance(info["features"], dict):
            raise DataError(f"{info_path}: field 'features' must be an object")
        self.features: dict[str, Feature] = {}
        for key, ft in info["features"].items():
            if not isinstance(ft, dict) or "dtype" not in ft:
                raise DataError(f"{info_path}: features.{_short(key, 100)} must have a 'dtype'")
            shape = tuple(int(s) for s in (ft.get("shape") or ()))
            self.features[key] = Feature(key, str(ft["dtype"]), shape, ft.get("names"))
        self.video_keys: list[str] = [k for k, f in self.features.items() if f.dtype in ("video", "image")]
        self._mp4_keys = [k for k, f in self.features.items() if f.dtype == "video"]
        self.data_path: str = info["data_path"]
        self.video_path: str | None = info.get("video_path")
        if self._mp4_keys and not self.video_path:
            raise DataError(f"{info_path}: features {self._mp4_keys} are videos but 'video_path' is missing")
        self.chunks_size = int(info.get("chunks_size") or 1000)
        self._check_templates(info_path)
        self._cache = _ColumnCache()
        self._rows: dict[tuple[str, int], np.ndarray] = {}
        self._rg_starts: dict[Path, np.ndarray] = {}
        self._rg_cache: OrderedDict[tuple[str, str, int], Any] = OrderedDict()
        self._lengths_checked = False
        if self.version == "v3.0":
            self._load_v3()
        else:
            self._load_v2()
        if not allow_outside:
            self._check_inside(info_path)

    def meta_file(self, rel: str) -> Path:
        """The dataset's metadata file `rel` (meta/...): a regular file, inside the dataset's folder after symlinks
        unless allow_outside; else a DataError naming it (a missing file is left to the caller)."""
        path = self.root / rel
        if not os.path.lexists(path):
            return path
        check_inside(self.root, path, self.allow_outside)
        problem = file_kind_problem(path)
        if problem:
            raise DataError(f"{path}: {problem}")
        return path

    def _check_templates(self, info_path: Path) -> None:
        """data_path and video_path: relative paths formatted only with the fields this layout supplies."""
        fields = TEMPLATE_FIELDS["v3" if self.version == "v3.0" else "v2"]
        for key, template in (("data_path", self.data_path), ("video_path", self.video_path)):
            problem = template_problem(template, fields[key]) if isinstance(template, str) else None
            if problem:
                raise DataError(f"{info_path}: {key}: {problem} (template {_short(repr(template), 100)})")

    def _check_inside(self, info_path: Path) -> None:
        """Every data and video file the templates and the episode table name resolves inside the dataset's folder
        after symlinks; else a DataError naming the field and the resolved path."""
        root = os.path.realpath(self.root)
        parents: dict[str, str] = {}
        named = [("data_path", self.episodes.data_file), *(("video_path", v) for v in self.episodes.video_file.values())]
        for key, ids in named:
            for i in np.unique(ids).tolist():
                rel = self.episodes.strings[i]
                try:
                    resolved = _resolve_in(str(self.root), rel, parents)
                except (OSError, ValueError) as e:
                    raise DataError(f"{info_path}: {key}: {_short(repr(rel), 100)} is not a usable path ({e})") from e
                if os.path.commonpath([root, resolved]) != root:
                    raise DataError(
                        f"{info_path}: {key} gives {_short(repr(rel), 100)}, which resolves to {_short(resolved)}: "
                        f"outside the dataset {_short(root)} {OUTSIDE_HINT}")

    # ---------------------------------------------------------------- metadata loading

    def _load_v2(self) -> None:
        tasks_path = self.meta_file(V2_TASKS_PATH)
        self.tasks = {}
        for n, row in _load_jsonl(tasks_path, MAX_TASKS):
            if not isinstance(row, dict) or "task_index" not in row or "task" not in row:
                raise DataError(f"{tasks_path}:{n}: each line needs 'task_index' and 'task', got "
                                f"{bounded_repr(row, 100)}")
            if not (_is_int(row["task_index"], 0) and row["task_index"] <= MAX_INDEX):
                raise DataError(f"{tasks_path}:{n}: task_index must be an integer in 0..{MAX_INDEX}, got "
                                f"{bounded_repr(row['task_index'], 40)}")
            if not isinstance(row["task"], str) or len(row["task"]) > MAX_TASK_CHARS:
                raise DataError(f"{tasks_path}:{n}: task must be a string of at most {MAX_TASK_CHARS} characters, got "
                                f"{bounded_repr(row['task'], 40)}")
            self.tasks[row["task_index"]] = row["task"]
        ep_path = self.meta_file(V2_EPISODES_PATH)
        rows: dict[int, tuple] = {}
        for n, row in _load_jsonl(ep_path, MAX_EPISODES):
            if not isinstance(row, dict) or "episode_index" not in row or "length" not in row:
                raise DataError(f"{ep_path}:{n}: each line needs 'episode_index' and 'length', got "
                                f"{bounded_repr(row, 100)}")
            if not (_is_int(row["episode_index"], 0) and row["episode_index"] <= MAX_INDEX):
                raise DataError(f"{ep_path}:{n}: episode_index must be an integer in 0..{MAX_INDEX}, got "
                                f"{bounded_repr(row['episode_index'], 40)}")
            ep = int(row["episode_index"])
            _check_length(ep_path, ep, row["length"])
            tasks = row.get("tasks") or []
            if isinstance(tasks, str):
                tasks = [tasks]
            if not (isinstance(tasks, list) and len(tasks) <= MAX_TASKS_PER_EPISODE
                    and all(isinstance(t, str) and len(t) <= MAX_TASK_CHARS for t in tasks)):
                raise DataError(f"{ep_path}:{n}: tasks must be a list of at most {MAX_TASKS_PER_EPISODE} strings of at "
                                f"most {MAX_TASK_CHARS} characters, got {bounded_repr(row.get('tasks'), 60)}")
            chunk = ep // self.chunks_size
            fmt = dict(episode_chunk=chunk, episode_index=ep, chunk_index=chunk)
            try:
                data_file = self.data_path.format(**fmt)
                videos = {k: self.video_path.format(video_key=k, **fmt) for k in self._mp4_keys}
            except (KeyError, IndexError, ValueError) as e:
                raise DataError(f"{self.root / INFO_PATH}: cannot format data_path/video_path: {e}") from e
            rows[ep] = (int(row["length"]), tuple(str(t) for t in tasks),
                        _EpisodeLoc(data_file, videos, {k: 0.0 for k in self._mp4_keys}))
        self.episodes = EpisodeIndex.from_rows(rows, self._mp4_keys)

    def _load_v3(self) -> None:
        pa, _ = _pa()
        import pyarrow.compute as pc

        tasks_path = self.meta_file(V3_TASKS_PATH)
        if _num_rows(tasks_path) > MAX_TASKS:
            raise DataError(f"{tasks_path}: {_num_rows(tasks_path)} tasks; at most {MAX_TASKS} are read")
        check_column_sizes(tasks_path)
        table = read_parquet(tasks_path)
        names = table.column_names
        if "task_index" not in names:
            raise DataError(f"{tasks_path}: no 'task_index' column; it has {names}")
        text_col = next(
            (c for c in ("task", "__index_level_0__") if c in names),
            next((c for c in names if c != "task_index" and pa.types.is_string(table.schema.field(c).type)), None),
        )
        if text_col is None:
            raise DataError(f"{tasks_path}: no task text column (want 'task' or the pandas index); has {names}")
        _check_task_texts(tasks_path, table.column(text_col))
        self.tasks = {
            int(i): str(t)
            for i, t in zip(table.column("task_index").to_pylist(), table.column(text_col).to_pylist(), strict=True)
        }

        ep_dir = self.root / V3_EPISODES_DIR
        files = sorted(ep_dir.glob("chunk-*/*.parquet")) if ep_dir.is_dir() else []
        if not files:
            raise DataError(f"{ep_dir}: no episode parquet files (meta/episodes/chunk-*/file-*.parquet)")
        files = [self.meta_file(str(f.relative_to(self.root))) for f in files]
        total = 0
        for f in files:  # footers only: the number of episodes is bounded before any column is read
            total += _num_rows(f)
            if total > MAX_EPISODES:
                raise DataError(f"{ep_dir}: more than {MAX_EPISODES} episodes (at {f}); at most {MAX_EPISODES} are read")
        need = ["episode_index", "length", "data/chunk_index", "data/file_index"]
        for k in self._mp4_keys:
            need += [f"videos/{k}/chunk_index", f"videos/{k}/file_index", f"videos/{k}/from_timestamp"]
        task_texts = 0

        strings = _Strings()
        parts: dict[str, list] = {"index": [], "length": [], "ptr": [], "tasks": [], "data": []}
        video = {k: [] for k in self._mp4_keys}
        start_ts = {k: [] for k in self._mp4_keys}

        def paths(chunks, file_ids, fmt) -> np.ndarray:  # each distinct (chunk, file) formatted once
            pairs = np.stack([chunks.astype(np.int64), file_ids.astype(np.int64)], axis=1)
            distinct, inverse = np.unique(pairs, axis=0, return_inverse=True)
            try:
                ids = np.array([strings.add(fmt(int(c), int(i))) for c, i in distinct], dtype=np.int32)
            except (KeyError, IndexError, ValueError) as e:
                raise DataError(f"{self.root / INFO_PATH}: cannot format data_path/video_path: {e}") from e
            return ids[inverse.reshape(-1)]

        for f in files:
            names = read_parquet_schema(f).names  # LeRobot's table also holds per-episode stats: not read
            missing = [c for c in need if c not in names]
            if missing:
                raise DataError(f"{f}: episode table lacks column(s) {missing}")
            check_column_sizes(f, need + (["tasks"] if "tasks" in names else []))
            if "tasks" in names and _leaf_values(f, "tasks") > MAX_TASKS:
                raise DataError(f"{f}: tasks: {_leaf_values(f, 'tasks')} task texts; at most {MAX_TASKS} in all")
            t = read_parquet(f, columns=need + (["tasks"] if "tasks" in names else []))
            col = {c: _column_to_numpy(t.column(c), f"{f}: {c}") for c in need}
            _check_indices(f, col, [c for c in need if c.endswith(("episode_index", "chunk_index", "file_index"))])
            for value, ep in _bad_lengths(col["length"], col["episode_index"]):
                _check_length(f, ep, value)
            parts["index"].append(col["episode_index"].astype(np.int64))
            parts["length"].append(col["length"].astype(np.int64))
            counts, ids = np.zeros(t.num_rows, dtype=np.int64), np.zeros(0, dtype=np.int32)
            if "tasks" in names:
                texts = t.column("tasks")
                if pa.types.is_list(texts.type) or pa.types.is_large_list(texts.type):
                    counts = np.asarray(pc.fill_null(pc.list_value_length(texts), 0), dtype=np.int64)
                    task_texts += int(counts.sum())
                    if counts.size and int(counts.max()) > MAX_TASKS_PER_EPISODE or task_texts > MAX_TASKS:
                        raise DataError(f"{f}: tasks: an episode lists at most {MAX_TASKS_PER_EPISODE} task texts and "
                                        f"the table at most {MAX_TASKS} in all (one lists {int(counts.max())})")
                    flat_texts = pc.list_flatten(texts)
                    _check_task_texts(f, flat_texts)
                    flat = flat_texts.to_pylist()
                else:  # one task text per row (or null)
                    _check_task_texts(f, texts)
                    flat = [x for x in texts.to_pylist() if x is not None]
                    counts = np.asarray(pc.is_valid(texts), dtype=np.int64)
                distinct = {x: strings.add(str(x)) for x in set(flat)}
                ids = np.fromiter((distinct[x] for x in flat), dtype=np.int32, count=len(flat))
            parts["ptr"].append(counts)
            parts["tasks"].append(ids)
            parts["data"].append(paths(col["data/chunk_index"], col["data/file_index"],
                                       lambda c, i: self.data_path.format(chunk_index=c, file_index=i)))
            for k in self._mp4_keys:
                video[k].append(paths(col[f"videos/{k}/chunk_index"], col[f"videos/{k}/file_index"],
                                      lambda c, i, k=k: self.video_path.format(video_key=k, chunk_index=c,
                                                                               file_index=i)))
                start_ts[k].append(_start_times(f, f"videos/{k}/from_timestamp", col))
        cat = np.concatenate
        self.episodes = EpisodeIndex(cat(parts["index"]), cat(parts["length"]),
                                     cat([[0], np.cumsum(cat(parts["ptr"]))]).astype(np.int64), cat(parts["tasks"]),
                                     cat(parts["data"]), {k: cat(v) for k, v in video.items()},
                                     {k: cat(v) for k, v in start_ts.items()}, strings.values)

    # ---------------------------------------------------------------- pickling (DataLoader workers)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = None
        state["_rows"] = {}
        state["_rg_starts"] = {}
        state["_rg_cache"] = OrderedDict()
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._cache = _ColumnCache()

    # ---------------------------------------------------------------- paths

    def _position(self, episode: int) -> int:
        """Where `episode` sits in the episode table; a DataError if it is not in it."""
        position = self.episodes.position(int(episode))
        if position is None:
            raise DataError(f"{self.root}: no episode {episode} (have {len(self.episodes)} episodes)")
        return position

    def _video_position(self, episode: int, key: str) -> int:
        position = self._position(episode)
        if key not in self._mp4_keys:
            raise DataError(f"{self.root}: {key!r} is not a video feature (videos: {self._mp4_keys})")
        return position

    def episode(self, episode: int) -> Episode:
        return self.episodes[self._position(episode)]

    def data_file(self, episode: int) -> Path:
        return self.root / self.episodes.strings[self.episodes.data_file[self._position(episode)]]

    def video_file(self, episode: int, key: str) -> Path:
        return self.root / self.episodes.strings[self.episodes.video_file[key][self._video_position(episode, key)]]

    def from_timestamp(self, episode: int, key: str) -> float:
        return float(self.episodes.from_timestamp[key][self._video_position(episode, key)])

    def has_file(self, path: Path) -> bool:
        """Whether a file of the dataset exists: on disk, or in the remote dataset (not yet fetched, maybe)."""
        return self.remote.exists(self.remote.rel(path)) if self.remote is not None else path.is_file()

    def local(self, path: Path) -> Path:
        """`path`, fetched into the cache first for a remote dataset (what every read of a file goes through)."""
        return self.remote.fetch(self.remote.rel(path)) if self.remote is not None else path

    def iter_data_files(self) -> Iterator[Path]:
        """Every data parquet of the dataset (each once, sorted)."""
        for rel in sorted({self.episodes.strings[i] for i in np.unique(self.episodes.data_file)}):
            yield self.root / rel

    def missing_video_files(self, keys=None) -> list[tuple[int, Path]]:
        """(episode, path) of every video file the episode table promises that the dataset lacks: of every video
        feature, or of those among `keys` (image features have no files)."""
        mp4_keys = self._mp4_keys if keys is None else [k for k in keys if k in self._mp4_keys]
        return [(ep.index, path) for ep in self.episodes for key in mp4_keys
                if not self.has_file(path := self.video_file(ep.index, key))]

    def check(self, allow_missing_videos: bool = False) -> None:
        """Raise DataError if a file that info.json / the episode table promises is missing (video files excepted
        with allow_missing_videos: training's skip_missing skips their episodes), or, for a local dataset, a
        declared episode length differs from the data parquet's rows."""
        problems: list[str] = []
        missing: list[str] = []
        ids = [self.episodes.data_file, *([] if allow_missing_videos else self.episodes.video_file.values())]
        flat = np.concatenate([np.asarray(v, dtype=np.int64).ravel() for v in ids])
        _, order = np.unique(flat, return_index=True)
        for i in flat[np.sort(order)].tolist():  # each file once, in the order the episode table names them
            rel = self.episodes.strings[i]
            if not self.has_file(self.root / rel):
                missing.append(rel)
        if not self._lengths_checked and self.remote is None:  # a remote dataset's data files are not fetched here
            lengths = self.length_problems()
            problems += lengths[:5] + ([f"and {len(lengths) - 5} more episode(s) of other lengths"]
                                       if len(lengths) > 5 else [])
        total_eps = self.info.get("total_episodes")
        if total_eps is not None and int(total_eps) != len(self.episodes):
            problems.append(f"info.json total_episodes={_short(str(total_eps), 40)} but the episode table has "
                            f"{len(self.episodes)}")
        total_frames = self.info.get("total_frames")
        n_frames = int(self.episodes.length.sum())
        if total_frames is not None and int(total_frames) != n_frames:
            problems.append(f"info.json total_frames={_short(str(total_frames), 40)} but episode lengths sum to "
                            f"{n_frames}")
        if missing:
            problems.insert(0, _missing_files_report(missing, self.episodes))
        if problems:
            raise DataError(f"{self.root}: " + "; ".join(problems))

    def length_problems(self) -> list[str]:
        """One line per episode whose declared length differs from its rows in its data parquet (files that are
        missing or unreadable are left to `check` and `check.file_problems`). Reads parquet footers (v2.x) or the
        episode_index column (v3.0) of every data file; a remote dataset's files are fetched."""
        table = V3_EPISODES_DIR if self.version == "v3.0" else V2_EPISODES_PATH
        counts: dict[int, dict[int, int] | int | None] = {}  # data file id -> rows (per episode in v3.0)
        problems = []
        for position in range(len(self.episodes)):
            file_id = int(self.episodes.data_file[position])
            if file_id not in counts:
                counts[file_id] = self._file_rows(self.root / self.episodes.strings[file_id])
            rows = counts[file_id]
            if rows is None:
                continue
            episode, declared = int(self.episodes.index[position]), int(self.episodes.length[position])
            actual = rows.get(episode, 0) if isinstance(rows, dict) else rows
            if actual != declared:
                problems.append(f"{self.root / self.episodes.strings[file_id]}: episode {episode} has {actual} rows "
                                f"but {self.root / table} says length {declared}")
        return problems

    def _file_rows(self, path: Path) -> dict[int, int] | int | None:
        """A data file's rows: per episode (v3.0) or in all (v2.x); None when it is missing or unreadable."""
        if not self.has_file(path):
            return None
        try:
            path = self.local(path)
            if self.version != "v3.0":
                return _num_rows(path)
            return _rows_per_episode(path)
        except DataError:
            return None

    def check_lengths(self) -> None:
        """A DataError naming the first episode whose declared length differs from its data parquet's rows (once
        per reader: what a training dataset runs before anything is sized by the lengths)."""
        if self._lengths_checked:
            return
        problems = self.length_problems()
        if problems:
            more = f" (and {len(problems) - 1} more episode(s))" if len(problems) > 1 else ""
            raise DataError(problems[0] + more)
        self._lengths_checked = True

    # ---------------------------------------------------------------- rows

    def _episode_rows(self, episode: int) -> tuple[Path, np.ndarray]:
        """(data file, row indices of ``episode`` in it, ordered by frame_index)."""
        ep = self.episode(episode)
        path = self.local(self.data_file(episode))
        key = (str(path), ep.index)
        rows = self._rows.get(key)
        if rows is None:
            schema = read_parquet_schema(path)
            need = (["episode_index"] if self.version == "v3.0" else []) + (
                ["frame_index"] if "frame_index" in schema.names else []
            )
            if self.version == "v3.0" and "episode_index" not in schema.names:
                raise DataError(f"{path}: no 'episode_index' column (needed to find episode {ep.index})")
            cols = self._cache.columns(path, need) if need else {}
            if self.version == "v3.0":
                rows = np.flatnonzero(_column_to_numpy(cols["episode_index"], f"{path}: episode_index") == ep.index)
            else:
                rows = np.arange(_num_rows(path))
            if "frame_index" in cols:
                fi = _column_to_numpy(cols["frame_index"], f"{path}: frame_index")[rows]
                if fi.size and np.any(np.diff(fi) < 0):
                    rows = rows[np.argsort(fi, kind="stable")]
            if len(rows) != ep.length:
                raise DataError(
                    f"{path}: episode {ep.index} has {len(rows)} rows but the episode table says length {ep.length}"
                )
            if len(self._rows) > 4096:
                self._rows.clear()
            self._rows[key] = rows
        return path, rows

    def read_columns(self, episode: int, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """Whole-episode columns: float features as float32 [T, D] (vectors) or [T] (scalars);
        integer columns (frame_index, task_index, ...) as int64. NaN is a DataError."""
        path, rows = self._episode_rows(episode)
        keys = list(keys)
        for k in keys:
            f = self.features.get(k)
            if f is not None and f.dtype in ("video", "image"):
                raise DataError(f"{path}: {k!r} is a {f.dtype} feature; use read_frames")
        cols = self._cache.columns(path, keys)
        out = {}
        for k in keys:
            where = f"{path}: column {k!r} (episode {episode})"
            arr = _column_to_numpy(cols[k], where)
            arr = arr[rows]
            if np.issubdtype(arr.dtype, np.floating):
                arr = arr.astype(np.float32, copy=False)
                if np.isnan(arr).any():
                    raise DataError(f"{where}: contains NaN")
            elif np.issubdtype(arr.dtype, np.integer):
                arr = arr.astype(np.int64, copy=False)
            f = self.features.get(k)
            if f is not None and f.dtype != "string" and f.shape:
                _check_width(path, k, arr, f, episode)
            out[k] = arr
        return out

    def task_per_frame(self, episode: int) -> list[str]:
        """The task text of each frame of ``episode`` (from its task_index column)."""
        path = self.data_file(episode)
        try:
            ti = self.read_columns(episode, ["task_index"])["task_index"]
        except DataError as e:
            ep = self.episode(episode)
            if "no column" in str(e) and len(ep.tasks) == 1:
                return [ep.tasks[0]] * ep.length
            raise
        out = []
        for i in ti.tolist():
            if i not in self.tasks:
                raise DataError(f"{path}: episode {episode} has task_index {i}, not in the tasks table")
            out.append(self.tasks[i])
        return out

    # ---------------------------------------------------------------- frames

    def read_frames(
        self, episode: int, key: str, frame_indices: Sequence[int], backend: str = "auto", tolerance_s: float | None = None
    ) -> np.ndarray:
        """Frames ``frame_indices`` (episode-relative, any order, duplicates allowed) of camera
        ``key``: uint8 [N, H, W, 3]."""
        ep, f, idx = self._frame_request(episode, key, frame_indices)
        if f.dtype == "video":
            from dzmodel.data.video import DEFAULT_TOLERANCE_S, decode_frames

            path = self.local(self.video_file(episode, key))
            ts = self.from_timestamp(ep.index, key) + idx / self.fps
            tol = DEFAULT_TOLERANCE_S if tolerance_s is None else tolerance_s
            return decode_frames(path, ts.tolist(), backend=backend, tolerance_s=tol)
        return self._read_images(ep.index, key, idx)

    def _frame_request(self, episode: int, key: str, frame_indices: Sequence[int]):
        """(episode, feature, indices as int64) after checking that `key` is a camera and the indices lie in the
        episode."""
        ep = self.episode(episode)
        f = self.features.get(key)
        if f is None or f.dtype not in ("video", "image"):
            raise DataError(f"{self.root}: {key!r} is not a video/image feature (have {self.video_keys})")
        idx = np.asarray(list(frame_indices), dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= ep.length):
            raise DataError(
                f"{self.root}: episode {ep.index} camera {key!r}: frame index out of range [0, {ep.length}): "
                f"{idx[(idx < 0) | (idx >= ep.length)][:5].tolist()}"
            )
        return ep, f, idx

    def video_frames(self, episode: int, key: str, frame_indices: Sequence[int]) -> tuple[str, list[int]]:
        """Where frames ``frame_indices`` (episode-relative) of camera ``key`` are, without decoding them: the local
        video file and the frames' indices in that file (a v3.0 file holds several episodes, from its
        from_timestamp on; the file runs at the dataset's fps). For a decoder elsewhere (`nvdec.NvdecDecoder`)."""
        ep, f, idx = self._frame_request(episode, key, frame_indices)
        if f.dtype != "video":
            raise DataError(f"{self.root}: camera {key!r} is stored as images, not video: train.video_decode: nvdec "
                            "decodes videos only (set train.video_decode: cpu)")
        path = self.local(self.video_file(episode, key))
        first = int(round(self.from_timestamp(ep.index, key) * self.fps))
        return str(path), (first + idx).tolist()

    def _image_cells(self, path: Path, key: str, rows: np.ndarray) -> list:
        """Cells ``rows`` of image column ``key``, reading only the row groups that hold them (image
        columns are large: a whole v3.0 file's column is not cached, a few row groups are)."""
        _, pq = _pa()
        starts = self._rg_starts.get(path)
        if starts is None:
            schema = read_parquet_schema(path)
            if key not in schema.names:
                raise DataError(f"{path}: no column {key!r}; it has {sorted(schema.names)}")
            try:
                md = pq.ParquetFile(path).metadata
            except Exception as e:
                raise DataError(f"{path}: cannot read parquet (truncated or corrupt?): {type(e).__name__}: {e}") from e
            starts = np.concatenate([[0], np.cumsum([md.row_group(i).num_rows for i in range(md.num_row_groups)])])
            self._rg_starts[path] = starts
        rgs = np.searchsorted(starts, rows, side="right") - 1
        out = []
        for rg, row in zip(rgs.tolist(), rows.tolist(), strict=True):
            ck = (str(path), key, rg)
            arr = self._rg_cache.get(ck)
            if arr is None:
                try:
                    arr = pq.ParquetFile(path).read_row_group(rg, columns=[key]).column(key)
                except Exception as e:
                    raise DataError(f"{path}: cannot read row group {rg} of column {key!r}: {type(e).__name__}: {e}") from e
                self._rg_cache[ck] = arr
                while len(self._rg_cache) > _IMAGE_ROW_GROUPS_CACHED:
                    self._rg_cache.popitem(last=False)
            else:
                self._rg_cache.move_to_end(ck)
            out.append(arr[row - int(starts[rg])].as_py())
        return out

    def _image_path(self, path: str, where: str) -> Path:
        """An image cell's file: relative to the dataset and inside it after symlinks (unless allow_outside)."""
        if self.allow_outside:
            return Path(path) if os.path.isabs(path) else self.root / path
        root = os.path.realpath(self.root)
        try:
            resolved = None if os.path.isabs(path) else _resolve_in(str(self.root), path, {})
        except (OSError, ValueError):
            resolved = None
        if resolved is None or os.path.commonpath([root, resolved]) != root:
            raise DataError(f"{where}: image path {_short(repr(path), 100)} is outside the dataset {_short(root)}")
        return Path(resolved)

    def _read_images(self, episode: int, key: str, idx: np.ndarray) -> np.ndarray:
        from dzmodel.data.video import decode_image_bytes

        path, rows = self._episode_rows(episode)
        uniq, inv = np.unique(idx, return_inverse=True)
        cells = self._image_cells(path, key, rows[uniq])
        images = []
        for i, cell in zip(uniq.tolist(), cells, strict=True):
            where = f"{path}: column {key!r} episode {episode} frame {i}"
            if isinstance(cell, dict):
                data = cell.get("bytes")
                if data is None and cell.get("path"):
                    p = self._image_path(str(cell["path"]), where)
                    if not p.is_file():
                        raise DataError(f"{where}: image has no bytes and its path {p} is missing")
                    data = p.read_bytes()
            elif isinstance(cell, bytes | bytearray):
                data = bytes(cell)
            else:
                data = None
            if not data:
                raise DataError(f"{where}: no image bytes")
            images.append(decode_image_bytes(data, where))
        shapes = {im.shape for im in images}
        if len(shapes) > 1:
            raise DataError(f"{path}: column {key!r} episode {episode}: images of different shapes {sorted(shapes)}")
        if not images:
            return np.zeros((0, 0, 0, 3), dtype=np.uint8)
        return np.stack(images)[inv]


def open_dataset(root: str | Path, allow_outside: bool = False) -> LeRobotReader:
    """Open the LeRobot dataset at ``root`` (v2.0, v2.1 or v3.0); DataError naming the path if not. Its files must
    resolve inside ``root`` unless ``allow_outside``."""
    return LeRobotReader(root, allow_outside=allow_outside)


def crosscheck_with_lerobot(reader: "LeRobotReader") -> str:
    """Read a v3.0 dataset's metadata with lerobot 0.4.4's own code and compare it with ours.

    Returns a one-line verdict; raises DataError where the two disagree. When lerobot cannot be
    imported (e.g. on the GPU image), says so and checks nothing."""
    from .lerobot_compat import import_lerobot_dataset

    try:
        LeRobotDatasetMetadata, _ = import_lerobot_dataset()
    except ImportError as exc:
        return f"lerobot cross-check skipped: {exc}"
    stats = reader.meta_file(STATS_PATH)  # lerobot reads it: inside the dataset, a regular file, valid JSON
    if stats.exists():
        load_json(stats)
    try:
        meta = LeRobotDatasetMetadata("local/dataset", root=reader.root)
    except (Exception, RecursionError) as exc:  # lerobot's own reader refuses the dataset
        raise DataError(f"{reader.root}: lerobot 0.4.4 cannot read this dataset's metadata: {type(exc).__name__}: "
                        f"{_short(str(exc), 200)}") from exc
    problems = []
    if meta.total_episodes != len(reader.episodes):
        problems.append(f"episodes: lerobot {meta.total_episodes}, ours {len(reader.episodes)}")
    if float(meta.fps) != float(reader.fps):
        problems.append(f"fps: lerobot {meta.fps}, ours {reader.fps}")
    theirs = {"index": np.asarray(meta.episodes["episode_index"], dtype=np.int64),
              "length": np.asarray(meta.episodes["length"], dtype=np.int64)}  # whole columns: one read each
    order = np.argsort(theirs["index"], kind="stable")
    if not np.array_equal(theirs["index"][order], reader.episodes.index):
        problems.append("episode indices differ")
    else:
        for i in np.flatnonzero(theirs["length"][order] != reader.episodes.length)[:5].tolist():
            problems.append(f"episode {int(reader.episodes.index[i])} length: lerobot {int(theirs['length'][order][i])}, "
                            f"ours {int(reader.episodes.length[i])}")
    if set(meta.video_keys) - set(reader.video_keys):
        problems.append(f"video keys: lerobot {sorted(meta.video_keys)}, ours {sorted(reader.video_keys)}")
    if problems:
        raise DataError(f"{reader.root}: lerobot 0.4.4 reads this dataset differently: " + "; ".join(problems[:5]))
    return (f"lerobot 0.4.4 agrees: {meta.total_episodes} episodes, {meta.total_frames} frames, "
            f"fps {meta.fps}, videos {sorted(meta.video_keys)}")
