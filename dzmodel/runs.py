"""A pipeline run's identity and its view.

Every flow run has one name, `<profile>-<params digest>-<n>` (or one the user gives), used for the Prefect flow
run, the MLflow run and the run's folder, runs/<profile>/<name>/. That folder is the run's view: `run.json`
(its params digest and every stage's cache key) and links into each stage's keyed outputs
(runs/<profile>/store/<stage>/<key>/, data/<profile>/store/fetch/<key>/ for fetch), which later runs with the
same inputs share. The view has the layout of an unkeyed profile folder (train/, converted/, eval/, package/,
metrics/*.json, plots/*, dataset/ ...). runs/<profile>/latest links to the newest run's view."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .atomic import atomic_write_text
from .config import StagePaths, params_digest

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
RESERVED = {"store", "latest", "metrics", "plots", "stages", "superseded"}


def check_run_name(name: str) -> str:
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
    view = run_view(paths, check_run_name(name))
    view.parent.mkdir(parents=True, exist_ok=True)
    try:
        view.mkdir()
    except FileExistsError:
        raise ValueError(f"{view}: a run named {name!r} exists already; choose another --run-name") from None
    atomic_write_text(view / "run.json", json.dumps({"name": name, **record, "stages": {}}, indent=1) + "\n")
    _relink(paths.run / "latest", Path(name))
    return view


SPREAD = ("metrics", "plots", "stages")  # folders that several stages write into: linked file by file


def link_stage(paths: StagePaths, name: str, stage: str, result: dict | None = None) -> list[Path]:
    """Link a stage's outputs into the run's view (relative links) and record its key in run.json. `result`: the
    stage's result, whose plot files are linked for a stage at dvc.yaml's places (the profile's plots folder
    holds every stage's)."""
    view = run_view(paths, name)
    links = []
    for link, target in _stage_links(paths, view, stage, result or {}):
        link.parent.mkdir(parents=True, exist_ok=True)
        _relink(link, Path(os.path.relpath(target, link.parent)))
        links.append(link)
    record = json.loads((view / "run.json").read_text())
    record["stages"][stage] = paths.key(stage)
    atomic_write_text(view / "run.json", json.dumps(record, indent=1) + "\n")
    return links


# a stage's files beside its outputs in the profile's folder (where dvc.yaml's stages write)
FILES_BESIDE = {"train": ("train_config.json", "train_inputs.json"), "cache": ("tokenizer",)}


def _stage_links(paths: StagePaths, view: Path, stage: str, result: dict) -> list[tuple[Path, Path]]:
    """(link, target) pairs for a stage's outputs: everything in its keyed folder, or, for a stage at dvc.yaml's
    places (shared with DVC), its outputs, record, metrics and the plots its result names."""
    if stage in paths.shared:
        home = paths.home(stage)
        files = [*paths.outputs(stage), *(home / f for f in FILES_BESIDE.get(stage, ()))]
        pairs = [(view / f.name, f) for f in files if f.exists()]
        pairs += [(view / "stages" / f.name, f) for f in [paths.record(stage)] if f.is_file()]
        pairs += [(view / "metrics" / f.name, f) for f in [paths.metrics(stage)] if f.is_file()]
        named = result.get("plots") or ([result["plot"]] if result.get("plot") else [])
        plots = [paths.plots(stage) / Path(p).name for p in named if isinstance(p, str)]
        return pairs + [(view / "plots" / f.name, f) for f in plots if f.is_file()]
    home = paths.home(stage)
    pairs = []
    for child in sorted(home.iterdir()) if home.is_dir() else []:
        if child.name.startswith("."):
            continue
        pairs += ([(view / child.name / f.name, f) for f in sorted(child.iterdir())] if child.name in SPREAD
                  and child.is_dir() else [(view / child.name, child)])
    return pairs


def _relink(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp-link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)  # never a moment without the link


KEY = re.compile(r"^dz-(?P<stage>[a-z]+)-[0-9a-f]{24}$")


def run_views(paths: StagePaths) -> list[Path]:
    """The profile's run views (folders with a run.json naming them), oldest first."""
    views = []
    for child in paths.run.iterdir() if paths.run.is_dir() else []:
        record = child / "run.json"
        if child.is_dir() and not child.is_symlink() and record.is_file():
            try:
                if json.loads(record.read_text()).get("name") == child.name:
                    views.append(child)
            except ValueError:
                continue
    return sorted(views, key=lambda v: (v / "run.json").stat().st_mtime_ns)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _newest_write(path: Path) -> float:
    return max([path.stat().st_mtime, *(f.lstat().st_mtime for f in path.rglob("*"))])


def collect_garbage(paths: StagePaths, keep: int = 10, dry_run: bool = False,
                    min_age_s: float = 3600.0) -> dict[str, Any]:
    """Remove all but the newest `keep` run views (and the one `latest` names), then every keyed stage output
    that no remaining view uses and that nothing wrote to for `min_age_s` (a running flow's stage has no view
    entry yet). Only what the flow made is touched: run views (a run.json naming the folder, links inside) and
    store folders named by a stage's cache key. Prefect's cached results for removed keys find their outputs
    gone and rerun. Returns what went (or would go) and the bytes freed."""
    import shutil
    import time

    if keep < 1:
        raise ValueError(f"--keep must be at least 1, got {keep}")
    views = run_views(paths)
    latest = (paths.run / "latest").resolve() if (paths.run / "latest").is_symlink() else None
    kept = [v for v in views[-keep:]] + [v for v in views[:-keep] if latest is not None and v.resolve() == latest]
    dropped = [v for v in views if v not in kept]
    used = {(stage, key) for v in kept for stage, key in json.loads((v / "run.json").read_text())["stages"].items()}
    stale = []
    for stage_store in [*(paths.run / "store").glob("*"), *(paths.profile_data / "store").glob("*")]:
        for folder in sorted(stage_store.iterdir()) if stage_store.is_dir() else []:
            match = KEY.match(folder.name)
            if match and match["stage"] == stage_store.name and (stage_store.name, folder.name) not in used \
                    and time.time() - _newest_write(folder) >= min_age_s:
                stale.append(folder)
    freed = sum(_size(f) for f in stale)
    if not dry_run:
        for view in dropped:
            shutil.rmtree(view)
        for folder in stale:
            shutil.rmtree(folder)
    return {"views_removed": [v.name for v in dropped], "views_kept": [v.name for v in kept],
            "outputs_removed": [str(f.relative_to(paths.root)) for f in stale], "bytes_freed": freed,
            "dry_run": dry_run}
