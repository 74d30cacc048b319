"""`dz convert`: a DCP training checkpoint -> an HF-style DreamZero directory, pickle-free.

    <out>/config.json                      the model class and its args
    <out>/model.safetensors                (or model-0000k-of-0000n.safetensors + model.safetensors.index.json)
    <out>/experiment_cfg/metadata.json     the normalisation statistics the run trained with
    <out>/experiment_cfg/train_config.json the run's TrainConfig
    <out>/experiment_cfg/embodiments/      copies of the run's embodiment YAML files (if any)
    <out>/tokenizer/                       the run's tokenizer directory
The frozen encoders are not copied (they are the run's WAN files or seeded weights, rebuilt from the
config; `dz package` writes them into the bundle).
Built in `<out>.tmp` and renamed, so a half-written conversion is never picked up.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..model.args import preset
from ..model.state_dict import save_dreamzero_dir
from ..model.wam import DreamZeroWAM
from .checkpoint import MARKER, latest_checkpoint, list_checkpoints, load_checkpoint
from .config import TrainConfig


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


def convert_checkpoint(checkpoint: str | Path, out: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    ckpt = Path(checkpoint)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    cfg = TrainConfig.from_dict(state["config"])
    model = DreamZeroWAM(preset(cfg.preset, **cfg.model_overrides))
    load_checkpoint(ckpt, model, None)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_dreamzero_dir(model, tmp, max_shard_bytes=max_shard_bytes)
    exp = tmp / "experiment_cfg"
    exp.mkdir()
    if cfg.metadata and Path(cfg.metadata).is_file():
        shutil.copyfile(cfg.metadata, exp / "metadata.json")
    (exp / "train_config.json").write_text(json.dumps({"step": state["step"], **cfg.to_dict()}, indent=1))
    for i, f in enumerate(cfg.embodiment_files):  # the embodiment definitions travel with the weights
        if Path(f).is_file():
            (exp / "embodiments").mkdir(exist_ok=True)
            shutil.copyfile(f, exp / "embodiments" / f"{i:02d}_{Path(f).name}")
    tokenizer = Path(cfg.tokenizer) if cfg.tokenizer else ckpt.parent.parent / "tokenizer"  # the trainer's default
    if (tokenizer / "tokenizer.json").is_file():
        shutil.copytree(tokenizer, tmp / "tokenizer")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
