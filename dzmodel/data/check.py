"""Verify the files a LeRobot dataset promises before anything trains on them.

`verify_files` (what training runs before its first step, cheap): every data parquet's footer opens (a truncated
download fails here, not mid-run or never), every video file is a video container by its magic bytes, and a git-LFS
pointer checked in instead of the video is named as such.

`dz data check` opens the dataset (the reader checks the meta/info.json fields it parses: a hostile value is one
DataError naming the file and field, `lerobot_format.info_problems`; its path templates place every file inside the
dataset; each declared episode length matches the data parquet's rows), then reports `dataset_problems`: the above,
episode indices 0..N-1 as LeRobot numbers them, every numeric column as wide as info.json declares, and no NaN or
infinity in any float column that info.json declares (one line per file, episode and column); a column
too large to read (its size once read, from the footer) is refused by name. `deep_check` (`--deep`) adds the videos: every frame of every file is decoded with FFmpeg's
strict error detection (damage in the middle of a stream stops the decode; the file and frame are named), the decoded
frame count against the episode table, and the frame rate against info.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from .errors import DataError
from .lerobot_format import check_column_sizes

LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"


def _container_problem(path: Path) -> str | None:
    """None for an mp4/mov or Matroska/WebM container; else what the file is instead."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(LFS_POINTER):
        return f"{path}: a git-LFS pointer, not the video (fetch the LFS objects: `git lfs pull`)"
    if len(head) >= 8 and head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        return None
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return None
    return f"{path}: not a video container (first bytes {head[:12]!r}; {path.stat().st_size} bytes)"


def _parquet_problem(path: Path) -> str | None:
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        if f.read(len(LFS_POINTER)) == LFS_POINTER:
            return f"{path}: a git-LFS pointer, not the parquet file (fetch the LFS objects: `git lfs pull`)"
    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # truncated, or not parquet at all
        return f"{path}: cannot read the parquet footer ({type(exc).__name__}: {exc}); a truncated download?"
    return None if rows > 0 else f"{path}: parquet file has no rows"


def _video_files(reader) -> list[tuple[Path, list]]:
    """Each video file once, with the (episode, key) pairs it holds."""
    files: dict[Path, list] = {}
    for ep in reader.episodes:
        for key in reader.video_keys:
            try:
                files.setdefault(reader.video_file(ep.index, key), []).append((ep, key))
            except DataError:
                continue  # image-in-parquet features have no file
    return sorted(files.items())


def file_problems(reader) -> list[str]:
    """Footer and container problems of the files that exist (missing ones are `reader.check`'s). A remote
    dataset's files are fetched through its cache, one at a time."""
    problems = [p for f in reader.iter_data_files() if reader.has_file(f) and (p := _parquet_problem(reader.local(f)))]
    problems += [p for f, _ in _video_files(reader)
                 if reader.has_file(f) and (p := _container_problem(reader.local(f)))]
    return problems


def episode_index_problems(reader) -> list[str]:
    """LeRobot numbers a dataset's N episodes 0..N-1 (its own reader indexes the episode table by them)."""
    count = len(reader.episodes)
    index = reader.episodes.index
    outside = index[(index < 0) | (index >= count)].tolist()
    if not outside:
        return []
    more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
    return [f"{reader.root}: episode index {outside[0]}{more} is outside 0..{count - 1}: LeRobot numbers the "
            f"dataset's {count} episodes 0..{count - 1} in its episode table"]


def _is_float_type(tp) -> bool:
    """A float type, or a (nested) list of one."""
    import pyarrow as pa

    while pa.types.is_list(tp) or pa.types.is_large_list(tp) or pa.types.is_fixed_size_list(tp):
        tp = tp.value_type
    return pa.types.is_floating(tp)


class FloatColumn(NamedTuple):
    values: np.ndarray  # every value, float64 (a null reads as NaN)
    rows: np.ndarray    # the row of each value (a row's values are contiguous)
    nulls: np.ndarray   # which values are null
    lists: bool         # rows are lists (vectors), not single numbers


def _float_column(column) -> FloatColumn:
    import pyarrow as pa
    import pyarrow.compute as pc

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows, lists = np.arange(len(array)), False
    while not pa.types.is_floating(array.type):
        rows = rows[np.asarray(pc.list_parent_indices(array))]
        array, lists = pc.list_flatten(array), True
    values = np.asarray(array.to_numpy(zero_copy_only=False), dtype=np.float64)
    return FloatColumn(values, rows, np.asarray(array.is_null(), dtype=bool), lists)


