"""Hostile params.yaml values: each is one ParamsError that names the file and the field, whether it comes from the
file or from a `--set` override; the shipped profiles still pass."""

from pathlib import Path

import pytest
import yaml

from dzmodel.cli import main
from dzmodel.config import ParamsError, load_params, parse_params
from dzmodel.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ROOT / "params.yaml"
NAN, INF = float("nan"), float("inf")


def _raw() -> dict:
    return yaml.safe_load(PARAMS.read_text())


def _refused(edit) -> str:
    raw = _raw()
    edit(raw["profiles"]["demo"])
    with pytest.raises(ParamsError) as exc:
        parse_params(raw, "params.yaml")
    return str(exc.value)


def _set(section: str, **values):
    def edit(profile):
        node = profile
        for part in section.split("."):
            node = node.setdefault(part, {})
        node.update(values)
    return edit


@pytest.mark.parametrize("section, values, message", [
    ("train", {"lr": NAN}, "profiles.demo.train.lr: must be a finite number in (0, 1], got nan"),
    ("train", {"lr": INF}, "profiles.demo.train.lr: must be a finite number in (0, 1], got inf"),
    ("train", {"lr": 1e9}, "profiles.demo.train.lr: must be in (0, 1], got 1000000000.0"),
    ("train", {"lr": 0.0}, "profiles.demo.train.lr: must be in (0, 1], got 0.0"),
    ("train", {"betas": [0.9, 1.5]}, "profiles.demo.train.betas[1]: must be in [0, 1), got 1.5"),
    ("train", {"betas": [-0.1, 0.99]}, "profiles.demo.train.betas[0]: must be in [0, 1), got -0.1"),
    ("train", {"weight_decay": -0.01}, "profiles.demo.train.weight_decay: must be in [0, 1], got -0.01"),
    ("train", {"eps": 0.0}, "profiles.demo.train.eps: must be in (0, 1], got 0.0"),
    ("train", {"grad_clip": INF}, "profiles.demo.train.grad_clip: must be a finite number > 0, got inf"),
    ("train", {"warmup_ratio": NAN}, "profiles.demo.train.warmup_ratio: must be a finite number in [0, 1), got nan"),
    ("train", {"ema_decay": 1.0}, "profiles.demo.train.ema_decay: must be in [0, 1), got 1.0"),
    ("train", {"prompt_dropout": -INF}, "profiles.demo.train.prompt_dropout: must be a finite number in [0, 1]"),
    ("train", {"min_lr": 0.1}, "profiles.demo.train.min_lr: must be <= train.lr (0.003), got 0.1"),
    ("train", {"epochs": INF}, "profiles.demo.train.epochs: must be a finite number"),
    ("train", {"seed": -1}, "profiles.demo.train.seed: must be in [0, 4294967295], got -1"),
    ("train", {"dataset_weights": [1.0, NAN]}, "profiles.demo.train.dataset_weights[1]: must be a finite number in (0, 1000000]"),
    ("train", {"lora": {"rank": 8, "alpha": NAN}}, "profiles.demo.train.lora.alpha: must be a finite number"),
    ("train", {"lora": {"rank": 8, "alpha": -16.0}}, "profiles.demo.train.lora.alpha: must be > 0 with LoRA on"),
    ("train", {"model_overrides": {"rope_theta": NAN}}, "profiles.demo.train.model_overrides.rope_theta: must be a finite"),
    ("train", {"model_overrides": {"num_heads": 0}}, "profiles.demo.train.model_overrides.num_heads: must be > 0"),
    ("train", {"preset": "huge"}, "profiles.demo.train.preset: must be one of"),
    ("vision", {"lr": NAN}, "profiles.demo.vision.lr: must be a finite number in (0, 1], got nan"),
    ("vision", {"kl_weight": INF}, "profiles.demo.vision.kl_weight: must be a finite number"),
    ("convert", {"max_shard_gib": NAN}, "profiles.demo.convert.max_shard_gib: must be a finite number"),
    ("eval", {"cfg_scale": INF}, "profiles.demo.eval.cfg_scale: must be a finite number"),
    ("eval", {"tasks": [999]}, "profiles.demo.eval.tasks[0]: task 999 is not in LIBERO-spatial (tasks 0..9)"),
    ("eval", {"tasks": [-1]}, "profiles.demo.eval.tasks[0]: must be >= 0, got -1"),
    ("eval", {"tasks": [0, 0]}, "profiles.demo.eval.tasks: task 0 is listed twice"),
    ("eval", {"checkpoints": "last", "select_episodes": 2},
     "eval.checkpoints: last evaluates the newest checkpoint only; it picks nothing"),
    ("eval", {"checkpoints": "best"}, "eval.checkpoints"),
    ("eval", {"episodes": 40, "select_episodes": 20},
     "profiles.demo.eval: episodes + select_episodes = 60 init states per task; LIBERO has 50"),
    ("eval", {"steps": [0]}, "profiles.demo.eval.steps[0]: must be >= 1, got 0"),
    ("eval", {"seed": 2**64}, "profiles.demo.eval.seed: must be in [0, 4294967295]"),
    ("fetch", {"retry_delay_s": NAN}, "profiles.demo.fetch.retry_delay_s: must be a finite number"),
    ("fetch.record", {"suite": "goal", "tasks": [10]}, "profiles.demo.fetch.record.tasks[0]: task 10 is not in LIBERO-goal"),
    ("fetch.record", {"max_shift_m": 0.01, "min_shift_m": 0.05},
     "profiles.demo.fetch.record.min_shift_m: must be <= max_shift_m (0.01), got 0.05"),
    ("fetch.record", {"dart_noise": NAN}, "profiles.demo.fetch.record.dart_noise: must be a finite number in [0, 1]"),
    ("promote", {"max_action_error_ratio": INF}, "profiles.demo.promote.max_action_error_ratio: must be a finite number"),
    ("promote", {"min_success": NAN}, "profiles.demo.promote.min_success: must be a finite number in [0, 1]"),
])
def test_bad_numbers_and_indices_are_refused_by_field(section, values, message):
    text = _refused(_set(section, **values))
    assert text.startswith("params.yaml: ") and message in text, text


