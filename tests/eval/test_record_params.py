"""The LIBERO recording's parameters are declared once (dzmodel/eval/record_params.py): params.yaml's `fetch.record:`
section, the recorder's RecordConfig and `dz data record libero`'s options all carry RecordParams' fields under the
same names, ranges, defaults and help, and the fetch stage hands the recorder the options it always did."""

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from dzmodel.cli import build_parser
from dzmodel.config import ParamsError, StagePaths, load_params, parse_params, read_yaml
from dzmodel.data.errors import DataError
from dzmodel.eval.libero_record import RecordConfig
from dzmodel.eval.record_params import RecordParams, option

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {f.name: f for f in dataclasses.fields(RecordParams)}
# `dz data record libero`'s options that are no RecordParams field: the output, and what only the recorder takes
NOT_PARAMS = {"help", "out", "overwrite", "no_progress", "seed", "dagger", "dagger_beta", "actions_per_chunk",
              "device", "solver_steps", "cfg_scale", "keep"}


def _record_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for word in ("data", "record", "libero"):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_config_and_the_recorder_use_the_one_declaration():
    from dzmodel import config

    assert config.RecordParams is RecordParams and config.FetchParams().record == RecordParams()
    own = {f.name: f for f in dataclasses.fields(RecordConfig)}
    for name, f in FIELDS.items():
        assert own[name].metadata == f.metadata and own[name].default == f.default, name
    assert {name: getattr(RecordConfig(), name) for name in FIELDS} == {n: _default(f) for n, f in FIELDS.items()}


def test_every_field_is_an_option_of_dz_data_record_libero_with_its_default_and_help():
    actions = {a.dest: a for a in _record_parser()._actions}
    for name, f in FIELDS.items():
        assert name in actions, f"RecordParams.{name} is no option of dz data record libero"
        action = actions[name]
        assert action.option_strings == [option(name)] and action.help == f.metadata["help"], name
        assert action.default == _default(f), name
        assert list(action.choices or ()) == list(f.metadata.get("choices", ())), name


def test_every_option_of_dz_data_record_libero_is_a_field_or_the_recorders_own():
    extra = {a.dest for a in _record_parser()._actions} - set(FIELDS) - NOT_PARAMS
    assert extra == set(), f"options of dz data record libero that params.yaml's fetch.record cannot set: {extra}"
    assert NOT_PARAMS.isdisjoint(FIELDS)


def test_the_options_reach_the_recorder_under_the_field_names():
    from dzmodel.eval.cli import record_options

    parser = _record_parser()
    defaults = RecordConfig(**record_options(parser.parse_args(["--out", "x"])))
    assert defaults == RecordConfig()
    ns = parser.parse_args(["--suite", "goal", "--tasks", "1,3", "--episodes", "7", "--init", "perturbed",
                            "--max-shift-m", "0.03", "--min-shift-m", "0.015", "--dart-noise", "0.6", "--retries",
                            "3", "--retry-noise-scale", "0.5", "--noise-pilot", "10", "--max-steps", "400",
                            "--image-size", "128", "--workers", "3", "--codec", "libx264", "--gop", "16",
                            "--out", "x"])
    given = dict(suite="goal", tasks=[1, 3], episodes=7, init="perturbed", max_shift_m=0.03, min_shift_m=0.015,
                 dart_noise=0.6, retries=3, retry_noise_scale=0.5, noise_pilot=10, max_steps=400, image_size=128,
                 workers=3, codec="libx264", gop=16)
    assert sorted(given) == sorted(FIELDS) and record_options(ns) == given
    # the spellings of before: --max-shift and --min-shift (abbreviations), --codec av1 | h264
    old = parser.parse_args(["--max-shift", "0.04", "--min-shift", "0.01", "--codec", "h264", "--out", "x"])
    assert (old.max_shift_m, old.min_shift_m, old.codec) == (0.04, 0.01, "libx264")
    assert parser.parse_args(["--codec", "av1", "--out", "x"]).codec == "libsvtav1"