def value_problems(reader) -> list[str]:
    """One line per (data file, episode, float column) holding a NaN, an infinity or a null, with the first one."""
    import pyarrow.parquet as pq

    files, first = np.unique(reader.episodes.data_file, return_index=True)  # one-episode (v2) files
    episode_of_file = {reader.root / reader.episodes.strings[f]: int(reader.episodes.index[i])
                       for f, i in zip(files.tolist(), first.tolist(), strict=True)}
    problems = []
    for path in reader.iter_data_files():
        if not reader.has_file(path) or _parquet_problem(reader.local(path)):
            continue  # missing or unreadable: named by reader.check and file_problems
        schema = pq.read_schema(path)
        floats = [f.name for f in schema if _is_float_type(f.type) and f.name in reader.features]  # declared only
        if not floats:
            continue
        columns = [*floats, *(c for c in ("episode_index", "frame_index") if c in schema.names)]
        check_column_sizes(path, columns)
        table = pq.read_table(path, columns=columns)
        episodes = (table["episode_index"].to_numpy() if "episode_index" in schema.names
                    else np.full(table.num_rows, episode_of_file.get(path, -1)))
        frames = table["frame_index"].to_numpy() if "frame_index" in schema.names else None
        for name in floats:
            col = _float_column(table[name])
            bad = np.flatnonzero(~np.isfinite(col.values))
            for episode in dict.fromkeys(episodes[col.rows[bad]].tolist()):
                in_episode = bad[episodes[col.rows[bad]] == episode]
                first = int(in_episode[0])
                row = int(col.rows[first])
                dim = first - int(np.searchsorted(col.rows, row))
                value = "null" if col.nulls[first] else col.values[first]
                where = f"frame {int(frames[row])}" if frames is not None else f"row {row}"
                problems.append(f"{path}: episode {episode}, column {name!r}: {value} at {where}"
                                f"{f' (dim {dim})' if col.lists else ''}; {len(in_episode)} non-finite value(s) in "
                                "this episode")
    return problems


NUMERIC_DTYPES = ("float", "int", "uint", "bool")  # info.json dtypes held as numbers (or lists of them)


def _row_widths(column) -> np.ndarray:
    """Values per row of a (nested) list column; 1 per row of a scalar column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n, rows = len(array), np.arange(len(array))
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        rows = rows[np.asarray(pc.list_parent_indices(array))]
        array = pc.list_flatten(array)
    return np.bincount(rows, minlength=n)


def width_problems(reader) -> list[str]:
    """One line per (data file, numeric column) whose rows hold another number of values than info.json's
    features.<column>.shape declares."""
    import pyarrow.parquet as pq

    declared = {k: int(np.prod(f.shape)) for k, f in reader.features.items()
                if f.shape and f.dtype.startswith(NUMERIC_DTYPES)}
    problems = []
    for path in reader.iter_data_files():
        if not reader.has_file(path) or _parquet_problem(reader.local(path)):
            continue  # missing or unreadable: named by reader.check and file_problems
        path = reader.local(path)
        columns = [c for c in pq.read_schema(path).names if c in declared]
        if columns:
            check_column_sizes(path, columns)
        table = pq.read_table(path, columns=columns) if columns else None
        for name in columns:
            widths = _row_widths(table[name])
            bad = np.flatnonzero(widths != declared[name])
            if bad.size:
                problems.append(f"{path}: column {name!r} holds {int(widths[bad[0]])} values per row (row {int(bad[0])}) "
                                f"but meta/info.json declares features.{name}.shape {list(reader.features[name].shape)}")
    return problems


def dataset_problems(reader) -> list[str]:
    """What `dz data check` reports: `file_problems`, episode indices outside 0..N-1, numeric columns of another
    width than info.json declares, and NaN or infinity anywhere in the data files' float columns."""
    return file_problems(reader) + episode_index_problems(reader) + width_problems(reader) + value_problems(reader)


def raise_problems(reader, problems: list[str], shown: int | None = 10) -> None:
    """One DataError listing the problems (the first `shown`; None: all), or nothing when there are none."""
    if problems:
        more = f"\n  ... and {len(problems) - shown} more" if shown is not None and len(problems) > shown else ""
        raise DataError(f"{reader.root}: {len(problems)} problem(s) in its files:\n  "
                        + "\n  ".join(problems[:shown]) + more)


def verify_files(reader) -> None:
    """One DataError listing every data or video file that would fail training (see the module docstring)."""
    raise_problems(reader, file_problems(reader))


def _locate(frame: int, held: list, reader) -> str:
    """'frame 26 (episode 1, frame 6)': a frame of a video file, and the episode frame it is."""
    for ep, key in held:
        start = round(reader.from_timestamp(ep.index, key) * float(reader.fps))
        if start <= frame < start + ep.length:
            return f"frame {frame} (episode {ep.index}, frame {frame - start})"
    return f"frame {frame}"


def deep_check(reader) -> list[str]:
    """`dataset_problems` plus every video decoded frame by frame: the first frame that does not decode, fewer frames
    than the episodes it holds need, a frame rate other than info.json's."""
    from .video import scan_video, video_info

    problems = dataset_problems(reader)
    bad = {p.split(":")[0] for p in problems}
    fps = float(reader.fps)
    for path, held in _video_files(reader):
        if not reader.has_file(path) or str(path) in bad:
            continue
        path = reader.local(path)
        try:
            info = video_info(path)
        except DataError as exc:
            problems.append(str(exc))
            continue
        scan = scan_video(path)
        if scan.error:
            before = f" (frames 0..{scan.frames - 1} do)" if scan.frames else ""
            problems.append(f"{path}: {_locate(scan.frames, held, reader)} does not decode{before}: {scan.error}")
            continue
        end_s = max(reader.from_timestamp(ep.index, key) + ep.length / fps for ep, key in held)
        frames_needed = round(end_s * fps)
        if scan.frames < frames_needed:
            problems.append(f"{path}: {scan.frames} frames decode, the episode table needs {frames_needed}")
        if info["fps"] and abs(info["fps"] - fps) > 0.01 * fps:
            problems.append(f"{path}: {info['fps']:g} fps, info.json says {fps:g}")
    return problems
