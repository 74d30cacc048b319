"""The pipeline's stage table, declared once. dvc.yaml's `deps` and `params` and the Prefect flow's cache keys
both derive from it (tests/test_pipeline.py fails when dvc.yaml disagrees), and `dz params check` requires every
parameter named here to be written out in each profile, because DVC refuses a stage whose params are missing.

A stage reruns, under either runner, when a parameter it reads, an upstream stage's outputs, or the code it runs
change. Parameters are paths inside a profile: a whole section ("fetch") or one field ("train.seed"), so that an lr
change retrains without re-encoding the dataset, while every field that changes the encodings re-encodes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StageSpec:
    upstream: tuple[str, ...] = ()  # stages whose outputs it reads
    params: tuple[str, ...] = ()    # profile parameters it reads: a section, or section.field
    code: tuple[str, ...] = ()      # the source it runs (files or directories, relative to the repository root)
    reads: tuple[str, ...] = ()     # other files it reads, as dvc.yaml names them


# What the frozen encoders' outputs over the training windows depend on: the model's shapes, the encoder weights
# (or their seed, when random), the tokenizer, and which episodes are cached.
ENCODING_TRAIN_FIELDS = ("preset", "model_overrides", "encoder_weights", "tokenizer", "heldout_episodes",
                         "skip_missing", "seed")
EMBODIMENT_FIELDS = ("metadata.embodiment", "metadata.embodiment_files")
# What the vision stage's VAE depends on besides its own section: the seeded random VAE it starts from (preset,
# seed), the windows its clips come from (model_overrides: their frame spacing) and the episodes it may train on.
VISION_TRAIN_FIELDS = ("preset", "model_overrides", "seed", "heldout_episodes", "skip_missing")
_LIBERO_RECORDER = ("dzmodel/eval/libero_record.py", "dzmodel/eval/libero_expert.py", "dzmodel/eval/libero_env.py")

STAGE_TABLE: dict[str, StageSpec] = {
    "fetch": StageSpec(params=("fetch",), code=("dzmodel/data", *_LIBERO_RECORDER)),
    # the statistics leave out the episodes training holds out
    "metadata": StageSpec(upstream=("fetch",), params=("metadata", "train.heldout_episodes"), code=("dzmodel/data",)),
    # the offline presets' VAE pretrained on the dataset's frames (dzmodel/train/vision.py); a no-op when disabled
    "vision": StageSpec(upstream=("fetch", "metadata"),
                        params=("vision", *EMBODIMENT_FIELDS, *(f"train.{f}" for f in VISION_TRAIN_FIELDS)),
                        code=("dzmodel/data", "dzmodel/model", "dzmodel/train/vision.py", "dzmodel/train/encoders.py",
                              "dzmodel/train/config.py")),
    "cache": StageSpec(upstream=("fetch", "metadata", "vision"),
                       params=("cache", *EMBODIMENT_FIELDS, *(f"train.{f}" for f in ENCODING_TRAIN_FIELDS)),
                       code=("dzmodel/data", "dzmodel/model", "dzmodel/train/cache.py", "dzmodel/train/encoders.py")),
    "train": StageSpec(upstream=("fetch", "metadata", "vision", "cache"),
                       params=("train", "cache.enabled", *EMBODIMENT_FIELDS),
                       code=("dzmodel/data", "dzmodel/model", "dzmodel/train")),
    "convert": StageSpec(upstream=("train",), params=("convert",),
                         code=("dzmodel/train/convert.py", "dzmodel/train/checkpoint.py", "dzmodel/model/state_dict.py")),
    "eval": StageSpec(upstream=("convert", "fetch"), params=("eval", "metadata.embodiment"),
                      code=("dzmodel/eval", "dzmodel/model", "dzmodel/data")),
    "package": StageSpec(upstream=("convert", "eval"), params=("package",), code=("dzmodel/serve/package.py",),
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


def _code_files(spec: StageSpec, root: Path) -> list[Path]:
    files: list[Path] = []
    for rel in spec.code:
        path = root / rel
        if path.is_dir():
            files.extend(p for p in path.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".json")
                         and "__pycache__" not in p.parts)
        else:
            files.append(path)
    return sorted(set(files))


def code_fingerprint(name: str, root: Path = REPO_ROOT) -> str:
    """A hash of the source a stage runs (its Prefect cache key's code version; DVC watches the same paths)."""
    h = hashlib.sha256()
    for f in _code_files(STAGE_TABLE[name], root):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes() if f.is_file() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()[:16]


def dvc_params(name: str) -> list[str]:
    return [f"profiles.${{profile}}.{p}" for p in STAGE_TABLE[name].params]


def dvc_deps(name: str, outputs) -> list[str]:
    """dvc.yaml's deps of a stage: its upstream stages' outputs (`outputs(stage)` as dvc paths), the other files
    it reads, then its code."""
    spec = STAGE_TABLE[name]
    return [*(o for u in spec.upstream for o in outputs(u)), *spec.reads, *spec.code]
