"""The flow and `dvc repro` share one store of stage outputs: DVC's workspace, cache and run cache.

A stage is *shared* when the flow gives it, and every stage upstream of it, the params that dvc.yaml gives it
(the profile that params.yaml selects, with no `--set` that reaches the stage), in a project that DVC tracks
(dvc.yaml and .dvc/ at the flow's root). A shared stage writes at the places dvc.yaml names (runs/<profile>/,
data/<profile>/, metrics/<profile>/) instead of under its cache key, and:
- before it runs, the flow asks DVC whether dvc.lock already describes this stage's inputs and the outputs
  there (`dvc status`); if so, and the outputs are the ones the stage's record describes, they are reused and
  nothing runs;
- after it runs, its outputs are committed to DVC (`dvc commit`: dvc.lock, DVC's cache and its run cache), so
  that `dvc repro` and `dvc exp run` find the stage unchanged and do not run it again.
A run with other params (`--set train.lr=...`) shares the stages that the change does not reach and keeps the
others under their cache keys, as before. One writer at a time: a run that shares holds the profile's folder
(an flock on runs/<profile>/, which `dz stage`, and so `dvc repro`, takes too); a run that finds it held, or that
runs from another folder than the project (dvc.yaml's paths are relative to it), shares nothing. A commit is
made only for outputs that the run itself holds, under the params and code that params.yaml and the project
have at that moment; otherwise it is left to the next run (logged), and DVC failing never fails the flow.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from dzmodel.config import (PROJECT_PARAMS, Profile, RunParams, StagePaths, load_params, profile_dict,
                            stages_params)
from dzmodel.dirlock import DirectoryBusy, directory_lock
from dzmodel.pipeline import WORKSPACE_WRITER, current_fingerprint, outputs_intact
from dzmodel.stages import STAGE_TABLE, STAGES, code_fingerprint

Log = Callable[[str], None]
DVC_PARAMS = PROJECT_PARAMS  # what dvc.yaml reads (`vars: [params.yaml]`)


def dvc_project(root: Path) -> bool:
    """`root` is a DVC project whose dvc.yaml runs the pipeline's stages, and DVC is installed."""
    return ((root / "dvc.yaml").is_file() and (root / ".dvc").is_dir()
            and importlib.util.find_spec("dvc") is not None)


def shared_stages(root: Path, name: str, prof: Profile) -> tuple[str, ...]:
    """The stages whose params, and whose upstream stages' params, are dvc.yaml's, in table order (none when the
    process runs outside the project: DVC and the stages' records name paths relative to it). Reads params.yaml
    as it is now (a commit checks that it still gives a stage this run's params)."""
    if not dvc_project(root) or Path.cwd().resolve() != root.resolve():
        return ()
    try:
        dvc_params = load_params(root / DVC_PARAMS)
    except (ValueError, OSError):  # a params.yaml DVC cannot run either
        return ()
    if dvc_params.profile != name:
        return ()
    dvc_prof = dvc_params.selected(name)
    return _agreeing(stages_params(profile_dict(prof)), stages_params(profile_dict(dvc_prof)))


def shared_with_dvc(run: RunParams) -> tuple[str, ...]:
    """`shared_stages` of a run whose params are loaded (`load_run`; the project's params.yaml is read once, here)."""
    if not dvc_project(run.root) or Path.cwd().resolve() != run.root.resolve() or run.project_stage_params is None:
        return ()
    return _agreeing(run.stage_params, run.project_stage_params)


def _agreeing(ours: dict[str, dict], dvc: dict[str, dict]) -> tuple[str, ...]:
    """The stages, in table order, whose params and whose upstream stages' params agree."""
    shared: list[str] = []
    for stage in STAGES:
        if all(u in shared for u in STAGE_TABLE[stage].upstream) and ours[stage] == dvc[stage]:
            shared.append(stage)
    return tuple(shared)


class Workspace:
    """The profile's DVC workspace held for one run of the flow (an flock on runs/<profile>/), or not held."""

    def __init__(self, root: Path, name: str):
        self.where = StagePaths(root, name).run
        self.held = False

    def claim(self) -> bool:
        self._lock = directory_lock(self.where, wait=False, what=WORKSPACE_WRITER)
        try:
            self._lock.__enter__()
        except DirectoryBusy:
            return False
        self.held = True
        return True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._lock.__exit__(None, None, None)


