"""Every mismatch between an embodiment's action_horizon and the model's num_action_per_block names the two
settings that fix it: the embodiment's action_horizon, or train.model_overrides.num_action_per_block."""

import pytest

from dzmodel.data.errors import DataError
from dzmodel.train.config import TrainConfig
from dzmodel.train.trainer import train

FIX = "set the embodiment's action_horizon to {per_block}, or train.model_overrides.num_action_per_block to {horizon}"


def _cfg(data, out, **kw):
    base = dict(preset="tiny", datasets=[str(data / "ds")], embodiment="tabletop_pusher",
                embodiment_files=[str(data / "emb.yaml")], metadata=str(data / "meta.json"),
                tokenizer=str(data / "tok"), steps=1, save_every=1, out_dir=str(out), progress=False)
    return TrainConfig(**{**base, **kw})


def test_the_trainer_names_both_settings(data, tmp_path):
    with pytest.raises(DataError) as err:  # the embodiment's horizon is 4, the tiny model's 16 here
        train(_cfg(data, tmp_path / "run", model_overrides={"num_action_per_block": 16}))
    msg = str(err.value)
    assert FIX.format(per_block=16, horizon=4) in msg and str(data / "emb.yaml") in msg


def test_dz_cache_names_both_settings(data, tmp_path):
    from dzmodel.train.cache import build_cache

    with pytest.raises(DataError, match=FIX.format(per_block=16, horizon=4).replace(".", r"\.")):
        build_cache(_cfg(data, tmp_path / "run", model_overrides={"num_action_per_block": 16}), tmp_path / "cache",
                    progress=False)


def test_a_cache_of_another_horizon_names_both_settings(tmp_path):
    from dzmodel.train.cache import synthetic_cache

    cache = synthetic_cache("tiny", tmp_path / "cache", 2, latent_hw=(4, 4),
                            model_overrides={"num_action_per_block": 8}, progress=False)
    with pytest.raises(ValueError) as err:
        train(TrainConfig(preset="tiny", cache=str(cache), steps=1, save_every=0, out_dir=str(tmp_path / "run"),
                          progress=False))
    assert "train.model_overrides.num_action_per_block to 8" in str(err.value)


def test_loading_a_model_for_an_embodiment_of_another_horizon_names_both_settings(data, tmp_path):
    from dzmodel.policy.policy import PolicyLoadError, load_policy
    from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint

    train(_cfg(data, tmp_path / "run"))
    hf = convert_checkpoint(resolve_checkpoint(tmp_path / "run"), tmp_path / "hf")
    other = tmp_path / "emb16.yaml"
    other.write_text((data / "emb.yaml").read_text().replace("action_horizon: 4", "action_horizon: 16"))
    with pytest.raises(PolicyLoadError) as err:
        load_policy(hf, embodiment_files=[str(other)])
    msg = str(err.value)
    assert "set the embodiment's action_horizon to 4" in msg and str(other) in msg
    assert "train.model_overrides.num_action_per_block to 16" in msg
