"""The project as a fresh clone has it (its tracked files, in a git repository of its own), and commands run in it
with the test's virtual environment first on PATH and no telemetry."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.flows.servers import BIN, QUIET

ROOT = Path(__file__).resolve().parents[1]


def env(**extra) -> dict:
    return dict(os.environ, **QUIET, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra)


def run(cmd: list[str], cwd: Path, **extra) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env(**extra), capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def clone(dest: Path) -> Path:
    """Copy the tracked files to `dest` and commit them there, with an identity of its own (`dvc exp run` commits
    experiments, also where git has no global identity)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@t"], ["git", "config", "user.name", "t"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "clone"]):
        run(cmd, dest)
    return dest
