"""The suite's guard against processes that outlive it: every process a test starts inherits a session mark in
its environment; at the session's end, a marked process still running (a server, a worker's flow run, a training
process its launcher left behind) is listed, killed and fails the session, instead of running on into the next
suite and slowing it down."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from dzmodel.proctree import alive, descendants, kill_tree

MARK = "DZ_TEST_SESSION"
# helpers that live as long as the pytest process and end with it: inductor's compile workers, multiprocessing's
# resource tracker
OWN_HELPERS = ("torch/_inductor/compile_worker", "multiprocessing.resource_tracker")


def mark_session() -> str:
    """Mark this process, and so every process started from it, as this session's (a fresh mark: a pytest run
    inside a test has its own)."""
    os.environ[MARK] = uuid.uuid4().hex
    return os.environ[MARK]


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def leftovers(mark: str, session_pid: int | None = None) -> dict[int, str]:
    """Running processes carrying `mark`, other than the session's own process and its lifelong helpers (with
    what they started): {pid: command line}."""
    session_pid = os.getpid() if session_pid is None else session_pid
    helpers = [p for p in descendants(session_pid) if any(h in _cmdline(p) for h in OWN_HELPERS)]
    own = {session_pid, *helpers, *(c for h in helpers for c in descendants(h))}
    entry = f"{MARK}={mark}".encode()
    pids = (int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat"))
    return {p: _cmdline(p) for p in pids if p not in own and _environ_has(p, entry) and alive(p)}


def end_leftovers(mark: str) -> dict[int, str]:
    """Kill every leftover (with what it started); returns what was running."""
    found = leftovers(mark)
    for pid in found:
        try:
            kill_tree(pid)  # [] for one that has ended meanwhile
        except TimeoutError:
            pass
    return found
