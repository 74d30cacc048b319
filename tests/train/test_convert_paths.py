"""`dz convert` of a run whose train config names its files by relative paths: run from another directory, the
converted model still carries the embodiment, the statistics and the tokenizer; a configured file that is gone is
refused by name (file and config field), and nothing is written."""

import json
import shutil

import pytest

from dzmodel.cli import main
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint

CONFIG = """preset: tiny
datasets: [ds]
embodiment: tabletop_pusher
embodiment_files: [emb.yaml]
metadata: meta.json
tokenizer: tok
steps: 1
save_every: 1
out_dir: run
progress: false
"""


@pytest.fixture(scope="module")
def relative_run(tmp_path_factory, data):
    """A run trained by `dz train --config cfg.yaml` in the project directory, every path in it relative."""
    project = tmp_path_factory.mktemp("project")
    for name in ("ds", "emb.yaml", "meta.json"):
        (shutil.copytree if (data / name).is_dir() else shutil.copyfile)(data / name, project / name)
    (project / "cfg.yaml").write_text(CONFIG)
    mp = pytest.MonkeyPatch()
    mp.chdir(project)
    try:
        assert main(["train", "--config", "cfg.yaml"]) == 0
    finally:
        mp.undo()
    return project


def test_convert_from_another_directory_carries_the_embodiment_statistics_and_tokenizer(relative_run, tmp_path,
                                                                                        monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = convert_checkpoint(resolve_checkpoint(relative_run / "run"), tmp_path / "hf")
    exp = out / "experiment_cfg"
    assert json.loads((exp / "metadata.json").read_text()) == json.loads((relative_run / "meta.json").read_text())
    assert [p.name for p in (exp / "embodiments").iterdir()] == ["00_emb.yaml"]
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    from dzmodel.policy.policy import model_embodiment, read_train_config

    assert model_embodiment(out, read_train_config(out)[0]).tag == "tabletop_pusher"  # what `dz package` needs
    assert main(["package", str(out), "--robot", str(_franka(tmp_path)), "--version", "0.1.0", "--out",
                 str(tmp_path / "dist")]) == 0


@pytest.mark.parametrize("name, field", [("emb.yaml", "train.embodiment_files[0]"), ("meta.json", "train.metadata")])
def test_a_configured_file_that_is_gone_is_refused_by_name(relative_run, tmp_path, monkeypatch, capsys, name,
                                                          field):
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(relative_run / name, moved / name)
    try:
        monkeypatch.chdir(tmp_path)
        assert main(["convert", str(relative_run / "run"), "--out", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert name in err and field in err and err.count("dz: error") == 1
        assert not (tmp_path / "hf").exists()
    finally:
        shutil.move(moved / name, relative_run / name)


def test_a_file_gone_from_where_the_run_trained_is_not_taken_from_a_folder_above(relative_run, tmp_path, monkeypatch,
                                                                                 capsys):
    """While the run's directory exists, its relative paths mean files there: a same-named file in a folder above
    the checkpoint (another run's statistics) is not copied in their place."""
    decoy = relative_run / "run" / "meta.json"  # above the checkpoint (run/step_*), not where the run trained
    shutil.move(relative_run / "meta.json", decoy)
    try:
        monkeypatch.chdir(tmp_path)
        assert main(["convert", str(relative_run / "run"), "--out", str(tmp_path / "hf")]) == 2
        assert "train.metadata names meta.json, which is not there" in capsys.readouterr().err
    finally:
        shutil.move(decoy, relative_run / "meta.json")


def _franka(tmp_path):
    from tests.serve.helpers import ROBOT

    path = tmp_path / "robot.json"
    path.write_text(json.dumps(ROBOT))
    return path
