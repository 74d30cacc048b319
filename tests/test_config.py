"""params.yaml's typed schema: the shipped file is valid; bad keys, types and values are refused by name."""

import re
import json
from pathlib import Path

import pytest
import yaml

from dzmodel.cli import main
from dzmodel.config import ParamsError, StagePaths, load_params, parse_params, train_config
from dzmodel.schema import SchemaError, build
from dzmodel.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _raw() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_shipped_params_are_valid_with_their_profiles():
    params = load_params(ROOT / "params.yaml")
    assert params.profile == "demo"
    assert set(params.profiles) == {"demo", "droid", "libero_5b", "libero_5b_lora", "droid_14b", "libero_scripted",
                                    "libero_scripted_lora", "libero_object", "libero_spatial", "libero_goal",
                                    "libero_10"}
    lora = params.selected("libero_5b_lora")
    assert lora.train["lora"]["rank"] == 64 and lora.launch["nproc_per_node"] == 1 and lora.convert.weights == "ema"
    scripted = params.selected("libero_scripted")
    assert scripted.fetch.source == "libero" and scripted.fetch.record.suite == "object"
    assert scripted.train["preset"] == "small" and scripted.metadata.embodiment == "libero_sim_small"
    assert scripted.eval.suite == "object" and scripted.eval.tasks == scripted.fetch.record.tasks
    # the LoRA arm of the comparison differs from the full one only in its adapters, learning rate and names
    scripted_lora = params.selected("libero_scripted_lora")
    assert scripted_lora.fetch == scripted.fetch and scripted_lora.metadata == scripted.metadata
    differ = {k for k in set(scripted.train) | set(scripted_lora.train)
              if scripted.train.get(k) != scripted_lora.train.get(k)}
    assert differ == {"lora", "lr"} and scripted_lora.train["lora"]["rank"] == 64
    assert scripted.train["prompt_dropout"] == 0.1  # both arms train the unconditional branch CFG would guide with
    assert scripted.promote.min_success > 0  # a gate that can fail
    # all of LIBERO-Object: 10 tasks x 50 perturbed starts, none an evaluation start; evaluated on 10 x 50
    obj = params.selected("libero_object")
    rec = obj.fetch.record
    assert rec.tasks == list(range(10)) and rec.episodes == 50 and rec.init == "perturbed"
    assert 0 < rec.min_shift_m <= rec.max_shift_m and rec.dart_noise > 0  # DART: the recovery data closed loop needs
    assert obj.eval.tasks == list(range(10)) and obj.eval.episodes == 50
    # the measured recipe: 30 epochs counted in samples, EMA weights converted, prompt dropout; the gate's number is
    # the last checkpoint's, fixed in advance, never a pick
    assert obj.train["epochs"] == 30 and obj.train["ema_decay"] > 0 and obj.train["prompt_dropout"] == 0.1
    assert obj.convert.weights == "ema" and obj.eval.checkpoints == "last" and obj.package.checkpoint == "last"
    assert obj.eval.context == "episode" and obj.eval.select_episodes == 0 and obj.promote.min_success == 0.8
    demo = params.selected()
    assert demo.train["preset"] == "tiny" and demo.launch == {"nproc_per_node": 2, "nnodes": 1}
    assert demo.fetch.source == "synthetic" and demo.eval.device == "cpu"
    assert train_config(demo, StagePaths(Path("."), "demo")).prompt_dropout == 0.0  # the demo runs without CFG
    assert params.selected("libero_5b").train["preset"] == "dreamzero_5b"
    assert params.selected("droid_14b").train["preset"] == "dreamzero_14b"
    assert params.selected("libero_5b").train["lr"] == 1e-5  # YAML 1.2 float, not the string '1.0e-5'


