"""A process and everything it started, found through /proc (Linux).

torchrun starts its workers in their own sessions, so a signal to the launcher's process group misses them:
a killed launcher leaves them training. Killing the tree reaches them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _stat_after_name(stat: Path) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); the name, in parentheses, may
    hold spaces and parentheses itself. Raises OSError or IndexError once the process has gone."""
    return stat.read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, parents before children; [] where there is no /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(_stat_after_name(stat)[1])
        except (OSError, IndexError, ValueError):  # exited meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (exited, not yet reaped) is not alive."""
    try:
        return _stat_after_name(Path(f"/proc/{pid}/stat"))[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(pid: int, timeout: float = 30.0) -> list[int]:
    """SIGKILL `pid` and all its descendants at once (the root is stopped first, so that it neither reacts to
    its children's deaths nor starts new ones), then wait up to `timeout` s until none is alive. Returns the
    pids killed; raises TimeoutError naming the survivors."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return []
    pids = [pid, *descendants(pid)]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while survivors := [p for p in pids if alive(p)]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {survivors} survived SIGKILL for {timeout:g} s")
        time.sleep(0.05)
    return pids
