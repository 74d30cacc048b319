"""`dz embodiment init`: a draft embodiment from a dataset's info.json that loads, checks and samples as written."""

import json

import pytest
import yaml

from dzmodel.cli import main
from dzmodel.data.dataset import WindowDataset
from dzmodel.data.embodiment_draft import draft_embodiment, write_draft
from dzmodel.data.embodiments import load_embodiments
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import open_dataset
from dzmodel.data.sampling import WindowSpec
from dzmodel.data.synth import make_synthetic_dataset


@pytest.fixture(scope="module")
def droid_like(tmp_path_factory):
    """DROID's layout: three cameras, a 14-dim state and a 21-dim action column."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("d") / "droid_like", num_episodes=2, episode_length=40,
                                  image_size=32, codec="libx264", embodiment="oxe_droid")


def test_the_draft_names_every_camera_and_column_with_its_dim_and_samples(droid_like, tmp_path):
    tag, path = write_draft(droid_like, tmp_path / "robots.yaml", action_horizon=16)
    assert tag == "droid_like" and path == tmp_path / "robots.yaml"
    emb = load_embodiments([path])[tag]
    info = json.loads((droid_like / "meta/info.json").read_text())["features"]
    cameras = [k for k, f in info.items() if f["dtype"] == "video"]
    assert sorted(emb.views.values()) == sorted(cameras) and len(cameras) == 3
    assert [(k.column, k.dim) for k in emb.state] == [("observation.state", 14)]
    assert [(k.column, k.dim) for k in emb.action] == [("action", 21)]
    assert emb.action_horizon == 16 and emb.view_size == (32, 32)
    sample = WindowDataset(open_dataset(droid_like), emb, WindowSpec(2, 16, 8), statistics=None,
                           train=False).sample(0)
    assert sample["images"].shape[1:] == (32, 96, 3)  # three views side by side
    assert f"--embodiments {path}" in path.read_text()


def test_view_size_keeps_the_cameras_aspect_at_most_256():
    from dzmodel.data.embodiment_draft import _view_size

    assert _view_size(480, 640) == [192, 256] and _view_size(64, 64) == [64, 64] and _view_size(720, 1280) == [128, 256]
    assert _view_size(480, 640, 64) == [64, 64] and _view_size(480, 640, 128) == [96, 128]


def test_the_drafted_views_fit_the_preset(droid_like, tmp_path):
    """A CPU preset gets views of its built-in embodiments' scale (the frame's pixels drive a step's cost); the
    large ones keep the camera's aspect at up to 256."""
    from dzmodel.data.embodiment_draft import draft_embodiment
    from dzmodel.data.embodiments import parse_embodiment

    presets = {"tiny": 4, "small": 16, "dreamzero_5b": 24}
    for preset, longest in [("tiny", 64), ("small", 128), ("dreamzero_5b", 256)]:
        tag, text = draft_embodiment(droid_like, presets=presets, preset=preset)
        emb = parse_embodiment(tag, yaml.safe_load(text)[tag])
        assert max(emb.view_size) <= longest, (preset, emb.view_size)
        assert (f"for preset {preset}; --view-size H W" in text) == (preset in ("tiny", "small"))


def test_the_draft_refuses_to_replace_a_file_or_write_into_the_dataset(droid_like, tmp_path):
    out = tmp_path / "mine.yaml"
    out.write_text("kept: 1\n")
    with pytest.raises(DataError, match="exists; pass --overwrite"):
        write_draft(droid_like, out, action_horizon=4)
    assert out.read_text() == "kept: 1\n"
    with pytest.raises(DataError, match="inside the dataset"):
        write_draft(droid_like, droid_like / "meta" / "robot.yaml", action_horizon=4)
    assert not (droid_like / "meta" / "robot.yaml").exists()
    write_draft(droid_like, out, action_horizon=4, overwrite=True)
    assert '"droid_like":' in out.read_text()


