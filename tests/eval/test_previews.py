"""World-model previews: a converted model's predicted video, decoded, beside the real frames of held-out windows."""

import json
import math

import av
import numpy as np
import pytest

from dzmodel.data.dataset import embodiment_metadata
from dzmodel.data.embodiments import get_embodiment
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.eval.previews import GAP, side_by_side, split_panels, write_previews
from dzmodel.model.sampler import SolverConfig
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


def test_previews_write_side_by_side_videos_a_grid_and_latent_errors(converted, tmp_path, monkeypatch):
    from dzmodel.eval import previews

    strips, write = [], previews.write_mp4

    def keep_strip(frames, path):
        strips.append(frames)
        return write(frames, path)

    monkeypatch.setattr(previews, "write_mp4", keep_strip)
    result = write_previews(converted, tmp_path / "p", windows=2, solver=SolverConfig(num_steps=2, cfg_scale=1.0))
    assert result["windows"] == 2 and result["step"] == 1 and len(result["videos"]) == 2
    assert (tmp_path / "p" / "grid.png").stat().st_size > 1000
    with av.open(result["videos"][0]) as c:
        assert sum(1 for _ in c.decode(video=0)) == len(strips[0]) >= 4
    context, predicted, round_trip, real = split_panels(strips[0], 4)
    w = predicted.shape[2]
    assert strips[0].shape[2] == 4 * w + 3 * GAP and (strips[0][:, :, w:w + GAP] == 255).all()
    assert (strips[0][:, :, 3 * w + 2 * GAP:3 * (w + GAP)] == 255).all()  # the last gap: four whole panels
    assert round_trip.any() and not np.array_equal(round_trip, real)  # the random VAE's round trip, not a copy
    assert oct((tmp_path / "p" / "grid.png").stat().st_mode & 0o777) == "0o644"
    saved = json.loads((tmp_path / "p" / "previews.json").read_text())
    assert saved["step"] == 1 and len(saved["windows"]) == 2 and saved["windows"] == result["window_errors"]
    for key in ("latent_mse", "still_latent_mse"):
        per_window = [w[key] for w in saved["windows"]]
        assert all(math.isfinite(x) and x >= 0 for x in per_window + [saved[key]])
        assert saved[key] == pytest.approx(np.mean(per_window)) and result[key] == saved[key]


def test_compare_with_real_measures_the_block_after_the_context(tmp_path):
    from dzmodel.policy.sessions import build_tiny_policy

    policy = build_tiny_policy(tmp_path / "tok", solver=SolverConfig(num_steps=1, cfg_scale=1.0))
    policy.keep_video = True
    frames = np.random.default_rng(0).integers(0, 255, (12, 64, 64, 3), dtype=np.uint8)
    policy.predict_actions({"images": frames[0], "state": np.zeros(8), "prompt": "pick it up", "session_id": "s"})
    session = policy.sessions["s"]
    needed = 1 + 4 * session.predicted.shape[2]
    session.predicted = policy._encode(policy._frames(frames[:needed]))[:, :, 1:]  # a perfect world model
    check = policy.compare_with_real("s", frames)  # frames beyond the block are ignored
    assert check.latent_mse == pytest.approx(0, abs=1e-10) and check.still_latent_mse > 1e-3
    assert np.array_equal(check.round_trip, policy.predicted_frames("s"))  # decoded as the prediction is
    session.predicted = session.predicted.flip(2)  # the right latents in the wrong order
    assert policy.compare_with_real("s", frames).latent_mse > 1e-3
    assert policy.compare_with_real("s", frames[:needed - 1]) is None  # the episode ended within the block


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


def test_side_by_side_pads_an_ended_episode_with_black_and_splits_back():
    ctx = np.full((9, 7, 3), 10, np.uint8)
    pred = np.full((3, 8, 6, 3), 20, np.uint8)
    round_trip = np.full((3, 8, 6, 3), 30, np.uint8)
    real = np.full((1, 9, 7, 3), 40, np.uint8)  # larger frames are cropped to the prediction's
    strip = side_by_side(ctx, pred, round_trip, real)
    assert strip.shape == (3, 8, 4 * 6 + 3 * GAP, 3)
    context, *panels = split_panels(strip, 4)
    assert (context == 10).all() and (panels[0] == 20).all() and (panels[1] == 30).all()
    assert (panels[2][0] == 40).all() and (panels[2][1:] == 0).all()
    assert (strip[:, :, 6:6 + GAP] == 255).all()


def test_dz_eval_previews(converted, tmp_path, capsys):
    from dzmodel.cli import main

    assert main(["eval", "previews", str(converted), "--out", str(tmp_path / "v"), "--windows", "1",
                 "--solver-steps", "2", "--cfg-scale", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 held-out windows" in out and "latent MSE" in out and (tmp_path / "v" / "grid.png").is_file()
    assert main(["eval", "previews", str(converted), "--out", str(tmp_path / "w"), "--windows", "0"]) != 0
