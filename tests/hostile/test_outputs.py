"""No command deletes or writes into a directory it did not make, and a file where a directory should be (or a
full disk) is one line naming the path, with nothing of the user's touched. Run as users run them: `dz ...`."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from dzmodel.cli import main
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.train.trainer import train
from tests.tiny_data import make_one_step_run

ROBOT = {"robot_ip": "172.16.0.2", "camera_serials": ["a", "b"], "target_ee_pose": [0.5, 0.0, 0.3, 3.14, 0.0, 0.0],
         "workspace_min": [0.2, -0.4, 0.05], "workspace_max": [0.8, 0.4, 0.6]}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny dataset, a one-step run and its conversion: real inputs for every command."""
    root = make_one_step_run(tmp_path_factory.mktemp("outputs"))
    convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf")
    (root / "robot.json").write_text(json.dumps(ROBOT))
    return root


def _data(r: Path) -> list[str]:
    return ["--dataset", str(r / "ds"), "--embodiment", "tabletop_pusher", "--embodiments", str(r / "emb.yaml"),
            "--metadata", str(r / "meta.json")]


# command -> argv for an output directory `out` (made: the fixture's root)
COMMANDS = {
    "convert": lambda r, out: ["convert", str(r / "run"), "--out", str(out)],
    "cache": lambda r, out: ["cache", "--preset", "tiny", "--synthetic", "2", "--out", str(out)],
    "package": lambda r, out: ["package", str(r / "hf"), "--robot", str(r / "robot.json"), "--version", "1.0.0",
                               "--out", str(out)],
    "train": lambda r, out: ["train", "--preset", "tiny", *_data(r), "--steps", "1", "--out", str(out)],
    "data synth": lambda r, out: ["data", "synth", str(out), "--episodes", "1", "--length", "8", "--image-size", "32",
                                  "--codec", "h264"],
    "data record": lambda r, out: ["data", "record", "libero", "--suite", "object", "--tasks", "0", "--episodes", "1",
                                   "--out", str(out)],
    "eval libero": lambda r, out: ["eval", "libero", str(r / "hf"), "--episodes", "1", "--out", str(out)],
    "eval action-error": lambda r, out: ["eval", "action-error", str(r / "hf"), "--out", str(out)],
    "eval previews": lambda r, out: ["eval", "previews", str(r / "hf"), "--out", str(out)],
    "eval probe": lambda r, out: ["eval", "probe", str(r / "ds"), "--embodiment", "tabletop_pusher", "--embodiments",
                                  str(r / "emb.yaml"), "--out", str(out)],
    "eval oracle": lambda r, out: ["eval", "oracle", str(r / "ds"), "--out", str(out)],
}


def _users_dir(tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "thesis.tex").write_text("three years of work\n")
    (out / "notes" / "a.txt").write_text("a\n")
    return out, _snapshot(out)


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_users_directory_is_refused_and_untouched(command, made, tmp_path, capsys):
    out, before = _users_dir(tmp_path)
    assert main(COMMANDS[command](made, out)) != 0
    err = _one_line_error(capsys)
    assert str(out) in err and "--overwrite" in err and "did not write" in err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary left beside it


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_file_where_the_output_directory_goes_is_refused(command, made, tmp_path, capsys):
    out = tmp_path / "results"
    out.write_text("not a directory\n")
    assert main(COMMANDS[command](made, out)) != 0
    err = _one_line_error(capsys)
    assert str(out) in err and "file" in err
    assert out.read_text() == "not a directory\n"