def test_a_dataset_without_an_action_column_is_one_clear_error(droid_like, tmp_path):
    import shutil

    copy = tmp_path / "no_action"
    shutil.copytree(droid_like, copy)
    info_path = copy / "meta/info.json"
    info = json.loads(info_path.read_text())
    info["features"]["command"] = info["features"].pop("action")
    info_path.write_text(json.dumps(info))
    with pytest.raises(DataError, match="no action column.*float vector columns: .*command"):
        draft_embodiment(copy)


def test_cli_writes_the_draft_and_prints_the_next_command(droid_like, tmp_path, capsys):
    out = tmp_path / "r.yaml"
    assert main(["embodiment", "init", str(droid_like), "--out", str(out), "--tag", "lab_arm", "--view-size", "64",
                 "96", "--action-horizon", "24"]) == 0
    printed = capsys.readouterr().out
    assert f"dz data check {droid_like} --embodiment lab_arm --embodiments {out}" in printed
    emb = load_embodiments([out])["lab_arm"]
    assert emb.view_size == (64, 96) and emb.action_horizon == 24
    assert main(["embodiment", "init", str(droid_like), "--out", str(out)]) == 2  # exists: refused, one line
    assert "exists" in capsys.readouterr().err


def test_tags_load_back_as_the_strings_written(droid_like, tmp_path):
    """A tag YAML would read as a boolean is quoted; a directory name that is a number gets a prefix; a tag that
    is no name is refused."""
    tag, path = write_draft(droid_like, tmp_path / "yes.yaml", tag="yes", action_horizon=4)
    assert tag == "yes" and "yes" in load_embodiments([path])
    import shutil

    numbered = tmp_path / "2024"
    shutil.copytree(droid_like, numbered)
    tag, path = write_draft(numbered, tmp_path / "n.yaml", action_horizon=4)
    assert tag == "robot_2024" and tag in load_embodiments([path])
    with pytest.raises(DataError, match="--tag 'a: b'"):
        draft_embodiment(droid_like, tag="a: b")


# --- the robot: block, the action horizon of a preset -------------------------------------------------------------

