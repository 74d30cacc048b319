"""Fetch a LeRobot dataset into ``dest_root/<name>``: from the Hugging Face hub (pinned revision),
a local directory, the synthetic generator, or LIBERO demonstrations recorded by the scripted expert.

The dataset is built in a temporary sibling directory, verified (``open_dataset(tmp).check()``:
info.json valid, every promised data/video file present) and renamed into place, so
``dest_root/<name>`` is either absent or complete. A marker ``dest_root/<name>.dz_fetch.json``
(next to the dataset, not inside it) records the source; a second call with the same source,
revision, allow_patterns, synth_kwargs and record_kwargs returns the existing copy without fetching again.
huggingface_hub is imported lazily.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

from dzmodel.atomic import atomic_write_text, link_or_copy
from dzmodel.dirlock import directory_lock
from dzmodel.outputs import check_output_dir
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import file_kind_problem

MARKER_SUFFIX = ".dz_fetch.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


def marker_path(dest: Path) -> Path:
    """The marker of dataset directory ``dest``: ``<dest>.dz_fetch.json`` beside it."""
    return dest.with_name(dest.name + MARKER_SUFFIX)


def _source_kind(source: str) -> str:
    if source in ("synthetic", "libero"):
        return source
    if Path(source).expanduser().exists():
        return "local"
    if _REPO_ID.match(source) and not source.startswith((".", "/", "~")):
        return "hub"
    raise DataError(
        f"source: {source!r} is neither an existing local directory, a Hugging Face dataset repo id "
        "('owner/name'), nor 'synthetic' or 'libero'"
    )


def _verify(path: Path, full: bool, skip_missing: bool = False) -> None:
    from dzmodel.data.lerobot_format import open_dataset

    reader = open_dataset(path)
    if full:
        reader.check(allow_missing_videos=skip_missing)


def _matches(rel: str, patterns: list[str] | None) -> bool:
    """huggingface_hub's allow_patterns semantics: fnmatch on the relative path; 'dir/' means 'dir/*'."""
    if patterns is None:
        return True
    pats = [p + "*" if p.endswith("/") else p for p in patterns]
    return any(fnmatch.fnmatch(rel, p) for p in pats)


def _local_files(src: Path, allow_patterns: list[str] | None) -> list[tuple[Path, str]]:
    """(path, relative path) of every file of `src` to copy; anything but a regular file (after symlinks) is a
    DataError naming it, before anything is copied: a FIFO blocks a copy forever and a link to /dev/zero fills the
    disk."""
    files = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d != ".cache")
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            rel = p.relative_to(src).as_posix()
            if _matches(rel, allow_patterns):
                problem = file_kind_problem(p)
                if problem:
                    raise DataError(f"source: {p}: {problem}; a dataset folder holds regular files only")
                files.append((p, rel))
    return files


def _copy_local(src: Path, tmp: Path, allow_patterns: list[str] | None) -> None:
    if not src.is_dir():
        raise DataError(f"source: {src} is not a directory")
    files = _local_files(src, allow_patterns)
    if not files:
        raise DataError(f"source: {src}: no files match allow_patterns={allow_patterns}")
    tmp.mkdir(parents=True)
    for p, rel in files:
        link_or_copy(p, tmp / rel)


# hub errors that are answers, not hiccups: retrying cannot change them
_PERMANENT = ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError", "EntryNotFoundError",
              "OfflineModeIsEnabled", "LocalEntryNotFoundError", "DisabledRepoError")


def is_transient(exc: BaseException) -> bool:
    """Network trouble, timeouts, HTTP 429 and 5xx: worth another try. Not-found, auth, offline mode and bad
    data fail the same way every time."""
    if isinstance(exc, DataError) or any(c.__name__ in _PERMANENT for c in type(exc).__mro__):
        return False
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int):
        return status == 429 or status >= 500
    return isinstance(exc, (ConnectionError, TimeoutError, OSError)) and not isinstance(exc, FileNotFoundError)


def _download_hub(repo_id: str, revision: str, tmp: Path, allow_patterns: list[str] | None,
                  retries: int = 3, retry_delay_s: float = 10.0) -> None:
    try:
        import huggingface_hub
    except ImportError as e:
        raise DataError(f"source: {repo_id!r} is a hub id but huggingface_hub is not installed ({e})") from e
    try:
        for attempt in range(retries + 1):
            try:
                huggingface_hub.snapshot_download(repo_id, repo_type="dataset", revision=revision,
                                                  allow_patterns=allow_patterns, local_dir=str(tmp))
                break
            except Exception as e:
                if attempt == retries or not is_transient(e):
                    raise
                delay = retry_delay_s * 2 ** attempt  # exponential backoff; the download resumes in local_dir
                print(f"fetch: {repo_id}: {type(e).__name__}: {e}; retry {attempt + 1}/{retries} in {delay:g} s")
                time.sleep(delay)
    except DataError:
        raise
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        hint = ""
        if offline or type(e).__name__ in ("OfflineModeIsEnabled", "LocalEntryNotFoundError"):
            hint = (
                " (offline: HF_HUB_OFFLINE is set or the hub is unreachable; unset HF_HUB_OFFLINE / "
                "check the network, or fetch from a local copy)"
            )
        elif type(e).__name__ in ("RepositoryNotFoundError", "GatedRepoError"):
            hint = " (check the repo id and that your token can read it)"
        elif type(e).__name__ == "RevisionNotFoundError":
            hint = " (check the revision: a commit sha, tag or branch of the dataset repo)"
        raise DataError(
            f"source: cannot download dataset {repo_id!r} at revision {revision!r}: {type(e).__name__}: {e}{hint}"
        ) from e
    cache = tmp / ".cache"  # huggingface_hub's download bookkeeping inside local_dir
    if cache.is_dir():
        shutil.rmtree(cache, ignore_errors=True)


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def fetch_dataset(
    source: str,
    dest_root: str | Path,
    revision: str | None = None,
    allow_patterns: list[str] | None = None,
    synth_kwargs: dict | None = None,
    name: str | None = None,
    verify_files: bool = True,
    record_kwargs: dict | None = None,
    retries: int = 3,
    retry_delay_s: float = 10.0,
    skip_missing: bool = False,
    recorder: Callable[[dict, Path], None] | None = None,
) -> Path:
    """Fetch ``source`` into ``dest_root/<name>`` and return that path.

    ``source``: a hub dataset repo id (``revision`` required: a commit sha, tag or branch), a
    local dataset directory (hardlinked where possible, else copied), or ``"synthetic"``
    (``dzmodel.data.synth.make_synthetic_dataset(out_dir, **synth_kwargs)``), or ``"libero"``
    (``recorder(record_kwargs, out_dir)``: the caller's LIBERO recorder, which lives above the data layer, e.g.
    ``dzmodel.eval.libero_record.record_into``). ``name`` defaults
    to the repo/directory basename, or "synthetic". ``allow_patterns`` filters files (hub
    semantics) for hub and local sources. ``verify_files=False`` only checks that info.json and
    the episode table open (for deliberately partial downloads, e.g. meta/ only). Hub downloads retry transient
    errors (`is_transient`) up to ``retries`` times, waiting ``retry_delay_s`` · 2^attempt. ``skip_missing``
    accepts a dataset whose source lacks some video files (training skips their episodes with the same flag).
    """
    dest_root = Path(dest_root).expanduser()
    kind = _source_kind(source)
    _check_fetch_arguments(source, kind, revision, synth_kwargs, record_kwargs, recorder)
    if isinstance(allow_patterns, str):
        allow_patterns = [allow_patterns]
    allow_patterns = None if allow_patterns is None else [str(p) for p in allow_patterns]
    if kind == "local":
        resolved = str(Path(source).expanduser().resolve())
        default_name = Path(resolved).name
    elif kind == "hub":
        resolved, default_name = source, source.split("/")[-1]
    else:
        resolved = default_name = kind
    name = name or default_name
    if not _NAME.match(name):
        raise DataError(f"name: {name!r} is not a usable directory name")
    dest = dest_root / name
    marker = marker_path(dest)
    record = {
        "kind": kind,
        "source": resolved,
        "revision": revision if kind == "hub" else None,
        "allow_patterns": allow_patterns,
        "synth_kwargs": json.loads(json.dumps(synth_kwargs or {}, sort_keys=True, default=str)) if kind == "synthetic" else None,
    }
    if kind == "libero":  # only then: markers of the other kinds keep their exact old content
        record["record_kwargs"] = json.loads(json.dumps(record_kwargs or {}, sort_keys=True, default=str))
    if kind == "local" and dest.resolve() == Path(resolved):
        raise DataError(f"dest_root: {dest} is the source directory itself")

    check_output_dir(dest, flag="dest")  # a file in the way (foreign directories: the fetch marker, below)
    dest_root.mkdir(parents=True, exist_ok=True)
    with directory_lock(dest_root):
        if dest.exists() and _fetched_already(dest, marker, record, verify_files, skip_missing):
            return dest
        tmp = dest_root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            if kind == "hub":
                _download_hub(source, revision, tmp, allow_patterns, retries, retry_delay_s)
            elif kind == "local":
                _copy_local(Path(resolved), tmp, allow_patterns)
            elif kind == "libero":
                recorder(record_kwargs or {}, tmp)
            else:
                from dzmodel.data.synth import make_synthetic_dataset  # lazy: another module's job

                out = make_synthetic_dataset(tmp, **(synth_kwargs or {}))
                if out is not None and Path(out).resolve() != tmp.resolve():
                    raise DataError(f"synthetic: make_synthetic_dataset wrote to {out}, not {tmp}")
            try:
                _verify(tmp, verify_files, skip_missing)
            except DataError as e:
                raise DataError(f"fetched dataset from {source!r} failed verification: {e}".replace(str(tmp), str(dest))) from e
            _swap_into_place(tmp, dest, marker, record)
            return dest
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _check_fetch_arguments(source: str, kind: str, revision, synth_kwargs, record_kwargs, recorder) -> None:
    if kind == "hub" and not revision:
        raise DataError(
            f"revision: fetching hub dataset {source!r} needs a pinned revision (commit sha or tag), got none"
        )
    if kind != "synthetic" and synth_kwargs:
        raise DataError(f"synth_kwargs: only used with source 'synthetic', not {source!r}")
    if kind != "libero" and record_kwargs:
        raise DataError(f"record_kwargs: only used with source 'libero', not {source!r}")
    if kind == "libero" and recorder is None:
        raise DataError("source 'libero' is recorded, not downloaded: give a recorder (the fetch stage and "
                        "`dz data fetch libero` do), or run `dz data record libero`")


def _fetched_already(dest: Path, marker: Path, record: dict, verify_files: bool, skip_missing: bool) -> bool:
    """True when `dest` holds an intact fetch of `record`; False when it must be fetched again (another record, or
    damaged). A directory fetch did not write, or one of another source, is an error: it is never replaced."""
    old = _read_marker(marker)
    if old is None:
        raise DataError(
            f"{dest}: exists but has no fetch marker {marker.name} (not written by fetch_dataset); "
            "remove it or choose another name/dest_root"
        )
    if old.get("source") != record["source"] or old.get("kind") != record["kind"]:
        raise DataError(
            f"{dest}: holds {old.get('kind')} source {old.get('source')!r}, not {record['source']!r}; "
            "pass another name= or dest_root, or remove it"
        )
    if {k: old.get(k) for k in record} != record:
        return False
    try:
        _verify(dest, verify_files, skip_missing)
        return True
    except DataError:
        return False  # damaged copy: fetch again


def _swap_into_place(tmp: Path, dest: Path, marker: Path, record: dict) -> None:
    """Replace `dest` (a fetch of ours, or nothing) by the verified `tmp`, then write the marker that says it is
    complete (the old marker goes first: a dest without one is never trusted as complete)."""
    marker.unlink(missing_ok=True)
    trash = None
    if dest.exists():
        trash = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dest, trash)
    os.replace(tmp, dest)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    atomic_write_text(marker, json.dumps({**record, "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                         indent=2, sort_keys=True, default=str))
