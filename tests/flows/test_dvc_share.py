"""Which of the flow's stages share DVC's workspace (tasks/dvc_share.py), where they write, and their keys. The flow
and DVC running on one project end to end: tests/test_dvc.py (slow)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from dzmodel import pipeline
from dzmodel.config import StagePaths, load_params
from dzmodel.pipeline import STAGES
from dzmodel.runs import link_stage, start_view
from tasks import dvc_share
from tasks.stages import cache_key
from tests.flows.test_sft_pipeline import _fake_stages, prefect_env  # noqa: F401  (the ephemeral Prefect fixture)

ROOT = Path(__file__).resolve().parents[2]


def _project(tmp_path: Path, profile: str = "demo", dvc: bool = True) -> Path:
    """A project folder with the repository's params.yaml (selecting `profile`) and dvc.yaml."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "params.yaml").read_text().replace("profile: demo", f"profile: {profile}", 1)
    (tmp_path / "params.yaml").write_text(text)
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    if dvc:
        (tmp_path / ".dvc").mkdir()
    return tmp_path


def _prof(*overrides, profile="demo"):
    return load_params(ROOT / "params.yaml", list(overrides), profile).selected(profile)


def test_every_stage_is_shared_when_the_flow_runs_params_yaml_as_dvc_does(tmp_path, monkeypatch):
    monkeypatch.chdir(_project(tmp_path))
    assert dvc_share.shared_stages(tmp_path, "demo", _prof()) == tuple(STAGES)


def test_a_set_param_shares_only_the_stages_it_does_not_reach(tmp_path, monkeypatch):
    root = _project(tmp_path)
    monkeypatch.chdir(root)
    assert dvc_share.shared_stages(root, "demo", _prof("train.lr=0.01")) == ("fetch", "metadata", "vision", "cache")
    assert dvc_share.shared_stages(root, "demo", _prof("eval.episodes=3")) == (
        "fetch", "metadata", "vision", "cache", "train", "convert")
    # a fetch change reaches every stage below it, whatever their own params
    assert dvc_share.shared_stages(root, "demo", _prof("fetch.synth_episodes=7")) == ()


def test_nothing_is_shared_outside_a_dvc_project_for_another_profile_or_from_another_folder(tmp_path, monkeypatch):
    plain = _project(tmp_path / "a", dvc=False)
    monkeypatch.chdir(plain)
    assert dvc_share.shared_stages(plain, "demo", _prof()) == ()
    other = _project(tmp_path / "b", profile="libero_goal")  # dvc.yaml runs the profile params.yaml selects
    monkeypatch.chdir(other)
    assert dvc_share.shared_stages(other, "demo", _prof()) == ()
    project = _project(tmp_path / "c")
    assert dvc_share.shared_stages(project, "demo", _prof()) == ()  # dvc.yaml's paths are relative to the project
    monkeypatch.chdir(project)
    assert dvc_share.shared_stages(project, "demo", _prof()) == tuple(STAGES)


def test_one_run_at_a_time_holds_the_workspace_and_dz_stage_waits_for_none(tmp_path, monkeypatch, capsys):
    from dzmodel.cli import main

    monkeypatch.chdir(_project(tmp_path))
    first, second = dvc_share.Workspace(tmp_path, "demo"), dvc_share.Workspace(tmp_path, "demo")
    assert first.claim() and not second.claim()  # a second flow run keeps its outputs under cache keys
    try:
        assert main(["stage", "metadata", "--profile", "demo"]) == 1  # dvc repro's command, refused at once
        err = capsys.readouterr().err
        assert "runs/demo: a pipeline run (dz pipeline run) that shares this profile's DVC workspace is writing" in err
        assert not (tmp_path / "runs" / "demo" / "metadata").exists()
    finally:
        first.release()
    assert second.claim()
    second.release()


def test_a_stage_is_committed_only_as_this_run_made_it(tmp_path, monkeypatch):
    """params.yaml edited while the stage ran, or its outputs replaced since: no commit."""
    from dzmodel.stages import code_fingerprint

    root = _project(tmp_path)
    monkeypatch.chdir(root)
    prof = _prof()
    paths = StagePaths(root, "demo", keyed=True).with_key("metadata", "k").share("metadata")
    out = paths.metadata
    out.parent.mkdir(parents=True)
    out.write_text("{}")
    result = {"outputs_fingerprint": dvc_share.current_fingerprint("metadata", paths)}
    code = code_fingerprint("metadata")
    assert dvc_share._not_committable("metadata", paths, prof, result, code) is None
    assert "code changed" in dvc_share._not_committable("metadata", paths, prof, result, "0" * 16)
    out.write_text('{"another": "run"}')
    assert "not the ones this run recorded" in dvc_share._not_committable("metadata", paths, prof, result, code)
    result = {"outputs_fingerprint": dvc_share.current_fingerprint("metadata", paths)}
    text = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(text.replace("heldout_episodes: 2", "heldout_episodes: 3", 1))
    assert "no longer gives it" in dvc_share._not_committable("metadata", paths, prof, result, code)


