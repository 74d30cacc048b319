"""A converted checkpoint as a robot policy: loads with the run's encoders, tokenizer and embodiment."""

import numpy as np
import pytest
import torch

from dzmodel.eval.policy import PolicyLoadError, load_policy
from dzmodel.model.sampler import SolverConfig
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.train.encoders import frozen_encoders
from dzmodel.train.trainer import train
from tests.tiny_data import make_tabletop_data

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = make_tabletop_data(tmp_path_factory.mktemp("policy"), num_episodes=2, episode_length=30)
    cfg = TrainConfig(preset="tiny", datasets=[str(root / "ds")], embodiment="tabletop_pusher", seed=5,
                      embodiment_files=[str(root / "emb.yaml")], metadata=str(root / "meta.json"),
                      steps=2, save_every=2, out_dir=str(root / "run"), lr=1e-3, progress=False)
    train(cfg)
    hf = convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf")
    (root / "emb.yaml").unlink()  # the converted directory must not need the original files
    return hf, cfg


def test_policy_predicts_chunks_in_robot_units_with_the_runs_encoders(converted):
    hf, cfg = converted
    pol = load_policy(hf, solver=SolverConfig(num_steps=2, cfg_scale=1.0), seed=1)
    assert pol.step == 2 and pol.action_horizon == 4 and pol.embodiment.tag == "tabletop_pusher"
    trained = frozen_encoders(cfg)
    for a, b in zip(trained.modules(), (pol.policy.vae, pol.policy.text_encoder, pol.policy.image_encoder)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    rng = np.random.default_rng(0)
    views = {"front": rng.integers(0, 255, (48, 48, 3), dtype=np.uint8),
             "hand": rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)}
    state = np.zeros(pol.policy.state_stats.q01.shape[0])
    assert pol.frame(views).shape == (1, 32, 64, 3)
    a1 = pol.predict("s1", views, state, "Push the block.")
    assert a1.shape == (4, pol.action_dim) and np.isfinite(a1).all()
    lo, hi = pol.policy.action_stats.q01, pol.policy.action_stats.q99
    assert (a1 >= lo - 1e-9).all() and (a1 <= hi + 1e-9).all()  # un-normalised into the data's range
    assert "s1" in pol.policy.sessions
    pol.end_session("s1")
    assert "s1" not in pol.policy.sessions
    np.testing.assert_array_equal(pol.predict("s1", views, state, "Push the block."), a1)  # a fresh session repeats
    with pytest.raises(ValueError, match="needs views"):
        pol.predict("s2", {"front": views["front"]}, state, "x")


def test_policy_refuses_a_wrong_embodiment_or_a_raw_run_directory(converted, tmp_path):
    hf, cfg = converted
    with pytest.raises(PolicyLoadError, match="trained for embodiment 'tabletop_pusher', not 'libero_sim'"):
        load_policy(hf, embodiment="libero_sim")
    with pytest.raises(PolicyLoadError, match="dz convert"):
        load_policy(cfg.out_dir)


def test_offline_encoders_are_drawn_on_the_cpu_whatever_the_device(monkeypatch):
    """A small-preset run trained on a GPU and evaluated on a CPU must see the same random encoders: CUDA's
    generator would draw other numbers, so the offline presets draw on the CPU and move."""
    import dzmodel.train.encoders as E

    built_on = []
    real = E.build_encoders
    monkeypatch.setattr(E, "build_encoders", lambda preset, device: built_on.append(str(device)) or real(preset, device))
    cpu = frozen_encoders(TrainConfig(preset="small", seed=3))
    moved = frozen_encoders(TrainConfig(preset="small", seed=3), device="meta")  # stands in for "cuda"
    assert built_on == ["cpu", "cpu"]
    assert all(p.is_meta for m in moved.modules() for p in m.parameters())
    assert cpu.spec.image_size == (128, 256)