def test_train_config_is_filled_from_the_stage_paths(tmp_path):
    params = load_params(ROOT / "params.yaml")
    cfg = train_config(params.selected("demo"), StagePaths(tmp_path, "demo"))
    assert cfg.datasets == [str(tmp_path / "data" / "demo" / "dataset")]
    assert cfg.metadata == str(tmp_path / "runs" / "demo" / "metadata" / "metadata.json")
    assert cfg.out_dir == str(tmp_path / "runs" / "demo" / "train")
    assert cfg.embodiment == "libero_sim_tiny" and cfg.model_overrides == {"num_action_per_block": 16}
    assert cfg.accumulation(2) == 1


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["profiles"]["demo"]["train"].update(lrr=1), "profiles.demo.train.lrr: unknown key (did you mean 'lr'?)"),
    (lambda r: r["profiles"]["demo"]["eval"].update(episodes=0), "profiles.demo.eval.episodes: must be in [1, 10000], got 0"),
    (lambda r: r["profiles"]["demo"]["fetch"].update(synth_episodes="two"),
     "profiles.demo.fetch.synth_episodes: expected an integer, got str 'two'"),
    (lambda r: r["profiles"]["demo"]["eval"].update(suite="kitchen"), "profiles.demo.eval.suite: must be one of"),
    (lambda r: r["profiles"]["demo"]["train"].update(steps=1.5), "profiles.demo.train.steps: expected an integer"),
    (lambda r: r["profiles"]["demo"]["train"].update(lr=-1.0), "profiles.demo.train.lr: must be in (0, 1], got -1.0"),
    (lambda r: r["profiles"]["demo"]["train"].update(datasets=["x"]), "profiles.demo.train.datasets: set by the pipeline"),
    (lambda r: r["profiles"]["demo"]["train"].update(nproc_per_node=0), "profiles.demo.train.nproc_per_node: must be"),
    (lambda r: r["profiles"]["demo"]["train"].update(global_batch=3), "is not a multiple of micro_batch x world_size"),
    (lambda r: r["profiles"]["demo"]["package"]["robot"].pop("robot_ip"), "package.robot: missing field(s) ['robot_ip']"),
    (lambda r: r["profiles"]["demo"]["promote"].update(min_success=1.5), "profiles.demo.promote.min_success: must be in [0, 1], got 1.5"),
    (lambda r: r["profiles"]["demo"].pop("convert"), "profiles.demo.convert: missing (dvc.yaml's convert stage depends"),
    (lambda r: r["profiles"]["demo"]["train"].pop("seed"),
     "profiles.demo.train.seed: missing (dvc.yaml's vision stage depends on it; write it out, even as the default: 0)"),
    (lambda r: r["profiles"]["demo"]["train"].update(prompt_dropout=1.5),
     "profiles.demo.train.prompt_dropout: must be in [0, 1], got 1.5"),
    (lambda r: r["profiles"]["demo"]["train"].pop("heldout_episodes"),
     "profiles.demo.train.heldout_episodes: missing (dvc.yaml's metadata stage depends on it"),
    (lambda r: r.update(profile="nope"), "profile: 'nope' is not one of the profiles"),
    (lambda r: r["profiles"]["libero_5b"]["fetch"].pop("revision"), "fetch.revision: hub dataset"),
    (lambda r: r.update(extra=1), "extra: unknown key"),
])
def test_bad_params_are_refused_naming_the_field(edit, message):
    raw = _raw()
    edit(raw)
    with pytest.raises(ParamsError) as exc:
        parse_params(raw, "params.yaml")
    assert message in str(exc.value) and str(exc.value).startswith("params.yaml:")


def test_an_empty_package_robot_leaves_the_robot_to_the_embodiment():
    """package.robot {} is for an embodiment whose robot: block describes a humanoid or another arm (from a user's
    file: its package stage checks it). A built-in Franka embodiment is refused at once, not after training."""
    raw = _raw()
    raw["profiles"]["demo"]["package"]["robot"] = {}
    with pytest.raises(ParamsError, match="embodiment 'libero_sim_tiny' drives a Franka arm: give its site config"):
        parse_params(raw, "params.yaml")
    raw["profiles"]["demo"]["metadata"]["embodiment_files"] = ["robots/g1.yaml"]
    assert parse_params(raw, "params.yaml").selected("demo").package.robot == {}


def test_every_problem_is_reported_at_once():
    raw = _raw()
    raw["profiles"]["demo"]["train"]["lrr"] = 1
    raw["profiles"]["demo"]["eval"]["episodes"] = 0
    raw["profiles"]["droid_14b"]["fetch"]["retries"] = -1
    with pytest.raises(ParamsError) as exc:
        parse_params(raw)
    text = str(exc.value)
    assert "3 problems" in text and "lrr" in text and "eval.episodes" in text and "droid_14b.fetch.retries" in text