@contextmanager
def _repo(root: Path):
    """DVC's repository at `root`, its own INFO lines ("Updating lock file") left out of the flow's log."""
    from dvc.repo import Repo

    dvc_logger = logging.getLogger("dvc")
    level = dvc_logger.level
    dvc_logger.setLevel(logging.WARNING)
    try:
        with Repo(str(root)) as repo:
            yield repo
    finally:
        dvc_logger.setLevel(level)


def changed(root: Path, stages: list[str] | tuple[str, ...]) -> set[str]:
    """The stages among `stages` that dvc.lock does not describe as they are (their params, deps or outputs)."""
    if not stages:
        return set()
    with _repo(root) as repo:
        return {name.rsplit(":", 1)[-1] for name in repo.status(targets=list(stages))}


def reuse(stage: str, paths, log: Log) -> dict | None:
    """The stage's recorded result, when dvc.lock describes its inputs and outputs as they are and the outputs
    are the ones its record describes (DVC or an earlier run of the flow made them); else None."""
    if not outputs_intact(stage, paths):
        return None
    try:
        if changed(paths.root, [stage]):
            return None
    except Exception as exc:  # a DVC that cannot answer: the stage runs, as it would without DVC
        log(f"{stage}: DVC status failed ({type(exc).__name__}: {exc}); the stage runs")
        return None
    log(f"{stage}: dvc.lock describes these inputs and outputs; reused {paths.home(stage)}, nothing ran")
    return json.loads(paths.record(stage).read_text())


def commit_run(stage: str, paths, prof: Profile, result: dict, code: str, log: Log) -> list[str]:
    """Commit a stage this run has just run, if what it ran is still what DVC would: params.yaml still gives it
    these params (it may have been edited while the stage ran), its code is the code it ran, and its outputs are
    the ones it recorded."""
    reason = _not_committable(stage, paths, prof, result, code)
    if reason:
        log(f"{stage}: not committed to DVC ({reason}); dvc repro will run it")
        return []
    return commit(paths.root, [stage], log)


def _not_committable(stage: str, paths, prof: Profile, result: dict, code: str | None = None) -> str | None:
    if stage not in shared_stages(paths.root, paths.profile, prof):
        return "params.yaml no longer gives it this run's params"
    if code is not None and code_fingerprint(stage) != code:
        return "its code changed while it ran"
    if result.get("outputs_fingerprint") != current_fingerprint(stage, paths):
        return f"its outputs in {paths.home(stage)} are not the ones this run recorded"
    return None


def commit(root: Path, stages: list[str] | tuple[str, ...], log: Log) -> list[str]:
    """Commit the stages' outputs to DVC (dvc.lock, cache, run cache), leaving the files in place. Returns the
    stages committed; a DVC that is busy or fails is logged, and the next run of the flow commits them."""
    if not stages:
        return []
    try:
        with _repo(root) as repo:
            for stage in stages:
                repo.commit(stage, force=True, relink=False)
    except Exception as exc:
        log(f"dvc.lock not updated for {', '.join(stages)} ({type(exc).__name__}: {exc}); "
            "the next run of the flow commits them")
        return []
    log(f"{', '.join(stages)}: committed to DVC (dvc.lock and its cache); dvc repro will not run "
        f"{'it' if len(stages) == 1 else 'them'} again")
    return list(stages)


def sync(paths, prof: Profile, results: dict[str, dict], stages: tuple[str, ...], log: Log) -> list[str]:
    """Commit the shared stages that dvc.lock does not describe as this run left them (e.g. reused from the flow's
    cache after dvc.lock changed), those whose outputs are still the ones this run's results describe."""
    try:
        differ = changed(paths.root, stages)
    except Exception as exc:
        log(f"DVC status failed ({type(exc).__name__}: {exc}); dvc.lock left as it is")
        return []
    stale = [s for s in stages if s in differ and outputs_intact(s, paths)
             and not _not_committable(s, paths, prof, results[s])]
    return commit(paths.root, stale, log)
