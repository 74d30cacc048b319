"""`dz data ...` end to end on the embedded dataset."""

import json

from dzmodel.cli import main


def test_synth_check_metadata_and_fetch(tmp_path, capsys):
    ds = tmp_path / "synth"
    assert main(["data", "synth", str(ds), "--episodes", "3", "--length", "40", "--image-size", "32", "--codec", "h264"]) == 0
    assert "LeRobot v3.0" in capsys.readouterr().out
    assert main(["data", "check", str(ds), "--embodiment", "libero_sim", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "lerobot 0.4.4 agrees: 3 episodes, 120 frames" in out and "state 8 dims, action 7 dims" in out
    meta = tmp_path / "meta" / "metadata.json"
    meta.parent.mkdir()
    assert main(["data", "metadata", str(ds), "--embodiment", "libero_sim", "--out", str(meta)]) == 0
    assert set(json.loads(meta.read_text())) == {"libero_sim"}
    assert main(["data", "metadata", str(ds), "--embodiment", "franka_pnp", "--out", str(meta), "--merge"]) == 0
    assert set(json.loads(meta.read_text())) == {"libero_sim", "franka_pnp"}
    held = tmp_path / "meta" / "held.json"  # as the pipeline writes it for train.heldout_episodes 1
    assert main(["data", "metadata", str(ds), "--embodiment", "libero_sim", "--out", str(held), "--heldout-episodes", "1"]) == 0
    assert "statistics from 2 episodes" in capsys.readouterr().out
    assert json.loads(held.read_text())["libero_sim"]["heldout_episodes"] == [2]
    # never inside the dataset
    assert main(["data", "metadata", str(ds), "--embodiment", "libero_sim", "--out", str(ds / "m.json")]) == 2
    assert "never written into a dataset" in capsys.readouterr().err
    assert not (ds / "m.json").exists()
    # fetch a local path into the data directory, twice (idempotent)
    dest = tmp_path / "data"
    assert main(["data", "fetch", str(ds), "--dest", str(dest)]) == 0
    assert main(["data", "fetch", str(ds), "--dest", str(dest)]) == 0
    assert (dest / "synth" / "meta" / "info.json").is_file()


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["data", "check", str(tmp_path)]) == 2
    assert "info.json" in capsys.readouterr().err
    assert main(["data", "metadata", str(tmp_path), "--embodiment", "nope", "--out", str(tmp_path / "x.json")]) == 2
    assert "unknown embodiment tag 'nope'" in capsys.readouterr().err


def _v21_missing_one_video(tmp_path):
    """A v2.1 dataset of three episodes whose episode 1 lacks one camera's video, and its embodiment file."""
    from dzmodel.data.lerobot_format import open_dataset
    from tests.data.lerobot_writers import CAMERAS, write_test_arm_yaml, write_v21

    root = write_v21(tmp_path / "v21", lengths=(12, 11, 13), codec="libx264")
    open_dataset(root).video_file(1, CAMERAS[-1]).unlink()
    return root, write_test_arm_yaml(tmp_path / "arm.yaml")


def test_metadata_names_the_episodes_it_leaves_out(tmp_path, capsys):
    root, arm = _v21_missing_one_video(tmp_path)
    base = ["data", "metadata", str(root), "--embodiment", "test_arm", "--embodiments", str(arm)]
    assert main(base + ["--out", str(tmp_path / "all.json")]) == 0
    out = capsys.readouterr().out
    assert "episode(s) [1]" in out and "--skip-missing" in out  # in the statistics, and how to leave them out
    assert main(base + ["--out", str(tmp_path / "m.json"), "--skip-missing", "--heldout-episodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "statistics from 1 episodes" in out and "left out episode(s) [1] (missing video files)" in out
    assert "[2] (held out" in out
    entry = json.loads((tmp_path / "m.json").read_text())["test_arm"]
    assert entry["skipped_episodes"] == [1] and entry["heldout_episodes"] == [2]


def test_check_with_skip_missing_lists_the_skipped_episodes_without_advising_the_flag(tmp_path, capsys):
    root, arm = _v21_missing_one_video(tmp_path)
    assert main(["data", "check", str(root)]) == 2
    assert "`--skip-missing`" in capsys.readouterr().err  # not given: advised
    assert main(["data", "check", str(root), "--skip-missing", "--embodiment", "test_arm", "--embodiments",
                 str(arm), "--chunks", "2"]) == 0
    out = capsys.readouterr().out.replace(str(tmp_path), "")
    assert "--skip-missing" not in out and "skip_missing" not in out
    assert "episode(s) [1]" in out