@pytest.mark.parametrize("field, value, option_words, params_words", [
    ("max_shift_m", 0.5, "--max-shift-m: must be in [0, 0.1], got 0.5",
     "fetch.record.max_shift_m: must be in [0, 0.1]"),
    ("codec", "vp9", "--codec: must be one of 'libsvtav1', 'libx264'", "fetch.record.codec: must be one of"),
    ("image_size", 129, "--image-size: must be even", "fetch.record.image_size: must be even"),
    ("noise_pilot", 2, "--noise-pilot 2: chooses the σ a task's starts begin at, so it needs --dart-noise > 0",
     "fetch.record.noise_pilot 2: chooses the σ a task's starts begin at, so it needs dart_noise > 0"),
])
def test_params_yaml_and_the_recorder_refuse_the_same_values_by_the_field(field, value, option_words, params_words):
    with pytest.raises(DataError, match=re.escape(option_words)):
        RecordConfig(**{field: value})
    raw = read_yaml(ROOT / "params.yaml")
    raw["profiles"]["libero_scripted"]["fetch"]["record"][field] = value
    with pytest.raises(ParamsError, match=re.escape("profiles.libero_scripted." + params_words)):
        parse_params(raw)


# What the fetch stage handed the recorder (its cache marker's record_kwargs) before the fields were declared once:
# fields added later are absent at their defaults, min_shift_m with standard starts
BEFORE = {
    "libero_object": {"suite": "object", "tasks": list(range(10)), "episodes": 50, "init": "perturbed",
                      "max_shift_m": 0.03, "min_shift_m": 0.015, "dart_noise": 0.6, "image_size": 128, "workers": 0,
                      "codec": "libx264", "gop": 16, "seed": 0},
    "libero_goal": {"suite": "goal", "tasks": list(range(10)), "episodes": 50, "init": "perturbed", "max_shift_m": 0.03,
                    "min_shift_m": 0.015, "dart_noise": 0.6, "retries": 3, "retry_noise_scale": 0.5, "noise_pilot": 10,
                    "image_size": 128, "workers": 0, "codec": "libx264", "gop": 16, "seed": 0},
    "libero_scripted": {"suite": "object", "tasks": [0, 1, 2, 3], "episodes": 50, "init": "perturbed",
                        "max_shift_m": 0.03, "min_shift_m": None, "image_size": 128, "workers": 2, "codec": "libx264",
                        "gop": 16, "seed": 0},
}


def _before(record: RecordParams, seed: int) -> dict:
    """The fetch stage's record_kwargs as it built them by hand, before `RecordParams.recorder_options`."""
    out = dict({f.name: getattr(record, f.name) for f in dataclasses.fields(RecordParams)}, seed=seed)
    for name, default in (("dart_noise", 0), ("max_steps", None), ("retries", 0), ("retry_noise_scale", 1),
                          ("noise_pilot", 0)):
        if out.get(name) == default:
            out.pop(name)
    if out.get("init") == "standard":
        out.pop("min_shift_m", None)
    return out


def _handed(monkeypatch, tmp_path, profile: str, overrides=()) -> dict:
    import dzmodel.data.fetch as fetch
    from dzmodel.stages.fetch import stage_fetch

    seen = []

    def fake_fetch(source, dest_root, record_kwargs=None, **kw):
        seen.append(record_kwargs)
        raise RuntimeError("stop")

    monkeypatch.setattr(fetch, "fetch_dataset", fake_fetch)
    prof = load_params(ROOT / "params.yaml", list(overrides), profile).selected(profile)
    with pytest.raises(RuntimeError, match="stop"):
        stage_fetch(prof, StagePaths(tmp_path, profile), log=lambda s: None)
    return seen[0]


def test_the_fetch_stage_hands_the_recorder_the_options_it_did_before(monkeypatch, tmp_path):
    params = load_params(ROOT / "params.yaml")
    libero = [name for name, prof in params.profiles.items() if prof.fetch.source == "libero"]
    assert set(BEFORE) <= set(libero)
    for name in libero:
        prof = params.profiles[name]
        handed = _handed(monkeypatch, tmp_path, name)
        assert handed == _before(prof.fetch.record, prof.fetch.seed), name
        if name in BEFORE:
            assert handed == BEFORE[name], name
    for overrides in (["fetch.record.init=standard", "fetch.record.min_shift_m=0.01"],
                      ["fetch.record.max_steps=500", "fetch.record.retries=0", "fetch.record.noise_pilot=0"],
                      ["fetch.record.init=sampled", "fetch.record.min_shift_m=null", "fetch.record.dart_noise=0",
                       "fetch.record.noise_pilot=0", "fetch.record.retry_noise_scale=1"]):
        handed = _handed(monkeypatch, tmp_path, "libero_goal", overrides)
        prof = load_params(ROOT / "params.yaml", overrides, "libero_goal").selected("libero_goal")
        assert handed == _before(prof.fetch.record, prof.fetch.seed), overrides