@pytest.fixture(scope="module")
def g1_like(tmp_path_factory):
    """A humanoid's layout: one head camera, 26 joint positions (named joint_0..joint_25) as state and action."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("g") / "g1_walk", num_episodes=2, episode_length=30,
                                  image_size=32, codec="libx264", embodiment="unitree_g1")


def _action_range(dataset):
    import numpy as np
    import pyarrow.parquet as pq

    rows = np.concatenate([np.stack(pq.read_table(f, columns=["action"])["action"].to_numpy(zero_copy_only=False))
                           for f in sorted((dataset / "data").glob("**/*.parquet"))])
    return rows.min(axis=0), rows.max(axis=0)


def test_a_humanoid_gets_a_humanoid_robot_block_with_the_datas_range_and_joint_names(g1_like, tmp_path):
    import numpy as np

    tag, path = write_draft(g1_like, tmp_path / "g1.yaml", action_horizon=4)
    robot = load_embodiments([path])[tag].robot
    assert robot is not None and robot.kind == "humanoid" and robot.action_space == "joint"
    assert robot.action_mode == "absolute" and robot.control_rate_hz == 10 and robot.name
    lo, hi = _action_range(g1_like)
    margin = 0.05 * (hi - lo)
    np.testing.assert_allclose(robot.action_min, lo - margin, atol=2e-4)
    np.testing.assert_allclose(robot.action_max, hi + margin, atol=2e-4)
    assert all(a <= b for a, b in zip(robot.action_min, lo - margin + 1e-9))  # rounded outwards, never inwards
    assert robot.joint_names == tuple(f"joint_{i}" for i in range(26))
    comment = path.read_text().split("  robot:")[0].rsplit("sampling: multi_anchor", 1)[1]
    assert "guessed from 26 action dims" in comment and "Check every field" in comment


def test_a_franka_like_dataset_gets_a_franka_block_without_limits(droid_like, tmp_path):
    tag, path = write_draft(droid_like, tmp_path / "droid.yaml", action_horizon=4)
    robot = load_embodiments([path])[tag].robot
    assert robot.kind == "franka" and robot.action_min is None and robot.joint_names is None
    assert "--robot" in path.read_text()  # a Franka's site config goes to dz package


def test_a_small_arm_gets_a_generic_arm_block(tmp_path):
    from tests.data.lerobot_writers import write_v21

    root = write_v21(tmp_path / "arm_ds", lengths=(6, 5), codec="libx264")
    tag, path = write_draft(root, tmp_path / "arm.yaml", action_horizon=4)
    robot = load_embodiments([path])[tag].robot
    assert robot.kind == "arm" and robot.joint_names == ("a0", "a1", "a2") and len(robot.action_min) == 3


def test_the_preset_sets_the_action_horizon_and_the_advice_comes_from_the_presets(g1_like, tmp_path, capsys):
    from dzmodel.model.args import preset

    tiny = preset("tiny").num_action_per_block
    for name in ("tiny", "small", "dreamzero_5b", "dreamzero_14b"):
        out = tmp_path / f"{name}.yaml"
        assert main(["embodiment", "init", str(g1_like), "--out", str(out), "--preset", name]) == 0
        assert load_embodiments([out])["g1_walk"].action_horizon == preset(name).num_action_per_block
    default = tmp_path / "default.yaml"
    assert main(["embodiment", "init", str(g1_like), "--out", str(default)]) == 0  # the docs' first run: tiny
    assert load_embodiments([default])["g1_walk"].action_horizon == tiny
    text = default.read_text()
    advice = ", ".join(f"{n} {preset(n).num_action_per_block}" for n in ("tiny", "small", "dreamzero_5b",
                                                                          "dreamzero_14b"))
    assert advice in text and "16 for tiny" not in text
    with pytest.raises(SystemExit):
        main(["embodiment", "init", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert advice in helptext and "16: tiny" not in helptext
    # another horizon than the preset's: the draft says which model setting then matches it
    other = tmp_path / "other.yaml"
    assert main(["embodiment", "init", str(g1_like), "--out", str(other), "--action-horizon", "16"]) == 0
    assert "train.model_overrides.num_action_per_block: 16" in other.read_text()


def test_the_layout_sentence_counts_views_in_good_english(g1_like, droid_like):
    _, one = draft_embodiment(g1_like, action_horizon=4)
    _, three = draft_embodiment(droid_like, action_horizon=4)
    assert "The video shows one view: the head camera." in one and "1 horizontal views" not in one
    assert "3 horizontal views" in three


def test_a_franka_of_joint_positions_gets_the_keys_its_published_limits_apply_to(tmp_path):
    """Seven absolute joint positions named as such: the draft splits the action into joint_position, which a Franka
    bundle clips to the Panda's published joint limits; LIBERO-like end-effector deltas stay one key."""
    import shutil

    libero = make_synthetic_dataset(tmp_path / "libero_like", num_episodes=1, episode_length=20, image_size=32,
                                    codec="libx264")
    tag, path = write_draft(libero, tmp_path / "libero.yaml", action_horizon=4)
    emb = load_embodiments([path])[tag]
    assert emb.robot.kind == "franka" and (emb.robot.action_space, emb.robot.action_mode) == ("end_effector", "delta")
    joints = tmp_path / "panda_joints"
    shutil.copytree(libero, joints)
    info = json.loads((joints / "meta/info.json").read_text())
    info["features"]["action"]["names"] = [f"joint_{i}" for i in range(1, 8)]
    (joints / "meta/info.json").write_text(json.dumps(info))
    tag, path = write_draft(joints, tmp_path / "panda.yaml", action_horizon=4)
    emb = load_embodiments([path])[tag]
    assert emb.robot.kind == "franka" and (emb.robot.action_space, emb.robot.action_mode) == ("joint", "absolute")
    assert [(k.name, k.column, k.start, k.end) for k in emb.action] == [("joint_position", "action", 0, 7)]
    from dzmodel.serve.franka import JOINT_MAX, JOINT_MIN, action_limits

    assert action_limits(emb, 7) == (list(JOINT_MIN), list(JOINT_MAX))


