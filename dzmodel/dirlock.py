"""An exclusive lock on a directory: two processes must not write the same dataset or run at once.

flock on the directory itself leaves no lock file behind, and the kernel drops it when its holder dies, even
by kill -9, so a crashed run never blocks its own resume."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path


class DirectoryBusy(RuntimeError):
    pass


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike, wait: bool = True, what: str = "another process"):
    """Hold an exclusive flock on `directory` (created if missing). wait=False raises DirectoryBusy at once
    when another process holds it. A no-op where the platform or filesystem has no flock."""
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
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise DirectoryBusy(f"{directory}: {what} is writing to this directory; wait for it to finish or stop "
                                "it (under torchrun, stop its worker processes too: they run in their own "
                                "sessions and outlive a killed launcher)") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
