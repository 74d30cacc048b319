"""`dvc exp run -S KEY=VALUE` rewrites params.yaml through DVC's own serializer (dvc.utils.hydra.apply_overrides:
ruamel.yaml round trip, then a dump of the whole file). params.yaml is kept in the layout that dump writes, so an
experiment's `git diff params.yaml` is the one line it set, comments and all other values untouched."""

from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"


def _dvc_set(tmp_path: Path, *overrides: str) -> tuple[str, str]:
    """(before, after): params.yaml's text, and the text DVC's `-S` code leaves after applying `overrides`."""
    from dvc.utils.hydra import apply_overrides

    path = tmp_path / "params.yaml"
    shutil.copy(PARAMS, path)
    apply_overrides(str(path), list(overrides))
    return PARAMS.read_text(), path.read_text()


def _changed(before: str, after: str) -> list[str]:
    return [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_set_param_lr_changes_exactly_that_line(tmp_path):
    before, after = _dvc_set(tmp_path, "profiles.demo.train.lr=2e-3")
    assert _changed(before, after) == ["-      lr: 3.0e-3", "+      lr: 0.002"]
    assert yaml.safe_load(after)["profiles"]["demo"]["train"]["lr"] == 0.002


@pytest.mark.parametrize("override, line", [
    ("profile=droid", "profile: droid"),
    ("profiles.demo.promote.min_success=0.5", "      min_success: 0.5"),  # a null, set
    ("profiles.demo.package.robot.control_rate_hz=20", "        control_rate_hz: 20"),
    ("profiles.demo.train.model_overrides.num_action_per_block=8", "      model_overrides: {num_action_per_block: 8}"),
])
def test_set_param_changes_one_line(tmp_path, override, line):
    before, after = _dvc_set(tmp_path, override)
    changed = _changed(before, after)
    assert len(changed) == 2 and changed[1] == f"+{line}", changed


def test_params_yaml_is_a_fixed_point_of_dvcs_rewrite(tmp_path):
    """No override at all: DVC's dump of params.yaml is params.yaml, byte for byte (every line of every profile,
    not only those the tests above set)."""
    before, after = _dvc_set(tmp_path)
    assert _changed(before, after) == []
    assert after == before


def test_the_format_script_checks_and_restores_the_layout(tmp_path):
    """`infra/dvc/params_format.py --check` fails on a hand edit in another layout; without --check it restores
    DVC's layout with the same values and comments."""
    script = ROOT / "infra" / "dvc" / "params_format.py"
    edited = tmp_path / "params.yaml"
    text = PARAMS.read_text()
    hand = text.replace("      tokenizer:\n", "      tokenizer: null   # a hand edit\n", 1)
    assert hand != text
    edited.write_text(hand)
    check = subprocess.run([sys.executable, str(script), "--check", str(edited)], capture_output=True, text=True)
    assert check.returncode == 1 and "would rewrite" in check.stderr
    subprocess.run([sys.executable, str(script), str(edited)], check=True, capture_output=True)
    assert yaml.safe_load(edited.read_text()) == yaml.safe_load(hand)
    assert "# a hand edit" in edited.read_text()
    ok = subprocess.run([sys.executable, str(script), "--check", str(edited)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