def test_overrides_and_cli(tmp_path, capsys):
    params = load_params(ROOT / "params.yaml", ["train.steps=7", "eval.tasks=[0, 2]"], "demo")
    assert params.selected().train["steps"] == 7 and params.selected().eval.tasks == [0, 2]
    assert main(["params", "check", "--params", str(ROOT / "params.yaml")]) == 0
    assert "valid (11 profiles" in capsys.readouterr().out
    assert main(["params", "check", "--params", str(ROOT / "params.yaml"), "--set", "train.micro_batch=zero"]) == 2
    assert "--set train.micro_batch=zero: expected an integer" in capsys.readouterr().err
    out = tmp_path / "train.json"
    assert main(["params", "train-config", "--params", str(ROOT / "params.yaml"), "--profile", "libero_5b",
                 "--out", str(out), "--root", "/pool"]) == 0
    cfg = TrainConfig.from_dict(json.loads(out.read_text()))
    assert cfg.preset == "dreamzero_5b" and cfg.datasets == ["/pool/data/libero_5b/dataset"] and cfg.compile
    bad = tmp_path / "bad.yaml"
    bad.write_text("profile: demo\nprofiles: [\n")
    assert main(["params", "check", "--params", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_a_bad_override_is_blamed_on_the_override_not_the_file(tmp_path):
    """A valid params.yaml with a bad `--set`: the error names the override; a file that is itself invalid is still
    reported as the file's."""
    with pytest.raises(ParamsError) as exc:
        load_params(ROOT / "params.yaml", ["train.nosuch=1"], "demo")
    assert str(exc.value).startswith("--set train.nosuch=1: unknown key") and "params.yaml" not in str(exc.value)
    with pytest.raises(ParamsError) as exc:
        load_params(ROOT / "params.yaml", ["train.lr=abc", "eval.episodes=-1", "train.steps=9"], "demo")
    lines = str(exc.value).splitlines()
    assert lines[0] == "2 problems:" and "params.yaml" not in str(exc.value)
    assert {line.strip().split(": ")[0] for line in lines[1:]} == {"--set train.lr=abc", "--set eval.episodes=-1"}
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "params.yaml").read_text().replace("profile: demo", "profile: demo\nnosuch: 1", 1))
    with pytest.raises(ParamsError, match=f"^{re.escape(str(bad))}: "):
        load_params(bad, ["train.steps=9"], "demo")


def test_schema_checks_nested_types():
    from dataclasses import dataclass, field

    @dataclass
    class Inner:
        ratio: float = field(default=0.5, metadata={"min": 0, "lt": 1})
        names: list[str] = field(default_factory=list)

    @dataclass
    class Outer:
        inner: Inner
        pair: tuple[int, int] = (1, 2)
        maybe: int | None = None

    got = build(Outer, {"inner": {"ratio": 0, "names": ["a"]}, "pair": [3, 4]})
    assert got.inner.ratio == 0.0 and isinstance(got.inner.ratio, float) and got.pair == (3, 4)
    with pytest.raises(SchemaError) as exc:
        build(Outer, {"inner": {"ratio": 1, "names": ["a", 2]}, "pair": [1], "maybe": True}, source="f.yaml")
    problems = exc.value.problems
    assert "inner.ratio: must be in [0, 1), got 1.0" in problems
    assert "inner.names[1]: expected a string, got int 2" in problems
    assert "pair: expected a list of 2 values, got 1" in problems
    assert "maybe: expected an integer, got bool True" in problems
    with pytest.raises(SchemaError, match="inner: required"):
        build(Outer, {})


def test_train_config_from_dict_checks_types():
    with pytest.raises(ValueError, match="train.steps: expected an integer, got str"):
        TrainConfig.from_dict({"steps": "ten"})
    with pytest.raises(ValueError, match="train.sharding"):
        TrainConfig.from_dict({"sharding": "zero3"})
    assert TrainConfig.from_dict({"betas": [0.9, 0.99]}).betas == (0.9, 0.99)


def test_the_readme_lists_every_profile_with_its_model_preset():
    """README's profile table names each profile of params.yaml once (a profile added without it fails here)."""
    import re

    readme = (ROOT / "README.md").read_text()
    table = readme.split("| profile | model | machine | what |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| ([^|]+) \|", table, re.M)
    params = load_params(ROOT / "params.yaml")
    assert [name for name, _ in rows] == list(params.profiles)
    names = {"tiny": "tiny", "small": "small", "dreamzero_5b": "DreamZero-5B", "dreamzero_14b": "DreamZero-14B"}
    for name, model in rows:
        assert model.startswith(names[params.selected(name).train["preset"]]), (name, model)


def test_a_path_source_is_never_taken_for_a_hub_id(tmp_path):
    """`--set fetch.source=/abs/path` (or ./rel, ~/x) is a path: a missing one is said to be missing, not asked for
    a hub revision; an existing one is accepted; owner/name still needs its pinned revision."""
    from dzmodel.config import ParamsError, load_params

    root = Path(__file__).resolve().parents[1] / "params.yaml"
    for missing in (str(tmp_path / "nowhere"), "./nowhere/ds", "~/nowhere-dz/ds"):
        with pytest.raises(ParamsError, match=r"is a path \(it starts with '.'\) and does not exist") as err:
            load_params(root, [f"fetch.source={missing}"], "demo")
        assert "revision" not in str(err.value)
    load_params(root, [f"fetch.source={tmp_path}"], "demo")
    with pytest.raises(ParamsError, match="needs a pinned revision"):
        load_params(root, ["fetch.source=owner/name"], "demo")
