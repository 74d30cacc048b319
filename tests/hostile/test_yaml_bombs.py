"""YAML alias bombs ("billion laughs": nine lists of nine aliases of the one before, 9^9 values if expanded) in
params.yaml, in a `--set` value and in an embodiment file: each is one error line, quickly, in little memory. The
loader keeps aliased values shared and caps the aliases, nodes and depth of a document; nothing that checks the
values walks a shared value twice or renders a whole value into a message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dzmodel.config import ParamsError, apply_overrides, load_params
from dzmodel.schema import SchemaError, bounded_repr, build, load_yaml
from tests.hostile.guarded import run_guarded

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ROOT / "params.yaml"
MAX_SECONDS, MAX_GROWTH_MB = 2.0, 300


def laughs(levels: int = 9, width: int = 9) -> str:
    """A flow list holding the whole bomb: [&l0 [lol, ...], &l1 [*l0, ...], ..., &l8 [*l7, ...]]."""
    rows = ["&l0 [" + ", ".join(["lol"] * width) + "]"]
    rows += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(rows) + "]"


def _params_with(old: str, new: str, tmp_path: Path) -> Path:
    text = PARAMS.read_text()
    assert old in text
    path = tmp_path / "params.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


def _one_line_refusal(outcome, *expected: str) -> str:
    assert not outcome.killed, outcome.killed + "\n" + outcome.out[-2000:]
    lines = outcome.lines()
    assert outcome.rc == 0 and lines and lines[0].startswith("REFUSED "), outcome.out[-3000:]
    message = lines[0][len("REFUSED "):]
    assert "\n" not in message and len(message) < 600, message
    for text in expected:
        assert text in message, message
    assert outcome.elapsed < MAX_SECONDS, outcome.out
    assert outcome.growth_mb < MAX_GROWTH_MB, outcome.out
    return message


def _check_params(path: Path, *sets: str):
    return run_guarded(
        # the shipped file first: the imports it needs are not measured
        f"from dzmodel.config import ParamsError, load_params\nload_params({str(PARAMS)!r})\n",
        f"""
        try:
            load_params({str(path)!r}, overrides={list(sets)!r})
            print("ACCEPTED")
        except ParamsError as exc:
            print("REFUSED " + str(exc).replace(chr(10), " | "))
        """)


@pytest.mark.parametrize("old, new, field", [
    ("      lr: 3.0e-3", "      lr: " + laughs(), "params.yaml"),                  # a number field
    ("      tasks:\n      - 0\n", "      tasks: " + laughs() + "\n", "params.yaml"),  # a list field
    ("        workspace_min:\n        - 0.2\n        - -0.4\n        - 0.05\n",  # free-form
     "        workspace_min: " + laughs() + "\n", "params.yaml"),
])
def test_a_bomb_in_a_params_field_is_one_quick_line(tmp_path, old, new, field):
    message = _one_line_refusal(_check_params(_params_with(old, new, tmp_path)), field)
    assert "lol" not in message or message.count("lol") < 20, message


def test_a_bomb_as_a_set_value_is_refused_before_it_is_built(tmp_path):
    message = _one_line_refusal(_check_params(PARAMS, "train.betas=" + laughs()), "train.betas")
    assert "alias" in message


@pytest.mark.parametrize("field", ["view_size", "layout", "prompt_template"])
def test_a_bomb_in_an_embodiment_file_is_one_quick_line(tmp_path, field):
    path = tmp_path / "robots.yaml"
    entry = yaml.safe_load((ROOT / "dzmodel/data/embodiments.yaml").read_text())["libero_sim"]
    entry.pop(field, None)
    path.write_text(yaml.safe_dump({"bomb_bot": entry}) + f"  {field}: " + laughs() + "\n")
    outcome = run_guarded(
        "from dzmodel.data.embodiments import load_embodiments, get_embodiment\nfrom dzmodel.data.errors import DataError\n"
        "get_embodiment('libero_sim', load_embodiments())\n",
        f"""
        try:
            get_embodiment("bomb_bot", load_embodiments([{str(path)!r}]))
            print("ACCEPTED")
        except DataError as exc:
            print("REFUSED " + str(exc).replace(chr(10), " | "))
        """)
    _one_line_refusal(outcome, str(path), field)


def test_the_existing_anchors_and_merges_still_load():
    """The shipped embodiments use anchors and `<<:` merges; params.yaml loads as before."""
    assert load_yaml((ROOT / "dzmodel/data/embodiments.yaml").read_text()) == \
        yaml.safe_load((ROOT / "dzmodel/data/embodiments.yaml").read_text())
    assert load_params(PARAMS).profile == "demo"
    # YAML 1.2 numbers in params.yaml and --set values: 1e-5 is a number
    raw = apply_overrides({"profile": "demo", "profiles": {"demo": {}}}, ["train.lr=1e-5"], "demo")
    assert raw["profiles"]["demo"]["train"]["lr"] == 1e-5


def test_a_recursive_alias_and_deep_nesting_are_refused_as_yaml_errors():
    with pytest.raises(yaml.YAMLError, match="refers to itself"):
        load_yaml("a: &a [1, *a]")
    with pytest.raises(yaml.YAMLError, match="nested deeper than"):
        load_yaml("a: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(yaml.YAMLError, match="aliases"):
        load_yaml("a: &a 1\nb: [" + ", ".join(["*a"] * 20000) + "]")
    with pytest.raises(yaml.YAMLError, match="alias"):
        load_yaml("&a [1]", aliases=False)


def test_a_set_value_with_an_alias_names_the_override():
    with pytest.raises(ParamsError, match=r"override 'train.lr=&x 1': .*alias"):
        apply_overrides({"profile": "demo", "profiles": {"demo": {}}}, ["train.lr=&x 1"], "demo")


def test_messages_never_render_a_whole_value():
    shared: list = ["lol"] * 9
    for _ in range(8):
        shared = [shared] * 9
    assert len(bounded_repr(shared)) <= 200

    from dataclasses import dataclass, field

    @dataclass
    class Box:
        rate: float = 0.1
        rows: list[list[int]] = field(default_factory=list)

    with pytest.raises(SchemaError) as exc:
        build(Box, {"rate": shared})
    assert len(str(exc.value)) < 300
    # a shared list of lists is checked once: 2000 rows, each the same row of 10^4 integers
    import time

    row = list(range(10_000))
    start = time.perf_counter()
    box = build(Box, {"rows": [row] * 2000})
    assert time.perf_counter() - start < 1.0
    assert len(box.rows) == 2000 and box.rows[0] is box.rows[1999]
