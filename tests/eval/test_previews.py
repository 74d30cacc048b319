"""World-model previews: a converted model's predicted video, decoded, beside the real frames of held-out windows."""

import av
import numpy as np
import pytest

from dzmodel.data.dataset import embodiment_metadata
from dzmodel.data.embodiments import get_embodiment
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.eval.previews import side_by_side, write_previews
from dzmodel.model.inference import SolverConfig
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.train.trainer import train


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("previews")
    ds = make_synthetic_dataset(root / "ds", num_episodes=3, episode_length=40, codec="libx264", embodiment="libero_sim")
    embodiment_metadata(ds, get_embodiment("libero_sim_tiny"), root / "meta.json")
    train(TrainConfig(preset="tiny", model_overrides={"num_action_per_block": 16}, datasets=[str(ds)],
                      embodiment="libero_sim_tiny", metadata=str(root / "meta.json"), steps=1, save_every=1,
                      heldout_episodes=1, out_dir=str(root / "run"), progress=False))
    return convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf")


def test_previews_write_side_by_side_videos_and_a_grid(converted, tmp_path):
    result = write_previews(converted, tmp_path / "p", windows=2, solver=SolverConfig(num_steps=2, cfg_scale=1.0))
    assert result["windows"] == 2 and result["step"] == 1 and len(result["videos"]) == 2
    assert (tmp_path / "p" / "grid.png").stat().st_size > 1000
    with av.open(result["videos"][0]) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) >= 4 and frames[0].shape[1] >= 3 * frames[0].shape[0]  # three (two-view) panels side by side
    assert oct((tmp_path / "p" / "grid.png").stat().st_mode & 0o777) == "0o644"


def test_a_run_that_held_nothing_out_previews_training_windows(converted, tmp_path):
    import json
    import shutil

    model = shutil.copytree(converted, tmp_path / "all_trained")
    cfg_file = model / "experiment_cfg" / "train_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["heldout_episodes"] = 0
    cfg_file.write_text(json.dumps(cfg))
    result = write_previews(model, tmp_path / "p", windows=3, solver=SolverConfig(num_steps=1, cfg_scale=1.0))
    assert result["seen_in_training"] and result["windows"] == 3
    names = [v.rsplit("/", 1)[1] for v in result["videos"]]
    assert {n.split("_")[0] for n in names} == {"ep0", "ep1", "ep2"}  # spread over all three, the last included


def test_side_by_side_pads_an_ended_episode_with_black():
    ctx = np.full((8, 6, 3), 10, np.uint8)
    pred = np.full((3, 8, 6, 3), 20, np.uint8)
    real = np.full((1, 8, 6, 3), 30, np.uint8)
    strip = side_by_side(ctx, pred, real)
    assert strip.shape == (3, 8, 3 * 6 + 8, 3)
    assert (strip[:, :, :6] == 10).all() and (strip[:, :, 10:16] == 20).all()
    assert (strip[0, :, 20:] == 30).all() and (strip[1:, :, 20:] == 0).all()


def test_dz_eval_previews(converted, tmp_path, capsys):
    from dzmodel.cli import main

    assert main(["eval", "previews", str(converted), "--out", str(tmp_path / "v"), "--windows", "1",
                 "--solver-steps", "2", "--cfg-scale", "1"]) == 0
    assert "1 held-out windows" in capsys.readouterr().out and (tmp_path / "v" / "grid.png").is_file()
    assert main(["eval", "previews", str(converted), "--out", str(tmp_path / "w"), "--windows", "0"]) != 0
