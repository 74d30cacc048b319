"""A pipeline run's identity and its view.

Every flow run has one name, `<profile>-<params digest>-<n>` (or one the user gives), used for the Prefect flow
run, the MLflow run and the run's folder, runs/<profile>/<name>/. That folder is the run's view: `run.json`
(its params digest and every stage's cache key) and links into each stage's keyed outputs
(runs/<profile>/store/<stage>/<key>/, data/<profile>/store/fetch/<key>/ for fetch), which later runs with the
same inputs share. The view has the layout of an unkeyed profile folder (train/, converted/, eval/, package/,
metrics/*.json, plots/*, dataset/ ...). runs/<profile>/latest links to the newest run's view."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from .atomic import atomic_write_text
from .config import StagePaths

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
RESERVED = {"store", "latest", "metrics", "plots", "stages", "superseded"}


def params_digest(profile: dict[str, Any]) -> str:
    """A short digest of a profile's resolved params (defaults filled in, overrides applied)."""
    return hashlib.sha256(json.dumps(profile, sort_keys=True, default=str).encode()).hexdigest()[:8]


def check_run_name(name: str, paths: StagePaths) -> str:
    from .stages import STAGE_TABLE

    if not RUN_NAME.match(name) or name in RESERVED or name in STAGE_TABLE or name in ("converted",):
        raise ValueError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (at most 100, not a stage's or "
                         f"one of {sorted(RESERVED)})")
    return name


def next_run_name(paths: StagePaths, profile: dict[str, Any]) -> str:
    """`<profile>-<params digest>-<n>`, n one more than the highest such run of this profile so far."""
    prefix = f"{paths.profile}-{params_digest(profile)}-"
    taken = [int(p.name[len(prefix):]) for p in paths.run.glob(f"{prefix}*") if p.name[len(prefix):].isdigit()]
    return f"{prefix}{max(taken, default=0) + 1}"


def run_view(paths: StagePaths, name: str) -> Path:
    return paths.run / name


def start_view(paths: StagePaths, name: str, record: dict[str, Any]) -> Path:
    """Create the run's folder (refusing a name already taken) with its run.json, and point `latest` at it."""
    view = run_view(paths, check_run_name(name, paths))
    view.parent.mkdir(parents=True, exist_ok=True)
    try:
        view.mkdir()
    except FileExistsError:
        raise ValueError(f"{view}: a run named {name!r} exists already; choose another --run-name") from None
    atomic_write_text(view / "run.json", json.dumps({"name": name, **record, "stages": {}}, indent=1) + "\n")
    _relink(paths.run / "latest", Path(name))
    return view


SPREAD = ("metrics", "plots", "stages")  # folders that several stages write into: linked file by file


def link_stage(paths: StagePaths, name: str, stage: str) -> list[Path]:
    """Link a stage's keyed outputs into the run's view (relative links) and record its key in run.json."""
    view = run_view(paths, name)
    home = paths.home(stage)
    links = []
    for child in sorted(home.iterdir()) if home.is_dir() else []:
        if child.name.startswith("."):
            continue
        pairs = ([(view / child.name / f.name, f) for f in sorted(child.iterdir())] if child.name in SPREAD
                 and child.is_dir() else [(view / child.name, child)])
        for link, target in pairs:
            link.parent.mkdir(parents=True, exist_ok=True)
            _relink(link, Path(os.path.relpath(target, link.parent)))
            links.append(link)
    record = json.loads((view / "run.json").read_text())
    record["stages"][stage] = paths.key(stage)
    atomic_write_text(view / "run.json", json.dumps(record, indent=1) + "\n")
    return links


def _relink(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp-link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)  # never a moment without the link