@pytest.mark.parametrize("command", ["convert", "cache", "train", "eval probe"])
def test_an_output_under_a_file_is_refused(command, made, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(COMMANDS[command](made, blocker / "sub" / "out")) != 0
    assert str(blocker) in _one_line_error(capsys)
    assert blocker.read_text() == "x"


def test_data_metadata_refuses_a_file_it_did_not_write(made, tmp_path, capsys):
    out = tmp_path / "stats.json"
    out.write_text('{"budget": 12}\n')
    argv = ["data", "metadata", str(made / "ds"), "--embodiment", "tabletop_pusher", "--embodiments",
            str(made / "emb.yaml"), "--out", str(out)]
    assert main(argv) != 0
    err = _one_line_error(capsys)
    assert str(out) in err and "--overwrite" in err
    assert main(argv + ["--merge"]) != 0  # merging into a user's JSON would rewrite it too
    assert str(out) in _one_line_error(capsys)
    assert out.read_text() == '{"budget": 12}\n'
    out.unlink()
    assert main(argv) == 0 and main(argv) == 0  # its own earlier output is replaced
    capsys.readouterr()
    (tmp_path / "dir.json").mkdir()
    assert main(argv[:-1] + [str(tmp_path / "dir.json")]) != 0
    assert "is a directory" in _one_line_error(capsys)


def test_data_fetch_refuses_a_directory_it_did_not_write(made, tmp_path, capsys):
    out, before = _users_dir(tmp_path)
    assert main(["data", "fetch", "synthetic", "--dest", str(tmp_path), "--name", out.name,
                 "--synth-episodes", "1"]) != 0
    err = _one_line_error(capsys)
    assert str(out) in err and "not written by" in err
    assert _snapshot(out) == before
    blocker = tmp_path / "datasets"
    blocker.write_text("x")
    assert main(["data", "fetch", "synthetic", "--dest", str(blocker), "--synth-episodes", "1"]) != 0
    assert str(blocker) in _one_line_error(capsys) and blocker.read_text() == "x"


def test_convert_replaces_its_own_output_and_a_foreign_one_only_with_overwrite(made, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["convert", str(made / "run"), "--out", str(out)]) == 0
    assert (out / ".dz-output").is_file() and (out / "config.json").is_file()
    assert main(["convert", str(made / "run"), "--out", str(out)]) == 0  # dz's own: replaced
    mine, _ = _users_dir(tmp_path)
    assert main(["convert", str(made / "run"), "--out", str(mine), "--overwrite"]) == 0  # asked for explicitly
    assert (mine / "config.json").is_file() and not (mine / "thesis.tex").exists()


def test_train_resumes_its_own_run_and_refuses_a_users_directory(made, tmp_path, capsys):
    out, before = _users_dir(tmp_path)
    with pytest.raises(ValueError, match="did not write"):
        train(TrainConfig(preset="tiny", datasets=[str(made / "ds")], embodiment="tabletop_pusher",
                          embodiment_files=[str(made / "emb.yaml")], metadata=str(made / "meta.json"), steps=1,
                          out_dir=str(out), progress=False))
    assert _snapshot(out) == before
    assert (made / "run" / ".dz-output").is_file()  # the fixture's run is marked, so it resumes


def test_full_disk_while_converting_leaves_the_old_output_and_no_temporary(made, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    assert main(["convert", str(made / "run"), "--out", str(out)]) == 0
    before = _snapshot(out)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out) + ".part")

    monkeypatch.setattr("dzmodel.train.convert.save_dreamzero_dir", full)
    assert main(["convert", str(made / "run"), "--out", str(out)]) != 0
    err = _one_line_error(capsys)
    assert str(out) in err and "no space left" in err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_publish_dir_keeps_the_old_output_when_the_build_fails(tmp_path):
    from dzmodel.outputs import publish_dir

    out = tmp_path / "out"
    with publish_dir(out, "test") as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(RuntimeError):
        with publish_dir(out, "test") as tmp:
            (tmp / "v").write_text("2")
            raise RuntimeError("killed halfway")
    assert (out / "v").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_dir_rechecks_before_the_rename(tmp_path):
    """A user's files that appear while the output is being built are not replaced either."""
    from dzmodel.outputs import OutputError, publish_dir

    out = tmp_path / "out"
    with pytest.raises(OutputError, match="did not write"):
        with publish_dir(out, "test") as tmp:
            (tmp / "v").write_text("new")
            out.mkdir()
            (out / "users.txt").write_text("mine")
    assert (out / "users.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_outputs_are_readable_by_the_group(tmp_path):
    import os
    import stat

    from dzmodel.outputs import claim_dir, publish_dir

    old = os.umask(0o022)
    try:
        with publish_dir(tmp_path / "out", "test") as tmp:
            (tmp / "f").write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) & 0o050 == 0o050
    claim_dir(tmp_path / "claimed", "test")
    assert stat.S_IMODE((tmp_path / "claimed").stat().st_mode) & 0o050 == 0o050


