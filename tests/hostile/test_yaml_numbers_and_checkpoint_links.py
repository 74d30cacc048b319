"""Numbers YAML builds slowly or too large, documents past the size cap, and a planted path at a checkpoint's
temporary name.

YAML 1.1 reads `1:59:59:...` as one sexagesimal integer, built by a big-integer multiply per part: quadratic CPU
for a one-line scalar. Such numbers are refused, as is any integer or float written with more than 100
characters (a 4000-digit hex integer would otherwise reach Python's digit limit in some later message), and a
document over the loader's size cap (1 MiB by default) is refused before it is scanned. Each refusal is one line
naming the file or the override, with the line and column.

A checkpoint is built in a fresh temporary directory of its own, never at a fixed name: a link or file planted
where a temporary could go does not stop training, and the stale sweep removes a link without following it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from dzmodel.config import ParamsError, apply_overrides, load_params
from dzmodel.data.embodiments import load_embodiments
from dzmodel.data.errors import DataError
from dzmodel.schema import load_yaml
from dzmodel.train.checkpoint import latest_checkpoint, list_checkpoints, save_checkpoint
from tests.hostile.guarded import run_guarded

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ROOT / "params.yaml"


def _params_with_steps(value: str, tmp_path: Path) -> Path:
    """params.yaml with the selected profile's train.steps written as `value`."""
    raw = yaml.safe_load(PARAMS.read_text())
    text = PARAMS.read_text()
    name = raw["profile"]
    steps = raw["profiles"][name]["train"]["steps"]
    head, sep, tail = text.partition(f"\n  {name}:\n")
    assert sep, "the selected profile is not where this test expects it"
    before, found, after = tail.partition(f"steps: {steps}\n")
    assert found
    path = tmp_path / "params.yaml"
    path.write_text(head + sep + before + f"steps: {value}\n" + after)
    return path


def _one_line(message: str, *expected: str) -> None:
    assert "\n" not in message and len(message) < 600, message
    for text in expected:
        assert text in message, message


# --- sexagesimal numbers -----------------------------------------------------------------------------------------

def test_a_300_kib_sexagesimal_integer_is_refused_in_under_a_second(tmp_path):
    path = _params_with_steps("1" + ":59" * 100_000, tmp_path)
    assert path.stat().st_size > 300_000
    outcome = run_guarded(
        f"from dzmodel.config import ParamsError, load_params\nload_params({str(PARAMS)!r})\n",
        f"""
        cpu = time.process_time()
        try:
            load_params({str(path)!r})
            print("ACCEPTED")
        except ParamsError as exc:
            print("REFUSED " + str(exc).replace(chr(10), " | "))
        print(f"CPU {{time.process_time() - cpu:.3f}}")
        """, timeout_s=30)
    assert not outcome.killed, outcome.killed
    lines = outcome.lines()
    assert lines and lines[0].startswith("REFUSED "), outcome.out[-2000:]
    _one_line(lines[0], str(path), "line ", "column ", "sexagesimal")
    cpu = float(lines[-1].split()[1])
    # CPU time (other processes on a busy machine do not count), with a wall-clock bound for the rest
    assert cpu < 1.0 and outcome.elapsed < 3.0, outcome.out


@pytest.mark.parametrize("value, word", [
    *((v, "sexagesimal") for v in ("1:30", "-1:30", "1:30.5", "190:20:30", "!!int '1:30'")),
    *((v, "100 characters") for v in ("9" * 200, "0x" + "f" * 200, "0b" + "1" * 200, "1." + "5" * 200,
                                      "1" * 120 + ".0e5")),
])
def test_a_sexagesimal_or_over_long_number_in_params_is_refused_with_where_it_is(value, word, tmp_path):
    path = _params_with_steps(value, tmp_path)
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    _one_line(str(caught.value), str(path), "line ", "column ", word)


def test_quoted_colon_strings_and_ports_stay_strings():
    assert load_yaml("a: '1:30'\nb: host:5555\nc: 10.0.0.1:5555\nd: 12:345\n") == {
        "a": "1:30", "b": "host:5555", "c": "10.0.0.1:5555", "d": "12:345"}


# --- number length ----------------------------------------------------------------------------------------------

def test_a_4000_digit_hex_override_names_the_override():
    raw = yaml.safe_load(PARAMS.read_text())
    item = "train.steps=0x" + "f" * 4000
    with pytest.raises(ParamsError) as caught:
        apply_overrides(raw, [item], raw["profile"])
    message = str(caught.value)
    _one_line(message, "override 'train.steps=0xfff", "100 characters")
    assert "4300" not in message


def test_a_4000_digit_hex_override_through_the_cli(capsys):
    from dzmodel.cli import main

    rc = main(["params", "check", "--params", str(PARAMS), "--set", "train.steps=0x" + "f" * 4000])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    _one_line(err.splitlines()[-1], "train.steps", "100 characters")
    assert "4300" not in err


