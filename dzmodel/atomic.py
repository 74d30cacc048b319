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


def temp_file(path: str | os.PathLike, suffix: str = ".tmp") -> tuple[int, Path]:
    """(an open descriptor, its name): a new empty file beside `path` (same filesystem, so os.replace is atomic)
    with a name no one could have guessed, created with O_EXCL (never a file or a link planted in advance), and
    the mode a plainly created file would have. The caller writes through the descriptor, closes it and renames
    the file over `path`, or unlinks it on failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        os.fchmod(fd, NEW_FILE_MODE)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, Path(tmp)


def temp_sibling(path: str | os.PathLike) -> Path:
    """A new empty temporary file beside `path`, as `temp_file` makes it, closed. The caller writes it, renames it
    over `path`, or unlinks it on failure."""
    fd, tmp = temp_file(path)
    os.close(fd)
    return tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `path` whole: through a new temporary sibling (`temp_file`), fsynced, then renamed over it. A link
    at `path` is replaced, never written through."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


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


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """A matplotlib figure as a PNG, renamed into place whole (a reader never sees half an image), written
    through a new temporary sibling (`temp_file`), never through a file or link already there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fd, tmp = temp_file(path, suffix=".tmp.png")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=dpi)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A hard link of `src` at `dst` (its folder made), or a copy where no link can be made."""
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
