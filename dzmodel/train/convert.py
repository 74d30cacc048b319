"""`dz convert`: a DCP training checkpoint -> an HF-style DreamZero directory, pickle-free.

    <out>/config.json                      the model class and its args
    <out>/model.safetensors                (or model-0000k-of-0000n.safetensors + model.safetensors.index.json)
    <out>/experiment_cfg/metadata.json     the normalisation statistics the run trained with
    <out>/experiment_cfg/train_config.json the run's TrainConfig
    <out>/experiment_cfg/embodiments/      copies of the run's embodiment YAML files (if any)
    <out>/tokenizer/                       the run's tokenizer directory
The config's relative paths are looked up from the directory the run trained in (trainer_state.json's `workdir`;
for a run moved since, from the folders above the checkpoint), so a run converts from anywhere. A file the
config names that is not there (statistics, an embodiment file, the tokenizer) is refused by name: a model without
it could not be packaged.
A LoRA run's adapters are merged into the base by default, so the result is a plain model that packages and
`dz serve` take as they are; `adapters_only` writes `adapters.safetensors` (the trainable tensors, with the
base's reference in its metadata) plus the same config files instead.
The frozen encoders are not copied (they are the run's WAN files or seeded weights, rebuilt from the
config; `dz package` writes them into the bundle).
Built in a temporary sibling of `<out>` and renamed, so a half-written conversion is never picked up; an
existing `<out>` is replaced only if dz wrote it (dzmodel/outputs.py), or with `overwrite`. A write that fails
(a full disk, a denied permission; safetensors' own errors included) is one OutputError naming `<out>`, the
temporary removed and an earlier `<out>` intact. A damaged checkpoint is a CheckpointError naming its file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..model.lora import apply_lora, lora_state, merge_lora, trainable_parameters
from ..model.state_dict import save_dreamzero_dir, save_safetensors_atomic
from ..model.wam import DreamZeroWAM
from ..outputs import OutputError, check_output_dir, publish_dir
from .checkpoint import (MARKER, CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint,
                         read_trainer_state, safetensors_os_errors)
from .config import TrainConfig, located


def resolve_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """A checkpoint dir itself, or a run dir (its newest complete checkpoint, or `step`)."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if step is not None:
        for s, p in list_checkpoints(path):
            if s == step:
                return p
        raise FileNotFoundError(f"{path}: no complete checkpoint for step {step}")
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint (neither a checkpoint nor a run directory)")
    return ckpt


def lora_base(cfg: TrainConfig, base: dict | None, where: Path) -> DreamZeroWAM:
    """A LoRA checkpoint's frozen base, rebuilt from its reference and checked against it."""
    from .trainer import base_reference, files_sha256, initial_model

    if not base:
        raise ValueError(f"{where}: a LoRA checkpoint without the reference to its base weights")
    if "init_dit" in base:
        path = cfg.init_dit or base["init_dit"]  # the run's config, its relative path located (`search_dirs`)
        if not Path(path).is_file():
            raise FileNotFoundError(f"{where}: the base weights {path} are not here")
        if files_sha256(path) != base["sha256"]:
            raise ValueError(f"{where}: the base weights {path} changed since training (sha256 differs)")
        return initial_model(cfg, "cpu")
    if base != base_reference(cfg, base["device"]):
        raise ValueError(f"{where}: base reference {base} does not match the run's config")
    if base["device"] == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where}: the seeded base was drawn on a GPU; convert on a machine with one")
    return initial_model(cfg, base["device"]).cpu()


WEIGHTS = ("raw", "ema")


def search_dirs(state: dict, ckpt: Path) -> list[Path]:
    """Where a checkpoint's relative paths are looked up: the directory the run trained in (recorded in
    trainer_state.json) while it exists; only for a run that was moved, or one from before that record, the folders
    above the checkpoint (nearest first). A path found nowhere stays as given (relative to the working directory)."""
    trained_in = Path(state["workdir"]) if state.get("workdir") else None
    if trained_in is not None and trained_in.is_dir():
        return [trained_in]
    return list(Path(os.path.abspath(ckpt)).parents)


def check_carried_files(cfg: TrainConfig, ckpt: Path, state: dict) -> None:
    """The files the converted model carries must be there: the statistics, each embodiment file and a configured
    tokenizer. One FileNotFoundError naming the first one missing and its config field."""
    wanted = [(f"train.embodiment_files[{i}]", f, "") for i, f in enumerate(cfg.embodiment_files)]
    wanted += [("train.metadata", cfg.metadata, "")] if cfg.metadata else []
    wanted += [("train.tokenizer", cfg.tokenizer, "tokenizer.json")] if cfg.tokenizer else []
    for field, path, inside in wanted:
        if (Path(path) / inside).is_file():
            continue
        where = ""
        if not Path(path).is_absolute():
            where = f" (looked up from {', '.join(map(str, search_dirs(state, ckpt)))} and {Path.cwd()})"
        raise FileNotFoundError(f"{ckpt}: {field} names {path}{f'/{inside}' if inside else ''}, which is not "
                                f"there{where}. dz convert copies it into the model, and `dz package` needs it: "
                                "restore the file, then convert again")