def test_numbers_up_to_100_characters_still_load():
    assert load_yaml("a: " + "9" * 100) == {"a": int("9" * 100)}
    assert load_yaml("a: 0x" + "f" * 98) == {"a": int("f" * 98, 16)}
    assert load_yaml("a: 1.5e-5", yaml12_numbers=True) == {"a": 1.5e-5}


# --- document size ----------------------------------------------------------------------------------------------

def test_a_document_over_the_size_cap_is_refused_before_it_is_scanned(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS.read_text() + "# " + "x" * (2 * 1024 * 1024) + "\n")
    outcome = run_guarded(
        f"from dzmodel.config import ParamsError, load_params\nload_params({str(PARAMS)!r})\n",
        f"""
        try:
            load_params({str(path)!r})
            print("ACCEPTED")
        except ParamsError as exc:
            print("REFUSED " + str(exc).replace(chr(10), " | "))
        """, timeout_s=30)
    assert not outcome.killed, outcome.killed
    lines = outcome.lines()
    assert lines and lines[0].startswith("REFUSED "), outcome.out[-2000:]
    _one_line(lines[0], str(path), "MiB")
    assert outcome.elapsed < 0.5, outcome.out


def test_load_yaml_caps_text_and_paths_and_the_cap_can_be_set(tmp_path):
    text = "a: " + "x" * 2_000_000
    with pytest.raises(yaml.YAMLError, match="MiB"):
        load_yaml(text)
    assert load_yaml(text, max_bytes=3_000_000) == {"a": "x" * 2_000_000}
    with pytest.raises(yaml.YAMLError, match="larger than the 100 bytes"):
        load_yaml("a: " + "é" * 60, max_bytes=100)  # 63 characters, 123 bytes
    path = tmp_path / "doc.yaml"
    path.write_text(text)
    with pytest.raises(yaml.YAMLError, match="MiB"):
        load_yaml(path)
    path.write_text("a: 1\n")
    assert load_yaml(path) == {"a": 1}


@pytest.mark.parametrize("text, word", [
    ("my_robot:\n  control_hz: 1" + ":59" * 100_000 + "\n", "sexagesimal"),
    ("my_robot: {}\n# " + "x" * (2 * 1024 * 1024) + "\n", "MiB"),
], ids=["sexagesimal", "over-the-cap"])
def test_an_embodiment_file_with_a_slow_number_or_over_the_cap_is_one_error_line(tmp_path, text, word):
    path = tmp_path / "robot.yaml"
    path.write_text(text)
    with pytest.raises(DataError) as caught:
        load_embodiments([path])
    _one_line(str(caught.value), str(path), word)


# --- checkpoints ------------------------------------------------------------------------------------------------

def _save(out: Path, step: int) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    return save_checkpoint(out, step, model, opt, {"step": step}, {"cpu": torch.get_rng_state()})


def _users_dir(tmp_path: Path) -> Path:
    victim = tmp_path / "users_dir"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    return victim


@pytest.mark.parametrize("planted", ["step_0000010.tmp", "step_0000010"], ids=["temporary-name", "checkpoint-name"])
def test_a_link_to_a_users_directory_is_replaced_not_followed(tmp_path, planted):
    victim = _users_dir(tmp_path)
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / planted).symlink_to(victim, target_is_directory=True)
    final = _save(tmp_path / "run", 10)
    assert final == root / "step_0000010" and (final / "COMPLETE").is_file() and not final.is_symlink()
    assert latest_checkpoint(tmp_path / "run") == final
    assert not os.path.lexists(root / "step_0000010.tmp")  # a link is swept, its target is not
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (victim / "keep.txt").read_text() == "mine"


def test_a_file_or_a_link_to_a_file_at_a_temporary_name_is_swept(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("mine")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "step_0000010.tmp").write_text("planted")
    (root / "step_0000020.tmp").symlink_to(victim)
    assert (_save(tmp_path / "run", 10) / "COMPLETE").is_file()
    assert not list(root.glob("*.tmp"))
    assert victim.read_text() == "mine"


def test_a_torn_temporary_is_never_a_checkpoint_and_is_swept_by_the_next_save(tmp_path):
    out = tmp_path / "run"
    first = _save(out, 10)
    torn = out / "checkpoints" / "step_0000020.k3j4x9.tmp"
    torn.mkdir()
    (torn / "COMPLETE").write_text("20")  # even with the marker, a temporary is never loaded
    assert list_checkpoints(out) == [(10, first)]
    assert latest_checkpoint(out) == first
    second = _save(out, 30)
    assert list_checkpoints(out) == [(10, first), (30, second)]
    assert not torn.exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000010", "step_0000030"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    out = tmp_path / "run"
    first = _save(out, 10)
    (first / "extra").write_text("old")
    again = _save(out, 10)
    assert again == first and not (again / "extra").exists() and (again / "COMPLETE").is_file()


def test_a_checkpoint_directory_has_the_mode_a_plain_mkdir_gives(tmp_path):
    from dzmodel.atomic import NEW_DIR_MODE

    final = _save(tmp_path / "run", 10)
    assert final.stat().st_mode & 0o777 == NEW_DIR_MODE
