"""What every stage shares: its log callback, JSON/CSV writers, whole-output publishing, and the outputs'
fingerprints that the pipeline records and the Prefect keys chain on."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..config import Profile, StagePaths
from ..outputs import OWNER_MARKER, fresh_stage_dir, publish_dir


class StageError(RuntimeError):
    """A stage failed for a reason already reported (e.g. torchrun's exit code after its log)."""


Log = Callable[[str], None]


def print_line(line: str) -> None:
    print(line, flush=True)


def write_json(path: Path, data: Any) -> Path:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    atomic_write_text(path, buf.getvalue())
    return path


def fresh_dir(path: Path) -> Path:
    """An empty directory at `path` (a stage's output is rebuilt whole, as DVC does); an earlier one is removed
    only if dz wrote it."""
    return fresh_stage_dir(path, "pipeline")


def stage_output(path: Path):
    """Build a stage's whole output in a temporary sibling, renamed over `path` when done (dzmodel/outputs.py)."""
    return publish_dir(path, "pipeline", flag="stage output", override="")


def files_under(root: Path) -> list[tuple[str, Path]]:
    """(name relative to `root`, path) of every file under a directory, or the file itself; [] if absent."""
    root = Path(root)
    if root.is_file():
        return [(root.name, root)]
    return [(str(p.relative_to(root)), p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != OWNER_MARKER] if root.exists() else []  # the marker is not an output


def fingerprint(*paths: Path) -> str:
    """A cheap content fingerprint of files/directories: relative path, size and mtime of every file."""
    h = hashlib.sha256()
    for root in paths:
        h.update(str(Path(root).name).encode())
        for name, f in files_under(root):
            st = f.stat()
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# --- stages -----------------------------------------------------------------------------------------------

def require_vision(prof: Profile, paths: StagePaths, stage: str) -> None:
    if prof.vision.enabled and not paths.vision_vae.is_file():
        raise FileNotFoundError(f"{stage}: vision.enabled, but {paths.vision_vae} is missing (run the vision stage)")



def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def content_fingerprint(*paths: Path, small: int = 1 << 20) -> str:
    """Like `fingerprint` but blind to mtimes: small files by content, large ones by size."""
    h = hashlib.sha256()
    for root in paths:
        for name, f in files_under(root):
            size = f.stat().st_size
            h.update(f"{name}:{size}:".encode())
            if size <= small:
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


