"""An exclusive lock on a directory: two processes must not write the same dataset or run at once.

flock on the directory itself leaves no lock file behind, and the kernel drops it when the last process holding
the descriptor exits, even by kill -9, so a crashed run does not block its own resume for long: its forked
children (data-loader workers) hold the descriptor until they notice and exit, within seconds. The lock is advisory
and per machine: on NFS it does not exclude a process on another node."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Callable


class DirectoryBusy(RuntimeError):
    pass


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike, wait: bool = True, what: str = "another process",
                   waiting: Callable[[], None] | None = None):
    """Hold an exclusive flock on `directory` (created if missing). wait=False raises DirectoryBusy at once
    when another process holds it; otherwise `waiting` (if given) is called once before waiting for it.
    A no-op where the platform or filesystem has no flock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            _take(fcntl, fd, wait, waiting)
        except BlockingIOError:
            raise DirectoryBusy(f"{directory}: {what} is writing to this directory; wait for it to finish or stop "
                                "it (under torchrun, stop its worker processes too: they run in their own "
                                "sessions and outlive a killed launcher; a run killed a moment ago lets go within "
                                "seconds, once its data-loader workers have exited)") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)  # now, even where forked children (data-loader workers) share the descriptor
        finally:
            os.close(fd)


def _take(fcntl, fd: int, wait: bool, waiting: Callable[[], None] | None) -> None:
    """flock(fd) exclusively; BlockingIOError if it is held elsewhere and wait is False."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        if not wait:
            raise
    if waiting is not None:
        waiting()
    fcntl.flock(fd, fcntl.LOCK_EX)
