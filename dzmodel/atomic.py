"""Atomic file writes: a temporary sibling, fsynced, then renamed over the target.

A crash leaves either the old file or the new one, never a torn one, and no temporary behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def _read_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; done once, at import
    os.umask(mask)
    return mask


# What open() and mkdir() would give: mkstemp makes its files 0600 and mkdtemp its directories 0700, which would
# hide every output from the user's group once renamed into place.
_UMASK = _read_umask()
NEW_FILE_MODE = 0o666 & ~_UMASK
NEW_DIR_MODE = 0o777 & ~_UMASK


def temp_sibling(path: str | os.PathLike) -> Path:
    """A new empty temporary file beside `path` (same filesystem, so os.replace is atomic), with the mode a
    plainly created file would have. The caller writes it, renames it over `path`, or unlinks it on failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, NEW_FILE_MODE)
    finally:
        os.close(fd)
    return Path(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(tmp: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Rename a finished directory `tmp` to `dest`. An existing `dest` is moved aside first and removed only
    after the new one is in place, so `dest` is always absent, the old tree or the new one, never a mix."""
    tmp, dest = Path(tmp), Path(dest)
    if not dest.exists():
        os.replace(tmp, dest)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.replace(dest, trash / "old")
    try:
        os.replace(tmp, dest)
    except BaseException:  # the old tree goes back: `dest` is never left absent by a failed swap
        if not dest.exists():
            os.replace(trash / "old", dest)
            trash.rmdir()
        raise
    shutil.rmtree(trash, ignore_errors=True)


def save_figure(fig, path: Path) -> Path:
    """A matplotlib figure as a PNG, renamed into place whole (a reader never sees half an image)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    return path