def convert_checkpoint(checkpoint: str | Path, out: str | Path, max_shard_bytes: int = 5 * 2**30,
                       adapters_only: bool = False, weights: str = "raw", overwrite: bool = False) -> Path:
    """weights: "raw" (the optimizer's) or "ema" (the moving average a run with train.ema_decay kept).
    `out` must be absent, empty or an earlier dz output; `overwrite` replaces any directory."""
    ckpt = Path(checkpoint)
    out = check_output_dir(out, overwrite=overwrite, command="convert")  # before the minutes of loading
    state = read_trainer_state(ckpt)
    if state.get("config") is None:
        raise CheckpointError(f"{ckpt / 'trainer_state.json'}: no config (the run's TrainConfig) to convert with")
    try:
        given = TrainConfig.from_dict(state["config"], where="config")
    except ValueError as exc:  # a SchemaError lists each bad field: one line here
        problems = getattr(exc, "problems", None) or [str(exc)]
        raise CheckpointError(f"{ckpt / 'trainer_state.json'}: {'; '.join(problems)[:1000]}") from None
    cfg = located(given, search_dirs(state, ckpt))  # the files; the model keeps the config as the run gave it
    check_carried_files(cfg, ckpt, state)
    if adapters_only and not cfg.lora.enabled:
        raise ValueError(f"{ckpt}: --adapters-only needs a LoRA run (train.lora.rank > 0)")
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "ema" and not cfg.ema_decay:
        raise ValueError(f"{ckpt}: --weights ema needs a run that kept an EMA (train.ema_decay > 0)")
    if cfg.lora.enabled:
        model = lora_base(cfg, state.get("base"), ckpt)
        apply_lora(model, cfg.lora)
    else:
        from ..model.args import preset

        model = DreamZeroWAM(preset(cfg.preset, **cfg.model_overrides))
    ema = ({n: torch.empty_like(p) for n, p in trainable_parameters(model)}
           if weights == "ema" else None)
    load_checkpoint(ckpt, model, None, ema)
    if ema is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in ema:
                    p.copy_(ema[name])
    try:
        with publish_dir(out, "convert", overwrite=overwrite) as tmp, safetensors_os_errors(tmp):
            _write_converted(tmp, model, cfg, given, state, ckpt, adapters_only, max_shard_bytes, weights)
    except OSError as exc:  # a full disk is publish_dir's own message; any other failed write, one line here
        raise OutputError(f"{out}: cannot write the converted model: {exc.strerror or exc}"
                          f"{f' ({exc.filename})' if exc.filename else ''}; nothing earlier was replaced") from None
    return out


def _write_converted(tmp: Path, model: DreamZeroWAM, cfg: TrainConfig, given: TrainConfig, state: dict, ckpt: Path,
                     adapters_only: bool, max_shard_bytes: int, weights: str) -> None:
    """cfg: the run's config with its files located; given: as the run gave it (what train_config.json holds)."""
    if adapters_only:
        save_safetensors_atomic({k: v.contiguous() for k, v in lora_state(model).items()}, tmp / "adapters.safetensors",
                                {"format": "pt", "base": json.dumps(state["base"]), "lora": json.dumps(cfg.to_dict()["lora"])})
    else:
        if cfg.lora.enabled:
            merge_lora(model)
        save_dreamzero_dir(model, tmp, max_shard_bytes=max_shard_bytes)
    exp = tmp / "experiment_cfg"
    exp.mkdir(exist_ok=True)
    if cfg.metadata:  # present: check_carried_files
        shutil.copyfile(cfg.metadata, exp / "metadata.json")
    (exp / "train_config.json").write_text(json.dumps({"step": state["step"], "weights": weights, **given.to_dict()},
                                                      indent=1))
    for i, f in enumerate(cfg.embodiment_files):  # the embodiment definitions travel with the weights
        (exp / "embodiments").mkdir(exist_ok=True)
        shutil.copyfile(f, exp / "embodiments" / f"{i:02d}_{Path(f).name}")
    tokenizer = Path(cfg.tokenizer) if cfg.tokenizer else ckpt.parent.parent / "tokenizer"  # the trainer's default
    if (tokenizer / "tokenizer.json").is_file():
        shutil.copytree(tokenizer, tmp / "tokenizer")