def test_a_dataset_written_by_lerobot_itself_drafts_as_an_arm_with_its_joint_names(tmp_path):
    """An SO-101 arm recorded with lerobot's own writer (as docs/data.md says to import it), then drafted: six named
    joints are an arm of the data's limits, at the tiny preset's view scale."""
    import numpy as np

    pytest.importorskip("lerobot")
    from dzmodel.data.embodiment_draft import draft_embodiment
    from dzmodel.data.embodiments import parse_embodiment
    from dzmodel.data.lerobot_compat import import_lerobot_dataset

    _, LeRobotDataset = import_lerobot_dataset()
    names = ["shoulder_pan.pos", "shoulder_lift.pos", "elbow_flex.pos", "wrist_flex.pos", "wrist_roll.pos",
             "gripper.pos"]
    features = {"action": {"dtype": "float32", "shape": (6,), "names": names},
                "observation.state": {"dtype": "float32", "shape": (6,), "names": names},
                "observation.images.front": {"dtype": "video", "shape": (48, 64, 3),
                                             "names": ["height", "width", "channels"]}}
    ds = LeRobotDataset.create(repo_id="lab/so101", fps=30, root=tmp_path / "so101", robot_type="so101_follower",
                               features=features, use_videos=True)
    t = np.arange(12, dtype=np.float32)[:, None]
    traj = np.concatenate([80 * np.sin(t / 4 + np.arange(5)), 50 + 50 * np.sin(t / 3)], axis=1).astype(np.float32)
    for _ in range(2):
        for i in range(len(traj) - 1):
            ds.add_frame({"action": traj[i + 1], "observation.state": traj[i], "task": "pick up the cube",
                          "observation.images.front": np.full((48, 64, 3), 10 * i, np.uint8)})
        ds.save_episode()
    if hasattr(ds, "finalize"):
        ds.finalize()
    tag, text = draft_embodiment(tmp_path / "so101", presets={"tiny": 4}, preset="tiny")
    emb = parse_embodiment(tag, yaml.safe_load(text)[tag])
    robot = yaml.safe_load(text)[tag]["robot"]
    assert robot["kind"] == "arm" and robot["joint_names"] == names and robot["name"] == "so101_follower"
    low, high = traj[1:].min(0), traj[1:].max(0)
    assert np.all(np.array(robot["action_min"]) < low) and np.all(np.array(robot["action_max"]) > high)
    assert emb.action_horizon == 4 and max(emb.view_size) <= 64
    assert "an arm, guessed from" in text and "a gripper's" in text


def test_lerobot_imports_only_through_the_helper_in_this_venv():
    """The claim docs/data.md makes: in the project's venv a plain import of lerobot's dataset module fails on
    torchvision (lerobot's CUDA build beside the CPU torch), and the helper makes it import."""
    import subprocess
    import sys

    pytest.importorskip("lerobot")
    plain = subprocess.run([sys.executable, "-c", "import lerobot.datasets.lerobot_dataset"], capture_output=True,
                           text=True, timeout=300)
    if plain.returncode == 0:
        pytest.skip("lerobot imports plainly here (a torchvision that matches torch); the helper is not needed")
    assert "torchvision::nms" in plain.stderr
    helped = subprocess.run([sys.executable, "-c", "from dzmodel.data.lerobot_compat import import_lerobot_dataset;"
                             " print(import_lerobot_dataset()[1].__name__)"], capture_output=True, text=True,
                            timeout=300)
    assert helped.returncode == 0 and helped.stdout.strip() == "LeRobotDataset", helped.stderr
