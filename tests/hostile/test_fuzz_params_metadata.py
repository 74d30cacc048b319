"""Property-based fuzzing of params.yaml and of a dataset's metadata: whatever the value, the outcome is either
accepted-and-valid or one error of the project's own type that names the field (or file), never another exception."""

import copy
import dataclasses
import json
import math
import shutil
import typing
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dzmodel.config import (PIPELINE_TRAIN_FIELDS, ParamsError, Profile, StagePaths, load_params, parse_params,
                            train_config)
from dzmodel.data.errors import DataError
from dzmodel.data.metadata import compute_metadata
from dzmodel.model.lora import LoRAConfig
from dzmodel.train.config import TrainConfig
from tests.data.lerobot_writers import write_v30

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ROOT / "params.yaml"
RAW = yaml.safe_load(PARAMS.read_text())
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _numeric_fields(cls, prefix: str) -> list[str]:
    """Dotted paths of every int/float field (optional or not) of a dataclass, nested dataclasses included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if dataclasses.is_dataclass(args[0]):
            out += _numeric_fields(args[0], f"{prefix}.{f.name}")
        elif args[0] in (int, float):
            out.append(f"{prefix}.{f.name}")
    return out


SECTIONS = [f.name for f in dataclasses.fields(Profile) if dataclasses.is_dataclass(typing.get_type_hints(Profile)[f.name])]
NUMERIC_PATHS = sorted(
    [p for s in SECTIONS for p in _numeric_fields(typing.get_type_hints(Profile)[s], s)]
    + [p for p in _numeric_fields(TrainConfig, "train") if p.split(".")[1] not in PIPELINE_TRAIN_FIELDS]
    + [f"train.lora.{f.name}" for f in dataclasses.fields(LoRAConfig) if f.type in ("int", "float")]
    + ["train.nproc_per_node", "train.nnodes"])
NAME_PATHS = ["package.version", "package.name", "promote.registered_model", "promote.alias", "tracking.experiment",
              "metadata.embodiment"]

HOSTILE_NUMBERS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 1e9, -1.0, 0, 0.0, -0.0, 1, 2**63, 2**64, -2**70,
                     10**400, 5e-324]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-2**70, max_value=2**70),
    st.booleans(), st.none(), st.text(max_size=8), st.lists(st.floats(), max_size=3))


def _put(raw: dict, path: str, value) -> None:
    node = raw["profiles"]["demo"]
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _numbers(obj, path: str):
    """(path, value, the field's declared range) of every number in a dataclass, list elements one by one."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, f"{path}.{f.name}")
            continue
        for i, v in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield f"{path}.{f.name}[{i}]", v, dict(f.metadata)


def _assert_valid(params) -> None:
    """Accepted means valid: every number finite, 64-bit and inside its field's declared range; task indices inside
    their LIBERO suite; the train config built from each profile likewise."""
    for name, prof in params.profiles.items():
        cfg = train_config(prof, StagePaths(Path("."), name))
        leaves = [*(n for section in SECTIONS for n in _numbers(getattr(prof, section), section)), *_numbers(cfg, "train")]
        for path, value, meta in leaves:
            assert math.isfinite(value) and (isinstance(value, float) or abs(value) < 2**63), (path, value)
            assert value >= meta.get("min", -math.inf) and value > meta.get("gt", -math.inf), (path, value)
            assert value <= meta.get("max", math.inf) and value < meta.get("lt", math.inf), (path, value)
        assert 0 < cfg.lr <= 1 and all(0 <= b < 1 for b in cfg.betas) and cfg.weight_decay >= 0 and cfg.eps > 0
        assert 0 <= cfg.min_lr <= cfg.lr and (cfg.lora.rank == 0 or cfg.lora.alpha > 0)
        assert all(0 <= t < 10 for t in [*(prof.eval.tasks or []), *(prof.fetch.record.tasks or [])])


def test_every_numeric_field_is_fuzzed():
    assert {"train.lr", "train.betas", "train.lora.alpha", "eval.cfg_scale", "fetch.record.max_shift_m",
            "vision.lr", "promote.min_success", "train.nproc_per_node"} <= set(NUMERIC_PATHS)
    assert len(NUMERIC_PATHS) > 60


@FUZZ
@given(path=st.sampled_from(NUMERIC_PATHS), value=HOSTILE_NUMBERS)
def test_a_hostile_number_is_accepted_valid_or_refused_by_name(path, value):
    raw = copy.deepcopy(RAW)
    _put(raw, path, value)
    try:
        params = parse_params(raw, "params.yaml")
    except ParamsError as exc:
        text = str(exc)
        assert text.startswith("params.yaml: ") and path.rsplit(".", 1)[-1] in text, (path, value, text)
        return
    _assert_valid(params)


@FUZZ
@given(path=st.sampled_from(NAME_PATHS), value=st.one_of(
    st.text(max_size=12), st.sampled_from(["..", "../x", "a/b", "a\\b", ".x", "x\n", "v1.0..1", "ok-1.0+b", "é"])))
def test_a_hostile_name_is_a_plain_name_or_refused_by_name(path, value):
    raw = copy.deepcopy(RAW)
    _put(raw, path, value)
    try:
        params = parse_params(raw, "params.yaml")
    except ParamsError as exc:
        assert f"profiles.demo.{path}" in str(exc), (path, value, str(exc))
        return
    section, key = path.split(".")
    accepted = getattr(getattr(params.profiles["demo"], section), key)
    assert "/" not in accepted and "\\" not in accepted and ".." not in accepted and not accepted.startswith(".")
    assert accepted.isprintable() and accepted.strip() == accepted


@settings(FUZZ, max_examples=100)  # each example reads params.yaml
@given(path=st.sampled_from(NUMERIC_PATHS + NAME_PATHS), text=st.text(max_size=12))
def test_a_hostile_override_is_accepted_valid_or_one_params_error(path, text):
    try:
        params = load_params(PARAMS, [f"{path}={text}"], "demo")
    except ParamsError as exc:
        assert str(exc).strip(), (path, text)
        return
    _assert_valid(params)


# --- dataset metadata ------------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
INFO_FIELDS = [("fps",), ("total_frames",), ("features",), ("features", "observation.images.front"),
               ("features", "observation.images.front", "shape"), ("features", "observation.images.front", "names"),
               ("features", "observation.images.front", "dtype"), ("features", "observation.images.front", "info"),
               ("features", "observation.images.front", "info", "video.fps"), ("features", "observation.state"),
               ("features", "observation.state", "shape"), ("features", "action", "shape")]


@pytest.fixture(scope="module")
def base_dataset(tmp_path_factory):
    root = write_v30(tmp_path_factory.mktemp("fuzz") / "ds", lengths=(6, 5))
    shutil.rmtree(root / "videos")  # statistics read meta/ and data/ only
    return root


def _metadata_outcome(root: Path, out: Path) -> None:
    """compute_metadata accepts (and writes strict, finite JSON) or raises one DataError naming a file."""
    try:
        doc = compute_metadata(root, "arm", {"state": "observation.state"}, {"action": "action"}, out, progress=False)
    except DataError as exc:
        assert str(root) in str(exc) or "info.json" in str(exc) or str(out) in str(exc), str(exc)
        assert not out.exists()
        return
    written = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {out}"))
    assert written == doc


@FUZZ
@given(field=st.sampled_from(INFO_FIELDS), value=JSON_VALUES)
def test_a_hostile_info_json_field_is_accepted_or_one_data_error(base_dataset, tmp_path, field, value):
    root = tmp_path / f"ds-{abs(hash((field, repr(value))))}"
    shutil.rmtree(root, ignore_errors=True)  # hypothesis may replay an example
    shutil.copytree(base_dataset, root)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    node = info
    for key in field[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[field[-1]] = value
    info_path.write_text(json.dumps(info))  # NaN and Infinity as Python's json writes them
    _metadata_outcome(root, tmp_path / f"{root.name}.json")
    shutil.rmtree(root)


@FUZZ
@given(column=st.sampled_from(["observation.state", "action"]), row=st.integers(0, 10), dim=st.integers(0, 2),
       value=st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0]),
                       st.floats(allow_nan=True, allow_infinity=True)),
       float64=st.booleans())
