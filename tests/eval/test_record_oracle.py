"""The closed loop's first link, in the real simulator: the scripted expert records one LIBERO-Object episode
(`dz data record libero`, 64 px), the dataset reads as LeRobot v3.0 through the `libero_sim` and `libero_sim_tiny`
embodiments and lerobot 0.4.4, and the oracle replays it through the evaluation path (`dz eval oracle`).
About a minute on 2 CPU cores."""

import json

import numpy as np
import pytest

from dzmodel.cli import main

pytest.importorskip("libero")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from dzmodel.eval.libero_env import check_libero

    check_libero()
    out = tmp_path_factory.mktemp("record") / "object_t0"
    rc = main(["data", "record", "libero", "--suite", "object", "--tasks", "0", "--episodes", "1",
               "--image-size", "64", "--workers", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    return out


def test_recorded_dataset_reads_through_the_libero_embodiments(recorded):
    from dzmodel.data.dataset import WindowDataset, embodiment_metadata
    from dzmodel.data.embodiments import get_embodiment
    from dzmodel.data.lerobot_format import crosscheck_with_lerobot, open_dataset
    from dzmodel.data.sampling import WindowSpec

    rec = json.loads((recorded / "meta" / "dz_recording.json").read_text())
    assert rec["per_task"][0]["attempts"] == 1 and rec["successes"] == 1
    ep = rec["episodes"][0]
    assert ep["steps"] <= rec["max_steps"] == 280 and len(ep["init_state"]) > 10
    reader = open_dataset(recorded)
    reader.check()
    assert reader.fps == 10 and reader.episodes[0].length == ep["steps"]
    assert reader.task_per_frame(0)[0] == "pick up the alphabet soup and place it in the basket"
    cols = reader.read_columns(0, ["action", "observation.state"])
    action, state = np.asarray(cols["action"]), np.asarray(cols["observation.state"])
    assert action.shape == (ep["steps"], 7) and state.shape == (ep["steps"], 8)
    assert np.all(np.abs(action) <= 1) and set(np.unique(action[:, 6])) <= {-1.0, 1.0}
    assert action[0, 6] == -1 and (action[:, 6] == 1).any()  # starts open, grasps at some point
    assert "agrees" in crosscheck_with_lerobot(reader)
    for tag in ("libero_sim", "libero_sim_tiny"):
        emb = get_embodiment(tag)
        meta = embodiment_metadata(recorded, emb, None)
        ds = WindowDataset(reader, emb, WindowSpec(2, emb.action_horizon, 8, emb.sampling), meta[tag]["statistics"], train=False)
        sample = ds.sample(0)
        assert tuple(sample["images"].shape[1:]) == (emb.view_size[0], 2 * emb.view_size[1], 3)
        assert tuple(sample["action"].shape[1:]) == (7,) and sample["prompt"].count("alphabet soup") == 2


def test_lerobot_reads_the_recording(recorded):
    from dzmodel.data.lerobot_compat import import_lerobot_dataset
    from dzmodel.data.lerobot_format import open_dataset

    _, LeRobotDataset = import_lerobot_dataset()
    dset = LeRobotDataset("dzmodel/libero_scripted", root=recorded, video_backend="torchcodec")
    item = dset[5]
    assert item["task"] == "pick up the alphabet soup and place it in the basket"
    assert tuple(item["observation.images.image"].shape) == (3, 64, 64) and tuple(item["action"].shape) == (7,)
    ours = open_dataset(recorded).read_frames(0, "observation.images.image", [5], backend="pyav")[0]
    theirs = (item["observation.images.image"].permute(1, 2, 0).numpy() * 255).round()
    assert abs(ours.astype(float) - theirs).max() <= 1


def test_oracle_reproduces_the_recorded_success(recorded, tmp_path, capsys):
    rc = main(["eval", "oracle", str(recorded), "--out", str(tmp_path), "--workers", "1", "--no-progress"])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "oracle: 1/1 recorded successes reproduced" in out
    assert rc == 0 and summary["oracle_success_rate"] == 1.0 and summary["passed"]
    assert (tmp_path / "episodes.csv").read_text().count("True") == 1
