"""The `dz` command line: model parity, info, manifest; clear errors for bad input."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dzmodel.cli import main
from tests.conftest import all_fixture_files

FIXTURES = ["wan22_dit_tiny_reference", "wan22_vae_tiny_reference", "dreamzero_wam_tiny_reference"]


def test_the_checkout_carries_its_reference_fixtures(fixtures_dir):
    for name in FIXTURES:
        assert (fixtures_dir / f"{name}.safetensors").is_file(), name
    import hashlib
    import re

    # the note says where each came from, with its sha256: the files are the ones recorded
    sums = dict(re.findall(r"`([\w.]+\.safetensors)` \| `([0-9a-f]{64})`", (fixtures_dir / "README.md").read_text()))
    assert set(sums) == {f"{n}.safetensors" for n in FIXTURES}
    for name, digest in sums.items():
        assert hashlib.sha256((fixtures_dir / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("path", all_fixture_files(), ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_parity_passes_on_each_fixture(path, capsys):
    """The checkout's fixtures, plus any of the same format in $DZ_SHARED_DIR/fixtures (other dims are read from
    each file's metadata)."""
    rc = main(["model", "parity", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS" in out and "max abs err" in out


def test_parity_entry_point_runs_all_fixtures_in_one_call(fixtures_dir):
    dz = Path(sys.executable).with_name("dz")
    proc = subprocess.run([str(dz), "model", "parity", *[str(fixtures_dir / f"{n}.safetensors") for n in FIXTURES]],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS") == 3
    for kind in ("kind: dit", "kind: vae", "kind: wam"):
        assert kind in proc.stdout


def _copy_with(fixture: Path, out: Path, change) -> Path:
    tensors = load_file(str(fixture))
    with safe_open(str(fixture), "pt") as f:
        meta = f.metadata()
    change(tensors, meta)
    save_file(tensors, str(out), metadata=meta)
    return out


def test_parity_fails_with_exit_1_on_a_tampered_output(fixtures_dir, tmp_path, capsys):
    def bump(t, meta):
        t["output.x"] = t["output.x"] + 1e-3

    path = _copy_with(fixtures_dir / "wan22_dit_tiny_reference.safetensors", tmp_path / "tampered.safetensors", bump)
    assert main(["model", "parity", str(path)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_parity_wrong_fixture_missing_file_and_bad_metadata(fixtures_dir, tmp_path, capsys):
    not_fixture = tmp_path / "weights.safetensors"
    save_file({"a": torch.zeros(2)}, str(not_fixture))
    assert main(["model", "parity", str(not_fixture)]) == 2
    assert "not a recognised parity fixture" in capsys.readouterr().err

    assert main(["model", "parity", str(tmp_path / "missing.safetensors")]) == 2
    assert "fixture not found" in capsys.readouterr().err

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    assert main(["model", "parity", str(garbage)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err

    def drop_dim(t, meta):
        del meta["dim"]

    path = _copy_with(fixtures_dir / "wan22_dit_tiny_reference.safetensors", tmp_path / "nodim.safetensors", drop_dim)
    assert main(["model", "parity", str(path)]) == 2
    assert "'dim' is missing" in capsys.readouterr().err

    def wrong_shape(t, meta):
        t["weights.blocks.0.self_attn.q.weight"] = torch.zeros(3, 3)

    path = _copy_with(fixtures_dir / "wan22_dit_tiny_reference.safetensors", tmp_path / "shape.safetensors", wrong_shape)
    assert main(["model", "parity", str(path)]) == 2
    err = capsys.readouterr().err
    assert "shape mismatch" in err and "blocks.0.self_attn.q.weight" in err


def test_parity_reads_dims_from_metadata_not_constants(fixtures_dir, tmp_path, capsys):
    """A fixture of other dims: regenerate the DiT fixture's outputs with a different depth."""
    from dzmodel.model.parity import dit_args_from_metadata
    from dzmodel.model.wan_dit import WanModel

    src = fixtures_dir / "wan22_dit_tiny_reference.safetensors"
    tensors = load_file(str(src))
    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata())
    meta["num_layers"] = "1"
    model = WanModel(dit_args_from_metadata(meta))
    weights = {k: v for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = model(tensors["input.x"][None], tensors["input.t"], tensors["input.context"][None])[0]
    new = {f"weights.{k}": v for k, v in weights.items()}
    new.update({k: v for k, v in tensors.items() if k.startswith("input.")})
    new["output.x"] = out
    path = tmp_path / "one_layer.safetensors"
    save_file(new, str(path), metadata=meta)
    assert main(["model", "parity", str(path)]) == 0


def test_model_info_lists_presets(capsys):
    assert main(["model", "info"]) == 0
    out = capsys.readouterr().out
    assert "dreamzero_5b" in out and "5,606,692,832" in out and "16,484,292,448" in out
    assert main(["model", "info", "--preset", "bogus"]) == 2


def test_model_manifest_checks_all_six_entries(capsys):
    assert main(["model", "manifest"]) == 0
    out = capsys.readouterr().out
    for entry in ("wan2.2_ti2v_5b_dit", "wan2.1_i2v_14b_dit", "wan2.2_vae", "wan2.1_vae", "umt5_xxl_encoder",
                  "wan2.1_clip_xlm_roberta_vit_h_14_visual"):
        assert f"{entry}: identical" in out


def test_model_tokenizer_builds_a_loadable_directory(tmp_path, capsys):
    from dzmodel.model.tokenizer import load_tokenizer

    assert main(["model", "tokenizer", str(tmp_path / "tok")]) == 0
    assert "640-token tokenizer" in capsys.readouterr().out
    ids, mask = load_tokenizer(tmp_path / "tok")(["open the drawer"], max_length=8)
    assert ids.shape == (1, 8) and int(mask.sum()) >= 2


def test_serve_deploys_upstreams_dit_schedule_at_16_steps_only():
    """dz serve's default ('auto'): 8 of 16 DiT forwards at 16 solver steps; every step at other counts, so
    `--solver-steps 4` works without also passing --dit-steps; a bad schedule is one CLI error."""
    import argparse

    import pytest

    from dzmodel.clitools import CLIError
    from dzmodel.model.cli import solver_from

    ns = argparse.Namespace(solver_steps=16, cfg_scale=5.0, dit_steps="auto")
    assert solver_from(ns).dit_forwards == 8
    assert solver_from(argparse.Namespace(solver_steps=4, cfg_scale=5.0, dit_steps="auto")).dit_forwards == 4
    with pytest.raises(CLIError, match="dit-steps"):
        solver_from(argparse.Namespace(solver_steps=4, cfg_scale=5.0, dit_steps="TTX"))


def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    """A user error is one line; a stray ValueError also says how to see where it came from; --debug raises."""
    import pytest

    from dzmodel import cli
    from dzmodel import pipeline_cli

    assert cli.main(["eval", "oracle", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dz: error:")

    def buggy(ns):
        raise ValueError("shapes do not match")

    monkeypatch.setattr(pipeline_cli, "cmd_params_check", buggy)  # the parser is built inside main, after this
    assert cli.main(["params", "check"]) == cli.EXIT_USAGE
    assert "--debug" in capsys.readouterr().err
    with pytest.raises(ValueError, match="shapes do not match"):
        cli.main(["--debug", "params", "check"])


def test_a_failed_stage_is_one_line_and_another_runtime_error_is_not_hidden(monkeypatch, capsys):
    """A stage's own failure (StageError) is one line and exit 1; any other RuntimeError (e.g. Prefect's server
    not starting) propagates as itself, not as an error of the error handler."""
    import pytest

    from dzmodel import cli
    from dzmodel import pipeline_cli
    from dzmodel.stages.common import StageError

    def failed(ns):
        raise StageError("train: torchrun exited with code 1")

    monkeypatch.setattr(pipeline_cli, "cmd_params_check", failed)
    assert cli.main(["params", "check"]) == cli.EXIT_FAIL
    assert capsys.readouterr().err.strip() == "dz: error: train: torchrun exited with code 1"

    def timed_out(ns):
        raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")

    monkeypatch.setattr(pipeline_cli, "cmd_params_check", timed_out)
    with pytest.raises(RuntimeError, match="ephemeral Prefect API server"):
        cli.main(["params", "check"])


def test_a_broken_plugin_command_says_what_is_missing(monkeypatch, capsys):
    import importlib.metadata

    from dzmodel import cli

    class BrokenEntryPoint:
        name, value = "pipeline", "flows.commands:register"

        def load(self):
            raise ModuleNotFoundError("No module named 'prefect'", name="prefect")

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [BrokenEntryPoint()])
    assert cli.main(["pipeline", "run"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "dz pipeline" in err and "prefect" in err and "make setup" in err
