"""The pipeline's stages: one module per stage, and what derives from the stage table (declared in
dzmodel/stage_table.py): each stage's code files and fingerprint, and dvc.yaml's deps. dvc.yaml's `deps` and
`params` and the Prefect flow's cache keys all derive from the table (tests/test_pipeline.py fails when dvc.yaml
disagrees; `dz params dvc --write` rewrites its deps), and `dz params check` requires every parameter it names to be
written out in each profile, because DVC refuses a stage whose params are missing.

A stage reruns, under either runner, when a parameter it reads, an upstream stage's outputs, or the code it runs
change. Parameters are paths inside a profile: a whole section ("fetch") or one field ("train.seed"), so that an lr
change retrains without re-encoding the dataset, while every field that changes the encodings re-encodes it.
A stage's code is computed, never listed: every project file that its entry module (`dzmodel/stages/<name>.py`)
and the runner (`dzmodel/pipeline.py`) import, transitively, with the data files they name (dzmodel/code_deps.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..stage_table import (EMBODIMENT_FIELDS, ENCODING_TRAIN_FIELDS, RUNNER, STAGE_TABLE, STAGES,
                           VISION_TRAIN_FIELDS, StageSpec, missing_params, param_value, stage_params)

__all__ = ["EMBODIMENT_FIELDS", "ENCODING_TRAIN_FIELDS", "RUNNER", "STAGE_TABLE", "STAGES", "VISION_TRAIN_FIELDS",
           "StageSpec", "missing_params", "param_value", "stage_params", "REPO_ROOT", "code_files",
           "code_fingerprint", "dvc_params", "dvc_deps", "dvc_metrics", "dvc_plots", "TRACK_STAGE", "TRACK_MODULE",
           "TRACK_PARAMS", "dvc_track_deps"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def code_files(name: str, root: Path = REPO_ROOT) -> list[Path]:
    """The source a stage runs: its entry module's and the runner's project imports, transitively."""
    from ..code_deps import module_closure

    return module_closure((STAGE_TABLE[name].module, RUNNER), root)


def code_fingerprint(name: str, root: Path = REPO_ROOT) -> str:
    """A hash of the source a stage runs (its Prefect cache key's code version; DVC watches the same files)."""
    h = hashlib.sha256()
    for f in code_files(name, root):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def dvc_params(name: str) -> list[str]:
    return [f"profiles.${{profile}}.{p}" for p in STAGE_TABLE[name].params]


def dvc_deps(name: str, outputs) -> list[str]:
    """dvc.yaml's deps of a stage: its upstream stages' outputs (`outputs(stage)` as dvc paths), the other files
    it reads, then its code."""
    spec = STAGE_TABLE[name]
    return [*(o for u in spec.upstream for o in outputs(u)), *spec.reads,
            *(str(f.relative_to(REPO_ROOT)) for f in code_files(name))]


def dvc_metrics(name: str, as_dvc) -> list[str]:
    """dvc.yaml's metrics of a stage (`as_dvc`: its StagePaths with the profile as `${profile}`)."""
    return [str(as_dvc.metrics(name))] if STAGE_TABLE[name].metrics else []


def dvc_plots(name: str, as_dvc) -> list[str]:
    """dvc.yaml's plots (images) of a stage."""
    return [str(as_dvc.plots(name) / p) for p in STAGE_TABLE[name].plots]


# dvc.yaml's last stage, outside the table (the library runs no MLflow): `dz track` (flows/dvc_tracking.py) logs
# the stage records of `dvc repro` as an MLflow run, registers the package and runs the promotion gate
TRACK_STAGE = "track"
TRACK_MODULE = "flows.dvc_tracking"
TRACK_PARAMS = ("promote",)


def dvc_track_deps(outputs, records) -> list[str]:
    """The track stage's deps: the package's outputs, every stage's record (`records(stage)` as dvc paths), then
    its code (the import closure of flows/dvc_tracking.py across dzmodel, tasks and flows)."""
    from ..code_deps import module_closure

    code = module_closure((TRACK_MODULE,), REPO_ROOT, packages=("dzmodel", "tasks", "flows"))
    return [*outputs("package"), *(records(s) for s in STAGE_TABLE),
            *(str(f.relative_to(REPO_ROOT)) for f in code)]
