"""Sharded DCP checkpoints, written atomically, and exact resume.

Layout: <out>/checkpoints/step_0000010/
    .metadata, __<rank>_0.distcp     model + optimizer (torch.distributed.checkpoint, sharded under FSDP)
    rng_rank<r>.safetensors          each rank's torch RNG and noise-generator states
    trainer_state.json               step, samples consumed per rank, config
    COMPLETE                         written last
Everything is written into `step_XXXXXXX.tmp/`, which is renamed only after every rank finished and the
COMPLETE marker exists. A torn write (a crash, `kill -9`) leaves a `.tmp` directory that is never loaded
and is removed by the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

STEP_DIR = re.compile(r"^step_(\d{7})$")
MARKER = "COMPLETE"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def _model_options(model: torch.nn.Module) -> StateDictOptions:
    """Only the trainable tensors of a model with frozen ones (LoRA: the base is referenced, not copied)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def save_checkpoint(out_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict, rng_states: dict[str, torch.Tensor],
                    ema: dict[str, torch.Tensor] | None = None) -> Path:
    """ema: the EMA weights by parameter name (saved sharded beside the model, under "ema")."""
    root = checkpoint_dir(out_dir)
    final = root / f"step_{step:07d}"
    tmp = root / f"step_{step:07d}.tmp"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    state = {"model": get_model_state_dict(model, options=_model_options(model)),
             "optim": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = ema
    dcp.save(state, checkpoint_id=str(tmp))
    save_file({k: v.contiguous() for k, v in rng_states.items()}, str(tmp / f"rng_rank{rank}.safetensors"))
    _barrier()
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        with open(tmp / MARKER, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint; `.tmp` (torn) directories and ones without the marker are ignored."""
    steps = list_checkpoints(out_dir)
    return steps[-1][1] if steps else None


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / MARKER).is_file())


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    ema: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore model (and optimizer, and the EMA weights into `ema`'s tensors) in place; return
    (trainer_state, this rank's RNG states)."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    options = _model_options(model)
    state = {"model": get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if ema is not None:
        state["ema"] = ema
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    rng_file = path / f"rng_rank{_rank()}.safetensors"
    rng = load_file(str(rng_file)) if rng_file.is_file() else {}
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    return trainer_state, rng
