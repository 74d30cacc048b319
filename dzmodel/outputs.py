"""Output directories: a command replaces or writes into only what dz itself made.

Every output directory a command writes carries OWNER_MARKER (`.dz-output`, one line of JSON naming the command
that wrote it). A command takes an existing directory only when it is empty or carries its own command's marker.
Anything else (a user's data, another command's output such as a training run or a releases folder, a file where
a directory should be) is refused with one line that names the path and the flag that overrides it; nothing is
touched. The marker holds no timestamp, so identical outputs stay byte-identical (content fingerprints, DVC).

Two ways to write:
- `publish_dir` (convert, cache, data fetch/record/synth, pipeline stages): the output is built whole in a
  temporary sibling and renamed into place, so a crash or a full disk leaves the old output or the new one.
- `claim_dir` (train, eval): commands that add files as they go (checkpoints, per-step results) and resume; the
  directory is marked when it is claimed, and nothing in it is removed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .atomic import NEW_DIR_MODE, atomic_write_text, replace_dir

OWNER_MARKER = ".dz-output"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class OutputError(ValueError):
    """An output path that must not be written; one line names the path and what to do."""


class NoSpaceError(OutputError):
    """The disk (or quota) filled up while an output was written; the partial output is gone (exit 1, not 2)."""


def owner(path: str | os.PathLike) -> str | None:
    """The command whose marker `path` carries (None: no marker, or one that is not ours to read)."""
    try:
        doc = json.loads((Path(path) / OWNER_MARKER).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return doc.get("command") if isinstance(doc, dict) and isinstance(doc.get("command"), str) else None


def is_ours(path: str | os.PathLike, command: str) -> bool:
    return owner(path) == command


def check_output_dir(path: str | os.PathLike, flag: str = "--out", overwrite: bool = False,
                     override: str = "--overwrite", command: str | None = None) -> Path:
    """`path` if `command` may write it: absent, an empty directory, `command`'s own earlier output, or
    (`overwrite`) any directory. Otherwise OutputError, naming `flag` (the option that set the path) and
    `override`. command None: only the file/directory checks (the caller has its own ownership rule)."""
    path = Path(path)
    for parent in path.parents:  # mkdir would say "File exists" about a path the user never typed
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise OutputError(f"{flag} {path}: {parent} is a file, not a directory")
            break
    if path.is_symlink() and not path.exists():
        raise OutputError(f"{flag} {path}: a dangling symbolic link; remove it or choose another {flag}")
    if path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path}: exists and is a file, not a directory; choose another {flag}")
    if command is None or overwrite or not path.is_dir() or not any(path.iterdir()):
        return path
    found = owner(path)
    if found == command:
        return path
    what = (f"another command's output (dz {found})" if found else
            f"a non-empty directory that dz did not write (no {OWNER_MARKER})")
    advice = (f"Choose another {flag} or pass {override} to replace it" if override else
              "Its place is fixed: move it aside or remove it yourself")
    raise OutputError(f"{flag} {path}: {what}; nothing was changed. {advice}")


def check_output_file(path: str | os.PathLike, ours: Callable[[Path], bool], flag: str = "--out",
                      overwrite: bool = False, what: str = "an earlier output") -> Path:
    """A single-file output: refused if it is a directory, sits under a file, or is an existing file that
    `ours` does not recognise as `what` (unless `overwrite`)."""
    path = Path(path)
    check_output_dir(path.parent, flag)
    if path.is_dir():
        raise OutputError(f"{flag} {path}: is a directory; give {flag} a file path")
    if path.exists() and not overwrite and not ours(path):
        raise OutputError(f"{flag} {path}: exists and is not {what} written by dz; nothing was changed. "
                          f"Choose another {flag} or pass --overwrite to replace it")
    return path


def mark(path: str | os.PathLike, command: str) -> None:
    atomic_write_text(Path(path) / OWNER_MARKER, json.dumps({"command": command}) + "\n")


def claim_dir(path: str | os.PathLike, command: str, flag: str = "--out", overwrite: bool = False,
              override: str = "--overwrite") -> Path:
    """Check `path` (check_output_dir), create it and mark it as `command`'s. Nothing in it is removed."""
    path = check_output_dir(path, flag, overwrite, override, command)
    with no_space_message(path):
        path.mkdir(parents=True, exist_ok=True)
        if not is_ours(path, command):
            mark(path, command)
    return path


def new_temp_dir(beside: Path) -> Path:
    """A fresh directory next to `beside` (same filesystem: renames are atomic), readable as the umask allows."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{beside.name}.", suffix=".tmp", dir=beside.parent))
    os.chmod(tmp, NEW_DIR_MODE)
    return tmp


@contextmanager
def publish_dir(path: str | os.PathLike, command: str, flag: str = "--out", overwrite: bool = False,
                override: str = "--overwrite") -> Iterator[Path]:
    """Yields a temporary sibling of `path` to build the whole output in. On success it is marked and renamed
    over `path` (which is checked before and again just before the rename); on any failure it is removed and
    `path` is left as it was."""
    path = check_output_dir(path, flag, overwrite, override, command)
    with no_space_message(path):
        tmp = new_temp_dir(path)
        try:
            yield tmp
            mark(tmp, command)
            check_output_dir(path, flag, overwrite, override, command)  # something may have appeared meanwhile
            replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextmanager
def no_space_message(path: str | os.PathLike) -> Iterator[None]:
    """A full disk (or quota) while writing `path` as one line instead of a traceback."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        raise NoSpaceError(f"{path}: no space left on the device while writing ({os.strerror(exc.errno)}); "
                          "the partial output was removed and nothing earlier was replaced") from None


def fresh_stage_dir(path: str | os.PathLike, command: str) -> Path:
    """An empty, marked directory at `path` for a pipeline stage; an earlier output is removed only if `command`
    wrote it."""
    path = check_output_dir(path, "stage output", override="", command=command)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    mark(path, command)
    return path
