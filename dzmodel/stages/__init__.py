"""The pipeline's stage table, declared once. dvc.yaml's `deps` and `params` and the Prefect flow's cache keys
both derive from it (tests/test_pipeline.py fails when dvc.yaml disagrees; `dz params dvc --write` rewrites
its deps), and `dz params check` requires every parameter named here to be written out in each profile, because
DVC refuses a stage whose params are missing.

A stage reruns, under either runner, when a parameter it reads, an upstream stage's outputs, or the code it runs
change. Parameters are paths inside a profile: a whole section ("fetch") or one field ("train.seed"), so that an lr
change retrains without re-encoding the dataset, while every field that changes the encodings re-encodes it.
A stage's code is computed, never listed: every project file that its entry module (`dzmodel/stages/<name>.py`)
and the runner (`dzmodel/pipeline.py`) import, transitively, with the data files they name (dzmodel/code_deps.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


RUNNER = "dzmodel.pipeline"  # runs every stage: records its result and fingerprints its outputs


@dataclass(frozen=True)
class StageSpec:
    entry: str                      # module:function that runs it; its imports are the stage's code
    upstream: tuple[str, ...] = ()  # stages whose outputs it reads
    params: tuple[str, ...] = ()    # profile parameters it reads: a section, or section.field
    reads: tuple[str, ...] = ()     # other files it reads, as dvc.yaml names them

    @property
    def module(self) -> str:
        return self.entry.partition(":")[0]


# What the frozen encoders' outputs over the training windows depend on: the model's shapes, the encoder weights
# (or their seed, when random), the tokenizer, and which episodes are cached.
ENCODING_TRAIN_FIELDS = ("preset", "model_overrides", "encoder_weights", "tokenizer", "heldout_episodes",
                         "skip_missing", "seed")
EMBODIMENT_FIELDS = ("metadata.embodiment", "metadata.embodiment_files")
# What the vision stage's VAE depends on besides its own section: the seeded random VAE it starts from (preset,
# seed), the windows its clips come from (model_overrides: their frame spacing) and the episodes it may train on.
VISION_TRAIN_FIELDS = ("preset", "model_overrides", "seed", "heldout_episodes", "skip_missing")

STAGE_TABLE: dict[str, StageSpec] = {
    "fetch": StageSpec("dzmodel.stages.fetch:stage_fetch", params=("fetch",)),
    # the statistics leave out the episodes training holds out
    "metadata": StageSpec("dzmodel.stages.metadata:stage_metadata", upstream=("fetch",),
                          params=("metadata", "train.heldout_episodes")),
    # the offline presets' VAE pretrained on the dataset's frames (dzmodel/train/vision.py); a no-op when disabled
    "vision": StageSpec("dzmodel.stages.vision:stage_vision", upstream=("fetch", "metadata"),
                        params=("vision", *EMBODIMENT_FIELDS, *(f"train.{f}" for f in VISION_TRAIN_FIELDS))),
    "cache": StageSpec("dzmodel.stages.cache:stage_cache", upstream=("fetch", "metadata", "vision"),
                       params=("cache", *EMBODIMENT_FIELDS, *(f"train.{f}" for f in ENCODING_TRAIN_FIELDS))),
    "train": StageSpec("dzmodel.stages.train:stage_train", upstream=("fetch", "metadata", "vision", "cache"),
                       params=("train", "cache.enabled", *EMBODIMENT_FIELDS)),
    "convert": StageSpec("dzmodel.stages.convert:stage_convert", upstream=("train",), params=("convert",)),
    "eval": StageSpec("dzmodel.stages.eval:stage_eval", upstream=("convert", "fetch"),
                      params=("eval", "metadata.embodiment")),
    "package": StageSpec("dzmodel.stages.package:stage_package", upstream=("convert", "eval"), params=("package",),
                         reads=("runs/${profile}/metrics/eval.json",)),
}
STAGES = tuple(STAGE_TABLE)


def param_value(profile: dict[str, Any], path: str) -> tuple[bool, Any]:
    """(present, value) of a parameter path inside a profile's plain data."""
    node: Any = profile
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def stage_params(profile: dict[str, Any], name: str) -> dict[str, Any]:
    """The values of the parameters a stage reads, by path (part of its Prefect cache key)."""
    return {path: param_value(profile, path)[1] for path in STAGE_TABLE[name].params}


def missing_params(profile: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, first stage that reads it) for each table parameter a raw profile does not write out."""
    out: dict[str, str] = {}
    for name, spec in STAGE_TABLE.items():
        for path in spec.params:
            if path not in out and not param_value(profile, path)[0]:
                out[path] = name
    return sorted(out.items())


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
