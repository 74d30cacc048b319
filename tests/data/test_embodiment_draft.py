"""`dz embodiment init`: a draft embodiment from a dataset's info.json that loads, checks and samples as written."""

import json

import pytest

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


def test_the_draft_refuses_to_replace_a_file_or_write_into_the_dataset(droid_like, tmp_path):
    out = tmp_path / "mine.yaml"
    out.write_text("kept: 1\n")
    with pytest.raises(DataError, match="exists; pass --overwrite"):
        write_draft(droid_like, out)
    assert out.read_text() == "kept: 1\n"
    with pytest.raises(DataError, match="inside the dataset"):
        write_draft(droid_like, droid_like / "meta" / "robot.yaml")
    assert not (droid_like / "meta" / "robot.yaml").exists()
    write_draft(droid_like, out, overwrite=True)
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
    tag, path = write_draft(droid_like, tmp_path / "yes.yaml", tag="yes")
    assert tag == "yes" and "yes" in load_embodiments([path])
    import shutil

    numbered = tmp_path / "2024"
    shutil.copytree(droid_like, numbered)
    tag, path = write_draft(numbered, tmp_path / "n.yaml")
    assert tag == "robot_2024" and tag in load_embodiments([path])
    with pytest.raises(DataError, match="--tag 'a: b'"):
        draft_embodiment(droid_like, tag="a: b")
