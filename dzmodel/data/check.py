"""Verify the files a LeRobot dataset promises before anything trains on them.

`verify_files` (what training runs before its first step, cheap): every data parquet's footer opens (a truncated
download fails here, not mid-run or never), every video file is a video container by its magic bytes, and a git-LFS
pointer checked in instead of the video is named as such. `deep_check` (`dz data check --deep`) adds each video's
header: its frame count and duration against what info.json and the episode table promise.
"""

from __future__ import annotations

from pathlib import Path

from .errors import DataError

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
    """Footer and container problems of the files that exist (missing ones are `reader.check`'s)."""
    problems = [p for f in reader.iter_data_files() if f.is_file() and (p := _parquet_problem(f))]
    problems += [p for f, _ in _video_files(reader) if f.is_file() and (p := _container_problem(f))]
    return problems


def raise_problems(reader, problems: list[str], shown: int | None = 10) -> None:
    """One DataError listing the problems (the first `shown`; None: all), or nothing when there are none."""
    if problems:
        more = f"\n  ... and {len(problems) - shown} more" if shown is not None and len(problems) > shown else ""
        raise DataError(f"{reader.root}: {len(problems)} file(s) cannot be used:\n  "
                        + "\n  ".join(problems[:shown]) + more)


def verify_files(reader) -> None:
    """One DataError listing every data or video file that would fail training (see the module docstring)."""
    raise_problems(reader, file_problems(reader))


def deep_check(reader) -> list[str]:
    """`file_problems` plus every video header against the episodes it should hold: enough frames and duration."""
    from .video import video_info

    problems = file_problems(reader)
    bad = {p.split(":")[0] for p in problems}
    fps = float(reader.fps)
    for path, held in _video_files(reader):
        if not path.is_file() or str(path) in bad:
            continue
        try:
            info = video_info(path)
        except DataError as exc:
            problems.append(str(exc))
            continue
        end_s = max(reader.from_timestamp(ep.index, key) + ep.length / fps for ep, key in held)
        frames_needed = round(end_s * fps)
        if info["num_frames"] and info["num_frames"] < frames_needed:
            problems.append(f"{path}: {info['num_frames']} frames, the episode table needs {frames_needed}")
        elif info["duration_s"] is not None and info["duration_s"] + 1.5 / fps < end_s:
            problems.append(f"{path}: {info['duration_s']:.2f} s long, the episode table needs {end_s:.2f} s")
        if info["fps"] and abs(info["fps"] - fps) > 0.01 * fps:
            problems.append(f"{path}: {info['fps']:g} fps, info.json says {fps:g}")
    return problems