def test_hostile_state_and_action_values_are_accepted_or_one_data_error(base_dataset, tmp_path, column, row, dim,
                                                                         value, float64):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / f"ds-{abs(hash((column, row, dim, repr(value), float64)))}"
    shutil.rmtree(root, ignore_errors=True)  # hypothesis may replay an example
    shutil.copytree(base_dataset, root)
    parquet = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(parquet)
    width = table[column].type.list_size
    values = np.array(table[column].combine_chunks().flatten().to_numpy(), dtype=np.float64 if float64 else np.float32)
    with np.errstate(over="ignore"):
        values[row * width + dim] = value
    array = pa.FixedSizeListArray.from_arrays(pa.array(values), width)
    pq.write_table(table.set_column(table.column_names.index(column), column, array), parquet)
    _metadata_outcome(root, tmp_path / f"{root.name}.json")
    shutil.rmtree(root)


READER_FIELDS = INFO_FIELDS + [("data_path",), ("video_path",), ("chunks_size",), ("codebase_version",),
                               ("total_episodes",), ("features", "observation.images.front", "dtype")]


@settings(FUZZ, max_examples=100)  # a CLI run per example
@given(field=st.sampled_from(READER_FIELDS), value=JSON_VALUES)
def test_data_check_on_a_hostile_info_json_is_ok_or_one_clear_error(base_dataset, tmp_path, field, value, capsys):
    from dzmodel.cli import main

    root = tmp_path / "ds"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(base_dataset, root)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["video_path"] = None  # the base copy has no videos: keep it a valid dataset without them
    for key in [k for k, f in info["features"].items() if f["dtype"] == "video"]:
        del info["features"][key]
    node = info
    for key in field[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[field[-1]] = value
    info_path.write_text(json.dumps(info))
    code = main(["data", "check", str(root)])
    err = capsys.readouterr().err
    assert code in (0, 2) and (code == 0 or err.startswith("dz: error: ")), err
    assert "dz --debug" not in err, err  # one of the project's own errors, not an unexpected ValueError