def test_a_shared_stage_writes_where_dvc_yaml_puts_it_and_the_others_under_their_keys(tmp_path):
    paths = StagePaths(tmp_path, "demo", keyed=True)
    for stage in STAGES:
        paths = paths.with_key(stage, f"dz-{stage}-{'0' * 24}")
    paths = paths.share("fetch").share("metadata").share("train")
    plain = StagePaths(tmp_path, "demo")
    assert paths.dataset == plain.dataset == tmp_path / "data" / "demo" / "dataset"
    assert paths.stage("train") == plain.stage("train") and paths.metrics("train") == plain.metrics("train")
    assert paths.plots("train") == tmp_path / "metrics" / "demo" / "plots"
    assert paths.record("train") == plain.record("train") and paths.train_config == plain.train_config
    assert paths.stage("eval") == tmp_path / "runs" / "demo" / "store" / "eval" / f"dz-eval-{'0' * 24}" / "eval"
    assert paths.metrics("eval").is_relative_to(paths.store("eval"))
    assert paths.key("train") == f"dz-train-{'0' * 24}"  # kept: the run's record and MLflow name it


def test_a_shared_stage_and_a_keyed_one_never_share_a_cache_key():
    prof = _prof()
    for stage in STAGES:
        assert cache_key(stage, prof, ["u"], shared=True) != cache_key(stage, prof, ["u"])
    assert cache_key("train", prof, ["u"], shared=False) == cache_key("train", prof, ["u"])


def test_the_run_view_links_a_shared_stage_and_nothing_else_of_the_profile_folder(tmp_path):
    paths = StagePaths(tmp_path, "demo", keyed=True).with_key("train", "dz-train-" + "1" * 24).share("train")
    home = tmp_path / "runs" / "demo"
    for rel in ("train/checkpoints/a.pt", "train_config.json", "stages/train.json", "eval/results.csv",
                "store/eval/x/eval/r.csv"):
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text("x")
    (tmp_path / "metrics" / "demo" / "plots").mkdir(parents=True)
    (tmp_path / "metrics" / "demo" / "train.json").write_text("{}")
    (tmp_path / "metrics" / "demo" / "plots" / "losses.png").write_text("png")
    (tmp_path / "metrics" / "demo" / "plots" / "success_vs_step.png").write_text("another stage's")
    start_view(paths, "demo-00000000-1", {})
    links = link_stage(paths, "demo-00000000-1", "train", {"plots": ["metrics/demo/plots/losses.png"]})
    view = home / "demo-00000000-1"
    assert sorted(str(link.relative_to(view)) for link in links) == [
        "metrics/train.json", "plots/losses.png", "stages/train.json", "train", "train_config.json"]
    assert (view / "train" / "checkpoints" / "a.pt").read_text() == "x"
    assert json.loads((view / "run.json").read_text())["stages"]["train"] == "dz-train-" + "1" * 24


def test_a_b_a_at_dvc_yamls_places_registers_what_each_run_trained(prefect_env, tmp_path, monkeypatch):  # noqa: F811
    """lr A, then params.yaml changed to lr B (as `dvc repro` after an edit would run it), then back to A: the third
    run's cached results describe train outputs that B's run has replaced at dvc.yaml's places, so it trains
    again, and registers A's weights (version 1), never B's under A's params."""
    from mlflow.tracking import MlflowClient

    from flows.sft_pipeline import sft_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = _project(tmp_path)
    monkeypatch.chdir(root)
    calls: list[str] = []
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages(calls))
    text = (root / "params.yaml").read_text()
    runs = []
    for lr in ("2.0e-3", "4.0e-3", "2.0e-3"):
        (root / "params.yaml").write_text(text.replace("lr: 3.0e-3", f"lr: {lr}", 1))
        runs.append(sft_pipeline("demo", root=str(root), overrides=["promote.max_action_error_ratio=0.5"]))
    assert all(r["shared_with_dvc"] == list(STAGES) for r in runs)
    assert calls.count("train") == 3 and calls.count("fetch") == 1
    assert [r["promotion"]["version"] for r in runs] == ["1", "2", "1"]
    client = MlflowClient(tracking_uri=runs[0]["mlflow_uri"], registry_uri=runs[0]["mlflow_uri"])
    version = client.get_model_version("dreamzero-demo", "1")
    assert version.tags["weights.sha256"] == hashlib.sha256(b"trained at lr 0.002, step 3").hexdigest()
    assert (root / "runs" / "demo" / "train").is_dir() and not (root / "runs" / "demo" / "store" / "train").exists()
