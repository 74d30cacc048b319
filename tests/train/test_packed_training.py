"""`dz train` on a mixture of robots: a LIBERO-layout dataset (two 64 px views side by side, 7-dim actions, 8-dim
state) and a Unitree G1-shaped one (one camera, 26 joint positions as state and action) train together with
sequence packing, each normalised with its own embodiment's statistics."""

import json

import pytest

from dzmodel.cli import main
from dzmodel.data.errors import DataError
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.train.config import TrainConfig
from dzmodel.train.step import TrainStep
from dzmodel.train.trainer import train


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    libero = make_synthetic_dataset(root / "libero", num_episodes=2, episode_length=40, codec="libx264")
    g1 = make_synthetic_dataset(root / "g1", num_episodes=2, episode_length=40, codec="libx264",
                                embodiment="unitree_g1")
    g1_yaml = root / "g1.yaml"
    assert main(["embodiment", "init", str(g1), "--out", str(g1_yaml), "--tag", "g1", "--action-horizon", "16"]) == 0
    meta = root / "meta.json"
    assert main(["data", "metadata", str(libero), "--embodiment", "libero_sim_tiny", "--out", str(meta)]) == 0
    assert main(["data", "metadata", str(g1), "--embodiment", "g1", "--embodiments", str(g1_yaml), "--out", str(meta),
                 "--merge"]) == 0
    assert set(json.loads(meta.read_text())) == {"libero_sim_tiny", "g1"}
    return dict(preset="tiny", model_overrides={"num_action_per_block": 16}, datasets=[str(libero), str(g1)],
                dataset_embodiments=["libero_sim_tiny", "g1"], embodiment="libero_sim_tiny",
                embodiment_files=[str(g1_yaml)], metadata=str(meta), micro_batch=4, global_batch=4, steps=2,
                save_every=0, progress=False), root


def test_two_robots_train_two_packed_steps(mixture, monkeypatch, capfd):
    fields, root = mixture
    seen = []
    packed_losses = TrainStep.packed_losses

    def recording(self, samples, capacity=None):
        seen.append(sorted({(tuple(s["images"].shape[-3:-1]), int(s["action_mask"].sum(-1).max())) for s in samples}))
        return packed_losses(self, samples, capacity)

    monkeypatch.setattr(TrainStep, "packed_losses", recording)
    rows = train(TrainConfig(**fields, packing=True, out_dir=str(root / "run"), seed=3))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in rows)  # finite, not NaN
    shapes = {shape for step in seen for shape in step}
    # frames of both robots (64x128: two views; 64x64: one camera) and both action widths, in the same run
    assert shapes == {((64, 128), 7), ((64, 64), 26)}, seen
    # the tiny preset widened to the wider robot
    assert "sized to embodiment libero_sim_tiny, g1: {'max_state_dim': 26, 'action_dim': 26}" in capfd.readouterr().err


def test_without_packing_the_mixture_is_refused_with_the_fix(mixture):
    fields, root = mixture
    with pytest.raises(DataError, match="same frame size.*set train.packing: true"):
        train(TrainConfig(**fields, out_dir=str(root / "refused")))


def test_packing_settings_are_checked():
    with pytest.raises(ValueError, match="one tag per dataset, got 1 for 2 datasets"):
        TrainConfig(datasets=["a", "b"], dataset_embodiments=["libero_sim"])
    with pytest.raises(ValueError, match="needs train.data_on_device: false"):
        TrainConfig(packing=True, data_on_device=True)
    with pytest.raises(ValueError, match="set train.packing: true"):
        TrainConfig(pack_capacity=4096)
    with pytest.raises(ValueError, match="blocks eagerly.*set train.compile: false"):
        TrainConfig(packing=True, compile=True)
