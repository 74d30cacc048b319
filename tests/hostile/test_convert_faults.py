"""`dz convert` when the disk fills up or a checkpoint shard is damaged: one line naming the file, no traceback,
the earlier output intact and no partial one left. Run as users run it: `dz convert RUN --out DIR`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors
import torch

from dzmodel.cli import main
from dzmodel.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from tests.tiny_data import make_one_step_run

# what safetensors raises when the disk fills up under it (its message, as measured on a full tmpfs)
ENOSPC_MESSAGE = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny dataset and a one-step training run with its DCP checkpoint."""
    root = make_one_step_run(tmp_path_factory.mktemp("convert_faults"))
    return root / "run"


def _snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("dz: error: "), err
    return err


def _copy_run(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run (to damage) and its checkpoint."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, latest_checkpoint(copy)


# -- a full disk --

def test_a_full_disk_inside_safetensors_is_one_line_and_the_earlier_output_stays(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    assert main(["convert", str(run), "--out", str(out)]) == 0
    before = _snapshot(out)
    capsys.readouterr()
    written = []

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # a partial file, as a write that ran out of room leaves
        written.append(filename)
        raise safetensors.SafetensorError(ENOSPC_MESSAGE)

    monkeypatch.setattr("dzmodel.model.state_dict.save_file", full)
    code = main(["convert", str(run), "--out", str(out)])
    err = _one_line_error(capsys)
    assert written and code == 1
    assert err.startswith(f"dz: error: {out}: no space left on the device"), err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or partial output left


def test_another_safetensors_error_names_the_output(run, tmp_path, capsys, monkeypatch):
    def denied(tensors, filename, metadata=None):
        raise safetensors.SafetensorError(f"Error while serializing: I/O error: Permission denied (os error 13) "
                                          f"at path \"{filename}\"")

    monkeypatch.setattr("dzmodel.model.state_dict.save_file", denied)
    out = tmp_path / "hf"
    assert main(["convert", str(run), "--out", str(out)]) != 0
    err = _one_line_error(capsys)
    assert "Permission denied" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


# -- a damaged shard --

def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _zero_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    n = len(data)
    data[n // 20:n // 4] = bytes(n // 4 - n // 20)  # the model's tensors, within the file's length
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, what", [
    (lambda p: _truncate(p, 0), "empty"),
    (lambda p: _truncate(p, 1000), "truncated in its first tensor"),
    (lambda p: _truncate(p, p.stat().st_size // 8), "truncated among the model's tensors"),
    (_zero_middle, "zeroed in the middle"),
])
def test_a_damaged_distcp_is_one_line_naming_the_shard(run, tmp_path, capsys, damage, what):
    copy, ckpt = _copy_run(run, tmp_path)
    shard = ckpt / "__0_0.distcp"
    damage(shard)
    out = tmp_path / "hf"
    code = main(["convert", str(copy), "--out", str(out)])
    err = _one_line_error(capsys)
    print(f"\n{what}: {err}")
    assert code != 0
    assert err.startswith(f"dz: error: {shard}: truncated or unreadable checkpoint shard ("), err
    assert not out.exists()


def test_a_missing_distcp_is_one_line_naming_the_shard(run, tmp_path, capsys):
    copy, ckpt = _copy_run(run, tmp_path)
    (ckpt / "__0_0.distcp").unlink()
    assert main(["convert", str(copy), "--out", str(tmp_path / "hf")]) != 0
    err = _one_line_error(capsys)
    assert err.startswith(f"dz: error: {ckpt / '__0_0.distcp'}: missing checkpoint shard"), err


def test_resume_from_a_shard_truncated_in_its_optimizer_state_names_the_shard(run, tmp_path):
    """The optimizer's state lies after the model's tensors: a file cut there still converts, but cannot resume."""
    from dzmodel.model.args import preset
    from dzmodel.model.wam import DreamZeroWAM

    copy, ckpt = _copy_run(run, tmp_path)
    shard = ckpt / "__0_0.distcp"
    _truncate(shard, shard.stat().st_size - 1000)
    model = DreamZeroWAM(preset("tiny"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(CheckpointError, match=rf"^{shard}: truncated or unreadable checkpoint shard \("):
        load_checkpoint(ckpt, model, optimizer)


def test_dz_convert_of_a_truncated_shard_prints_one_line_and_nothing_else(run, tmp_path):
    """As a user runs it, in its own process: stderr is the one line (no DCP warning, no traceback)."""
    import subprocess
    import sys

    copy, ckpt = _copy_run(run, tmp_path)
    _truncate(ckpt / "__0_0.distcp", 1000)
    done = subprocess.run([sys.executable, "-m", "dzmodel.cli", "convert", str(copy), "--out", str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"dz: error: {ckpt / '__0_0.distcp'}: truncated or unreadable checkpoint shard "
                               "(1,000 bytes; the checkpoint's metadata needs at least "), lines
