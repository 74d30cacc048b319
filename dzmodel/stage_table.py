"""The pipeline's stage table, declared once: each stage's entry, upstream stages, the profile parameters it reads
and the other files it reads. Plain data, below every layer that uses it: params.yaml's check (`dzmodel/config.py`:
DVC refuses a stage whose params are missing), the runner, dvc.yaml and the Prefect flow (`dzmodel/stages/`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RUNNER = "dzmodel.pipeline"  # runs every stage: records its result and fingerprints its outputs


@dataclass(frozen=True)
class StageSpec:
    entry: str                      # module:function that runs it; its imports are the stage's code
    upstream: tuple[str, ...] = ()  # stages whose outputs it reads
    params: tuple[str, ...] = ()    # profile parameters it reads: a section, or section.field
    reads: tuple[str, ...] = ()     # other files it reads, as dvc.yaml names them
    outputs: tuple[str, ...] = ()   # the folders it writes, under its home (`StagePaths.home`); () = its name
    metrics: bool = False           # it writes metrics/<profile>/<name>.json (dvc.yaml's metrics, committed to git)
    plots: tuple[str, ...] = ()     # the images it writes under metrics/<profile>/plots/ (dvc.yaml's plots, cached)
    gpu: bool = False               # it uses the GPU pool (its Prefect task carries the pool's concurrency tag)
    live_metrics: bool = False      # it streams metrics while it runs (its function takes `on_metrics`)

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
    "fetch": StageSpec("dzmodel.stages.fetch:stage_fetch", params=("fetch",), outputs=("dataset",)),
    # the statistics leave out the episodes training holds out
    "metadata": StageSpec("dzmodel.stages.metadata:stage_metadata", upstream=("fetch",),
                          params=("metadata", "train.heldout_episodes")),
    # the offline presets' VAE pretrained on the dataset's frames (dzmodel/train/vision.py); a no-op when disabled
    "vision": StageSpec("dzmodel.stages.vision:stage_vision", upstream=("fetch", "metadata"),
                        params=("vision", *EMBODIMENT_FIELDS, *(f"train.{f}" for f in VISION_TRAIN_FIELDS)),
                        metrics=True, gpu=True),
    "cache": StageSpec("dzmodel.stages.cache:stage_cache", upstream=("fetch", "metadata", "vision"),
                       params=("cache", *EMBODIMENT_FIELDS, *(f"train.{f}" for f in ENCODING_TRAIN_FIELDS)), gpu=True),
    "train": StageSpec("dzmodel.stages.train:stage_train", upstream=("fetch", "metadata", "vision", "cache"),
                       params=("train", "cache.enabled", *EMBODIMENT_FIELDS), metrics=True,
                       plots=("losses.png", "throughput.png"), gpu=True, live_metrics=True),
    "convert": StageSpec("dzmodel.stages.convert:stage_convert", upstream=("train",), params=("convert",),
                         outputs=("converted",)),
    "eval": StageSpec("dzmodel.stages.eval:stage_eval", upstream=("convert", "fetch"),
                      params=("eval", "metadata.embodiment"), metrics=True, plots=("action_error_vs_step.png",),
                      gpu=True),
    "package": StageSpec("dzmodel.stages.package:stage_package", upstream=("convert", "eval"), params=("package",),
                         reads=("metrics/${profile}/eval.json",)),
}
STAGES = tuple(STAGE_TABLE)


def output_names(name: str) -> tuple[str, ...]:
    """The folders a stage writes under its home: its row's `outputs`, else its own name."""
    return STAGE_TABLE[name].outputs or (name,)


# each output folder's stage, for the outputs named otherwise than the stage that writes them
STAGE_OF_OUTPUT = {out: name for name in STAGE_TABLE for out in output_names(name) if out != name}


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