def test_another_commands_output_is_never_replaced(made, tmp_path, capsys):
    """A run directory or a releases folder is dz's, but not convert's or cache's to replace."""
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", *_data(made), "--steps", "1", "--out", str(run)]) == 0
    releases = tmp_path / "releases"
    assert main(["package", str(made / "hf"), "--robot", str(made / "robot.json"), "--version", "1.0.0",
                 "--out", str(releases)]) == 0
    capsys.readouterr()
    for target in (run, releases):
        before = _snapshot(target)
        for argv in (COMMANDS["convert"](made, target), COMMANDS["cache"](made, target),
                     COMMANDS["data synth"](made, target), COMMANDS["eval probe"](made, target)):
            assert main(argv) != 0
            err = _one_line_error(capsys)
            assert str(target) in err and "another command's output" in err, err
        assert _snapshot(target) == before


def test_data_synth_keeps_files_that_appear_in_out_while_it_builds(tmp_path, monkeypatch, capsys):
    import dzmodel.data.synth as synth

    out = tmp_path / "ds"
    real = synth._write_dataset

    def meanwhile(root, *args):
        real(root, *args)
        out.mkdir(exist_ok=True)
        (out / "users_notes.txt").write_text("mine")

    monkeypatch.setattr(synth, "_write_dataset", meanwhile)
    assert main(COMMANDS["data synth"](None, out)) != 0
    assert "did not write" in _one_line_error(capsys)
    assert (out / "users_notes.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["users_notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_the_pipeline_adopts_its_own_earlier_stage_outputs_and_nothing_else(tmp_path):
    """Stage outputs written before directories carried the marker are the pipeline's when its stage record
    says so; a directory in a stage's place without that record is refused, untouched."""
    from dzmodel.config import StagePaths
    from dzmodel.outputs import OutputError
    from dzmodel.pipeline import _adopt_earlier_outputs
    from dzmodel.stages.common import content_fingerprint, fresh_dir

    paths = StagePaths(tmp_path, "demo")
    legacy = paths.stage("eval")
    legacy.mkdir(parents=True)
    (legacy / "results.csv").write_text("step,rate\n")
    with pytest.raises(OutputError, match="Its place is fixed"):
        fresh_dir(legacy)
    assert (legacy / "results.csv").is_file()
    before = content_fingerprint(legacy)
    (paths.run / "stages").mkdir()
    (paths.run / "stages" / "eval.json").write_text("{}")
    _adopt_earlier_outputs("eval", paths)
    assert content_fingerprint(legacy) == before  # the marker is not part of an output
    assert fresh_dir(legacy) == legacy and sorted(p.name for p in legacy.iterdir()) == [".dz-output"]


def test_a_failed_swap_puts_the_old_output_back(tmp_path, monkeypatch):
    import os

    from dzmodel.atomic import replace_dir

    dest, tmp = tmp_path / "out", tmp_path / "new"
    dest.mkdir()
    (dest / "v").write_text("old")
    tmp.mkdir()
    real, calls = os.replace, []

    def second_fails(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError("the rename failed")
        return real(a, b)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError, match="rename failed"):
        replace_dir(tmp, dest)
    monkeypatch.undo()
    assert (dest / "v").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out"]
