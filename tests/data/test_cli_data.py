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