@pytest.mark.parametrize("section, key, value", [
    ("package", "version", "../../etc"),
    ("package", "version", "1.0/evil"),
    ("package", "version", ".hidden"),
    ("package", "version", "1.0.0\n"),
    ("package", "name", "..\\x"),
    ("promote", "registered_model", "../models"),
    ("promote", "alias", "a/b"),
    ("tracking", "experiment", "../../tmp/x"),
    ("metadata", "embodiment", "../emb"),
])
def test_names_that_become_paths_are_plain(section, key, value):
    text = _refused(_set(section, **{key: value}))
    assert f"profiles.demo.{section}.{key}: must be a plain name" in text and repr(value) in text, text


def test_aliases_mlflow_would_refuse_at_promotion_are_refused_now():
    assert "profiles.demo.promote.alias: 'latest' is reserved by MLflow" in _refused(_set("promote", alias="latest"))
    assert "profiles.demo.promote.alias: 'V3' is reserved by MLflow" in _refused(_set("promote", alias="V3"))
    assert ("profiles.demo.promote.alias: MLflow aliases take letters, digits, '_' and '-', got 'prod.1'"
            in _refused(_set("promote", alias="prod.1")))


def test_profile_names_are_plain_including_the_end():
    raw = _raw()
    raw["profiles"]["demo\n"] = raw["profiles"]["demo"]
    with pytest.raises(ParamsError, match="profiles: names must be lower_snake_case"):
        parse_params(raw)


def test_yaml_nan_and_inf_are_refused_in_the_file(tmp_path):
    text = PARAMS.read_text().replace("lr: 3.0e-3", "lr: .nan", 1).replace("cfg_scale: 1.0", "cfg_scale: -.inf", 1)
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError) as exc:
        load_params(path)
    assert f"{path}: 2 problems" in str(exc.value)
    assert "profiles.demo.train.lr: must be a finite number in (0, 1], got nan" in str(exc.value)
    assert "profiles.demo.eval.cfg_scale: must be a finite number in [0, 100], got -inf" in str(exc.value)


@pytest.mark.parametrize("override, message", [
    ("train.lr=.nan", "--set train.lr=.nan: must be a finite number in (0, 1], got nan"),
    ("train.lr=1e9", "--set train.lr=1e9: must be in (0, 1], got 1000000000.0"),
    ("train.betas=[0.9, 2]", "--set train.betas=[0.9, 2]: train.betas[1]: must be in [0, 1), got 2.0"),
    ("eval.tasks=[999]", "--set eval.tasks=[999]: eval.tasks[0]: task 999 is not in LIBERO-spatial"),
    ("package.version=../../etc", "--set package.version=../../etc: must be a plain name"),
    ("train.lr=[", "override 'train.lr=[': the value is not valid YAML"),
    ("train.model_overrides.dim=.inf", "--set train.model_overrides.dim=.inf: must be a finite number"),
])
def test_overrides_go_through_the_same_checks(override, message, capsys):
    assert main(["params", "check", "--params", str(PARAMS), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dz: error: ") and message in err and "Traceback" not in err, err
    assert "dz --debug" not in err  # a deliberate error, not a bug


def test_an_override_into_a_non_mapping_profile_is_one_error(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("profile: demo\nprofiles: [1, 2]\n")
    with pytest.raises(ParamsError, match="profiles: expected a mapping"):
        load_params(path, ["train.lr=0.1"])


def test_a_train_config_built_in_code_gets_the_same_ranges():
    with pytest.raises(ValueError, match=r"train.lr: must be a finite number in \(0, 1\], got nan"):
        TrainConfig(lr=NAN)
    with pytest.raises(ValueError, match=r"train.betas\[0\]: must be in \[0, 1\), got 1.0"):
        TrainConfig(betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="train.weight_decay: must be in"):
        TrainConfig.from_dict({"weight_decay": -1.0})


def test_the_shipped_profiles_still_pass(capsys):
    import yaml

    profiles = len(yaml.safe_load(PARAMS.read_text())["profiles"])
    assert main(["params", "check", "--params", str(PARAMS)]) == 0
    assert f"valid ({profiles} profiles" in capsys.readouterr().out


def test_a_nest_of_yaml_aliases_is_refused_quickly(tmp_path):
    """Ten-fold aliases eight deep: 10^8 numbers if expanded; each shared list is checked once."""
    overrides = ["num_action_per_block: 16", "b0: &a0 [" + ", ".join(["1.0"] * 10) + "]"]
    overrides += [f"b{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS.read_text().replace("      model_overrides: {num_action_per_block: 16}",
                                               "      model_overrides: {" + ", ".join(overrides) + "}", 1))
    import time

    start = time.perf_counter()
    with pytest.raises(ParamsError, match="profiles.demo.train.model_overrides: unknown override"):
        load_params(path)
    assert time.perf_counter() - start < 5
