"""Absurd model dimensions: a converted model whose config.json asks for a huge text context, and params.yaml model
overrides past what a device holds, are refused by name before anything is allocated; the presets still pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dzmodel.cli import main
from dzmodel.model.args import DREAMZERO_PRESETS, PRESETS, DreamZeroArgs, preset
from dzmodel.model.state_dict import StateDictError, read_config, save_dreamzero_dir
from tests.hostile.guarded import run_guarded

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ROOT / "params.yaml"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    from dzmodel.model.wam import DreamZeroWAM

    return save_dreamzero_dir(DreamZeroWAM(preset("tiny")), tmp_path_factory.mktemp("m") / "model")


def _with_config(converted: Path, tmp_path: Path, **edits) -> Path:
    import shutil

    out = shutil.copytree(converted, tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    config["args"].update(edits)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("text_len", [1e8, 100_000_000])
def test_a_huge_text_len_in_config_json_is_refused_at_load(converted, tmp_path, text_len):
    model_dir = _with_config(converted, tmp_path, text_len=text_len)
    outcome = run_guarded(
        "import torch\nfrom dzmodel.model.state_dict import StateDictError, load_dreamzero_dir\n",
        f"""
        try:
            model = load_dreamzero_dir({str(model_dir)!r})
            print("ACCEPTED")
        except StateDictError as exc:
            print("REFUSED " + str(exc))
        """)
    assert not outcome.killed, outcome.killed
    first = outcome.lines()[0]
    assert first.startswith(f"REFUSED {model_dir}/config.json: text_len: "), outcome.out
    assert "100000000" in first or "1e+08" in first
    assert outcome.elapsed < 1.0 and outcome.growth_mb < 300, outcome.out


@pytest.mark.parametrize("field, value, words", [
    ("dim", 64.0, "dim: expected an integer, got float 64.0"),
    ("num_layers", True, "num_layers: expected an integer, got bool True"),
    ("num_heads", "2", "num_heads: expected an integer, got str '2'"),
    ("ffn_dim", -1, "ffn_dim: must be in [1, 262144], got -1"),
    ("patch_size", [1, 2], "patch_size: expected a list of 3 values, got 2"),
    ("eps", float("nan"), "eps: must be a finite number"),
])
def test_each_field_of_config_json_is_typed_and_bounded(converted, tmp_path, field, value, words):
    model_dir = _with_config(converted, tmp_path, **{field: value})
    with pytest.raises(StateDictError) as exc:
        read_config(model_dir)
    assert str(exc.value).startswith(f"{model_dir}/config.json: {field}"), exc.value
    assert words in str(exc.value)


def test_dimensions_past_the_device_limit_are_refused_with_the_estimate(converted, tmp_path, monkeypatch):
    model_dir = _with_config(converted, tmp_path, dim=16384, num_heads=128, ffn_dim=65536, num_layers=512)
    with pytest.raises(StateDictError) as exc:
        read_config(model_dir)
    message = str(exc.value)
    assert message.startswith(f"{model_dir}/config.json: ") and "over the limit of" in message
    assert "DZ_MAX_MODEL_BYTES" in message and "parameters" in message
    # the limit is a setting
    monkeypatch.setenv("DZ_MAX_MODEL_BYTES", "1000000")
    with pytest.raises(ValueError, match="over the limit of 1.0 MB"):
        preset("small")
    monkeypatch.setenv("DZ_MAX_MODEL_BYTES", "lots")
    with pytest.raises(ValueError, match="DZ_MAX_MODEL_BYTES"):
        preset("tiny")


def _params_check(tmp_path, capsys, overrides: str = "", sets: tuple[str, ...] = ()) -> tuple[int, str]:
    path = tmp_path / "params.yaml"
    text = PARAMS.read_text()
    if overrides:
        text = text.replace("      model_overrides: {num_action_per_block: 16}",
                            "      model_overrides: {num_action_per_block: 16, " + overrides + "}", 1)
    path.write_text(text)
    args = ["params", "check", "--params", str(path)]
    for item in sets:
        args += ["--set", item]
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("overrides, sets, words", [
    ("dim: 1e10", (), "profiles.demo.train.model_overrides.dim: expected an integer, got float 10000000000.0"),
    ("dim: 10000000000", (), "profiles.demo.train.model_overrides.dim: must be in [1, 65536], got 10000000000"),
    ("", ("train.model_overrides.text_len=100000000",), "--set train.model_overrides.text_len=100000000: must be"),
    ("dim: 16384, num_heads: 128, num_layers: 512, ffn_dim: 65536", (),
     "profiles.demo.train.model_overrides: dim 16384, ffn_dim 65536, num_layers 512: needs ~"),
])
def test_params_check_refuses_absurd_model_overrides_by_name(tmp_path, capsys, overrides, sets, words):
    code, out = _params_check(tmp_path, capsys, overrides, sets)
    assert code != 0 and words in out, out


def test_every_preset_still_builds_and_its_size_is_counted():
    from dzmodel.model.wam import DreamZeroWAM
    from dzmodel.model.wan_dit import WanModel

    import torch

    for name in PRESETS:
        args = preset(name)
        with torch.device("meta"):
            model = DreamZeroWAM(args) if isinstance(args, DreamZeroArgs) else WanModel(args)
        assert args.param_count() == sum(p.numel() for p in model.parameters()), name
    assert 14e9 < preset("dreamzero_14b").param_count() < 18e9
    assert set(DREAMZERO_PRESETS) <= set(PRESETS)
    assert preset("dreamzero_14b").serving_bytes() < 60e9  # bf16 weights and one request, under the default limit
