"""A crafted checkpoint runs no code when it is loaded (`dz convert`, resume, eval all load through here)."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from dzmodel.train.checkpoint import MARKER, load_checkpoint, save_checkpoint


class MakesADirectory:
    """What an attacker's pickle does: call something of its choosing while it is loaded."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return os.makedirs, (str(self.target),)


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _refused(ckpt: Path, target: Path, message: str) -> None:
    """Loading `ckpt` fails with one CheckpointError matching `message`, and `target` was never made."""
    with pytest.raises(Exception) as info:
        load_checkpoint(ckpt, *_model())
    assert not target.exists(), "loading the checkpoint ran code from it"
    assert type(info.value).__name__ == "CheckpointError", repr(info.value)
    assert re.search(message, str(info.value)), str(info.value)


def _finish(ckpt: Path) -> None:
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
    (ckpt / MARKER).write_text("1")


def test_a_saved_checkpoint_loads_with_its_optimizer_hyperparameters(tmp_path):
    model, opt = _model()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, {})
    fresh, fresh_opt = _model()
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    fresh_opt.param_groups[0]["lr"] = 0.5
    state, _ = load_checkpoint(ckpt, fresh, fresh_opt)
    assert state == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert fresh_opt.param_groups[0]["lr"] == 1e-3 and tuple(fresh_opt.param_groups[0]["betas"]) == (0.9, 0.95)


def test_crafted_metadata_pickle_runs_no_code(tmp_path):
    model, opt = _model()
    ckpt = save_checkpoint(tmp_path / "run", 1, model, opt, {"step": 1}, {})
    target = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(MakesADirectory(target)))
    _refused(ckpt, target, r"\.metadata: refused (os|posix)\.makedirs")


def test_crafted_optimizer_item_runs_no_code(tmp_path):
    """DCP stores non-tensor values (the optimizer's lr, betas) as pickles of their own."""
    model, opt = _model()
    target = tmp_path / "pwned"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    state["optim"]["param_groups"][0]["lr"] = MakesADirectory(target)
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000001"
    dcp.save(state, checkpoint_id=str(ckpt))
    _finish(ckpt)
    assert not target.exists()
    _refused(ckpt, target, r"param_groups.*weights_only=True")


def test_truncated_metadata_is_one_clear_error(tmp_path):
    model, opt = _model()
    ckpt = save_checkpoint(tmp_path / "run", 1, model, opt, {"step": 1}, {})
    meta = ckpt / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    _refused(ckpt, tmp_path / "nothing", r"\.metadata: unreadable checkpoint metadata")


def test_metadata_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path):
    """The vetted metadata still chooses which files are read: only files beside it."""
    from dzmodel.train.checkpoint import read_metadata_safely

    model, opt = _model()
    ckpt = save_checkpoint(tmp_path / "run", 1, model, opt, {"step": 1}, {})
    meta = read_metadata_safely(ckpt / ".metadata")
    for info in meta.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    _refused(ckpt, tmp_path / "nothing", r"shard file '\.\./\.\./\.\./\.\./etc/passwd' outside")
