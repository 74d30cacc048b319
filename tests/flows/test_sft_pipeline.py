"""The Prefect flow's orchestration on fast stand-in stages (the real stages run in the slow server tests):
task caching skips unchanged stages, a changed parameter reruns only what it affects, changed outputs force a
rerun; MLflow gets a parent run with nested stage runs, and the registry gate decides the alias."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from dzmodel import pipeline
from dzmodel.config import StagePaths
from dzmodel.serve.bundles import BundleError
from dzmodel.serve.package import _manifest_lines
from dzmodel.stages import STAGE_TABLE
from dzmodel.stages.package import chosen_step
from dzmodel.stages.train import summarize_training

ROOT = Path(__file__).resolve().parents[2]


def _fake_stages(calls: list[str]):
    def write(path: Path, text: str = "x") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def fetch(prof, paths: StagePaths, log):
        calls.append("fetch")
        write(paths.dataset / "meta" / "info.json", json.dumps({"episodes": prof.fetch.synth_episodes}))
        return {"dataset": str(paths.dataset), "episodes": prof.fetch.synth_episodes, "frames": 10, "fps": 10.0,
                "views": []}

    def metadata(prof, paths, log):
        calls.append("metadata")
        write(paths.metadata, "{}")
        return {"metadata": str(paths.metadata), "embodiment": prof.metadata.embodiment,
                "statistics": [{"group": "state", "key": "s", "dim": 0, "mean": 0.0, "std": 1.0, "q01": -1.0, "q99": 1.0}]}

    def vision(prof, paths, log):
        calls.append("vision")
        write(paths.stage("vision") / "DISABLED")
        return {"vision": None}

    def cache(prof, paths, log):
        calls.append("cache")
        write(paths.stage("cache") / "DISABLED")
        return {"cache": None}

    def train(prof, paths, log, on_metrics=None):
        calls.append("train")
        lr = prof.train["lr"]
        rows = [{"step": s, "loss": lr * 100 / s, "action_loss": 0.1, "dynamics_loss": 0.2, "lr": lr, "grad_norm": 1.0,
                 "samples_per_s_per_gpu": 3.0, "mfu": 0.01, "peak_mem_gib": 0.5} for s in (1, 2, 3)]
        write(paths.stage("train") / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        write(paths.stage("train") / "weights.bin", f"trained at lr {lr}")  # what a retrain with these params gives
        if on_metrics:
            on_metrics(rows)
        return summarize_training(paths, paths.stage("train"), 1.0, prof)

    def convert(prof, paths, log):
        calls.append("convert")
        weights = (paths.stage("train") / "weights.bin").read_text()
        for s in (2, 3):
            write(paths.stage("converted") / f"step_{s:07d}" / "config.json", "{}")
            write(paths.stage("converted") / f"step_{s:07d}" / "model.safetensors", f"{weights}, step {s}")
        return {"converted": str(paths.stage("converted")), "steps": [2, 3]}

    def evaluate(prof, paths, log):
        calls.append("eval")
        rows = [{"step": s, "task": "all", "task_name": "", "episodes": prof.eval.episodes, "successes": 1,
                 "rate": 0.5 if s == 3 else 0.0} for s in (2, 3)]
        write(paths.stage("eval") / "results.csv", "step,task,task_name,episodes,successes,rate\n" +
              "".join(f"{r['step']},all,,{r['episodes']},1,{r['rate']}\n" for r in rows))
        write(paths.metrics("eval"), json.dumps({"evaluated": True, "best_step": 3}))
        return {"eval_dir": str(paths.stage("eval")), "evaluated": True, "rows": rows, "best": rows[1], "plot": None}

    def package(prof, paths, log):
        calls.append("package")
        step, rate = chosen_step(prof, paths)
        bundle = paths.stage("package") / f"dreamzero-demo-{step}"
        write(bundle / "robot.json", "{}")
        weights = (paths.stage("converted") / f"step_{step:07d}" / "model.safetensors").read_text()
        write(bundle / "model" / "model.safetensors", weights)  # stand-ins: no loadable model, a real MANIFEST
        write(bundle / "eval" / "summary.json", f"{prof.eval.episodes} eval episodes")
        write(bundle / "MANIFEST", "\n".join(_manifest_lines(bundle)) + "\n")
        write(paths.stage("package") / f"dreamzero-demo-{step}.tar.gz")
        # a stand-in held-out action error: the demo's gate reads its ratio
        action = {"step": step, "trained": 0.1, "ratio": 0.25, "mean_predictor": 0.4, "untrained": 0.9}
        return {"bundle": str(bundle), "tarball": str(paths.stage("package") / f"dreamzero-demo-{step}.tar.gz"),
                "step": step, "success_rate": rate, "model": str(paths.stage("converted") / f"step_{step:07d}"),
                "version": prof.package.version, "action_error": action,
                "weights_sha256": hashlib.sha256(weights.encode()).hexdigest()}

    return {"fetch": fetch, "metadata": metadata, "vision": vision, "cache": cache, "train": train, "convert": convert,
            "eval": evaluate, "package": package}


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory):
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect_results")
    with prefect_test_harness(), temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage}):
        yield


def test_flow_caches_reruns_what_changed_tracks_and_promotes(prefect_env, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.sft_pipeline import sft_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    calls: list[str] = []
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages(calls))

    first = sft_pipeline("demo", root=str(tmp_path), overrides=["promote.min_success=0.4"])
    assert calls == list(pipeline.STAGES) and first["cached_stages"] == []
    assert first["promotion"]["promoted"] and first["promotion"]["version"] == "1"
    assert "not compared with the current model (no version holds @production yet)" in first["promotion"]["reason"]

    calls.clear()
    second = sft_pipeline("demo", root=str(tmp_path), overrides=["promote.min_success=0.4"])
    assert calls == [] and second["cached_stages"] == list(pipeline.STAGES)  # nothing changed: all skipped
    assert second["promotion"]["version"] == "1" and second["promotion"]["registered"].startswith("unchanged")
    assert first["run_name"] != second["run_name"] and first["run_name"].startswith("demo-")
    assert second["run_name"].endswith("-2") and first["run_name"][:-2] == second["run_name"][:-2]

    calls.clear()
    third = sft_pipeline("demo", root=str(tmp_path), overrides=["promote.min_success=0.4", "eval.episodes=3"])
    assert calls == ["eval", "package"]  # only the eval section changed
    # a new bundle around the same policy (another evaluation: only its record files differ) is no new version
    assert third["promotion"]["version"] == "1" and third["promotion"]["registered"].startswith("unchanged"), third
    assert third["promotion"]["promoted"] and "(v1 holds @production already)" in third["promotion"]["reason"]

    calls.clear()
    (tmp_path / "runs" / "demo" / "latest" / "package" / "dreamzero-demo-3.tar.gz").unlink()  # an output went missing
    sft_pipeline("demo", root=str(tmp_path), overrides=["promote.min_success=0.4", "eval.episodes=3"])
    assert calls == ["package"]

    calls.clear()
    refused = sft_pipeline("demo", root=str(tmp_path), overrides=["promote.min_success=0.9", "train.lr=2.0e-3"])
    assert calls == ["train", "convert", "eval", "package"]
    assert not refused["promotion"]["promoted"] and "50.0% < gate 90.0%" in refused["promotion"]["reason"]
    assert "compared" not in refused["promotion"]["reason"]  # refused by the gate: no head to head is run

    client = MlflowClient(tracking_uri=first["mlflow_uri"], registry_uri=first["mlflow_uri"])
    exp = client.get_experiment_by_name("dreamzero-demo")
    parents = client.search_runs([exp.experiment_id], "tags.pipeline = 'sft_pipeline'", order_by=["start_time ASC"])
    assert len(parents) == 5 and all(r.info.status == "FINISHED" for r in parents)
    # the rerun where every stage was cached: one small run pointing at the first, no nested runs, no curves
    runs = {r.info.run_name: r for r in parents}
    original, rerun = runs[first["run_name"]], runs[second["run_name"]]
    assert rerun.data.tags["dz.cached"] == "true" and original.data.tags["dz.cached"] == "false"
    assert rerun.data.tags["dz.original_run_id"] == original.info.run_id == second["original_run_id"]
    assert rerun.data.tags["dz.outputs_key"] == original.data.tags["dz.outputs_key"]
    assert f"/runs/{original.info.run_id}?workflowType=machine_learning" in rerun.data.tags["mlflow.note.content"]
    assert not client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{rerun.info.run_id}'")
    assert client.get_metric_history(rerun.info.run_id, "loss") == [] and "loss" in original.data.metrics
    assert first["original_run_id"] is None and "dz.original_run_id" not in original.data.tags
    last = parents[-1]
    assert last.data.params["train.lr"] == "0.002" and last.data.metrics["train.final_loss"] == pytest.approx(0.2 / 3)
    assert [m.step for m in client.get_metric_history(last.info.run_id, "loss")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(last.info.run_id, "eval.success_rate")] == [2, 3]
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{last.info.run_id}'")
    assert {r.info.run_name: r.data.tags["cached"] for r in children} == {
        "fetch": "true", "metadata": "true", "vision": "true", "cache": "true", "train": "false", "convert": "false",
        "eval": "false", "package": "false"}
    assert {r.info.run_name for r in parents} == {first["run_name"], second["run_name"], refused["run_name"],
                                                   *(r.data.tags["dz.run_name"] for r in parents)}
    # the registry: a new version only for a new policy (runs 1 and 5); the alias stayed on the one that passed
    assert str(client.get_model_version_by_alias("dreamzero-demo", "production").version) == "1"
    assert len(client.search_model_versions("name='dreamzero-demo'")) == 2
    v2 = client.get_model_version("dreamzero-demo", "2")
    assert v2.tags["promotion"] == "refused" and v2.tags["success_rate"] == "0.5"
    assert v2.tags["run_name"] == refused["run_name"] and set(v2.tags) >= {f"key.{s}" for s in pipeline.STAGES}
    # an MLflow 3 model logged by the run (its output: the runs table's Models column), registered from it
    model_id = v2.tags["logged_model_id"]
    logged = client.get_logged_model(model_id)
    assert v2.tags["pyfunc"] == "yes" and v2.source == f"models:/{model_id}"  # the version page's Source Model
    assert client.get_model_version_download_uri("dreamzero-demo", "2") == logged.artifact_location
    assert (logged.source_run_id, logged.experiment_id, logged.name) == (last.info.run_id, last.info.experiment_id,
                                                                          "dreamzero-demo-3")
    assert str(logged.status) in ("READY", "LoggedModelStatus.READY")
    assert [o.model_id for o in client.get_run(last.info.run_id).outputs.model_outputs] == [model_id]
    files = {a.path for a in client.list_logged_model_artifacts(model_id)}
    assert {"MLmodel", "mlflow_policy.py", "artifacts"} <= files  # models-from-code
    assert [a.path for a in client.list_logged_model_artifacts(model_id, "artifacts/dreamzero-demo-3")] == [
        "artifacts/dreamzero-demo-3/MANIFEST", "artifacts/dreamzero-demo-3/eval", "artifacts/dreamzero-demo-3/model",
        "artifacts/dreamzero-demo-3/robot.json"]
    artifacts = {a.path for a in client.list_artifacts(last.info.run_id)}
    assert {"plots", "promotion.json"} <= artifacts

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect_client:
        latest = {a.key: a for a in prefect_client.read_latest_artifacts()}
    assert {"demo-metadata-stats", "demo-train", "demo-eval", "demo-package", "demo-mlflow-run"} <= set(latest)
    assert "samples_per_s_per_gpu" in latest["demo-train"].data and "data:image/png;base64," in latest["demo-train"].data
    assert "| 3 | all |" in latest["demo-eval"].data  # the success table, one row per step
    assert "refused: LIBERO success 50.0% < gate 90.0%" in latest["demo-package"].data
    assert f"/runs/{last.info.run_id}?workflowType=machine_learning)" in latest["demo-mlflow-run"].data

    # the task graph: each stage waits for the stages whose outputs it reads (the edges of Prefect's graph)
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as prefect_client:
        (flow_run,) = prefect_client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[refused["run_name"]])))
        task_runs = prefect_client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]}))
    by_id = {t.id: t.name.split()[0] if " " in t.name else t.name.rsplit("-", 1)[0] for t in task_runs}
    assert all(re.fullmatch(rf"{name} dz-{name}-[0-9a-f]{{24}}", t.name) for t in task_runs
               if (name := by_id[t.id]) in STAGE_TABLE), [t.name for t in task_runs]  # each stage's run: its key
    edges = {by_id[t.id]: {by_id[i.id] for i in t.task_inputs.get("wait_for", [])} for t in task_runs}

    def ancestors(stage):
        return {u for up in STAGE_TABLE[stage].upstream for u in {up, *ancestors(up)}}

    for stage in pipeline.STAGES:  # its upstream stages, at least; never a stage that does not come before it
        assert set(STAGE_TABLE[stage].upstream) <= edges[stage] <= ancestors(stage), stage
    assert edges["register-and-promote"] == {"package"} and edges["fetch"] == set()


def test_a_b_a_registers_what_each_run_trained(prefect_env, tmp_path, monkeypatch):
    """lr A, then B, then A again: every registered version holds the weights that a retrain with its own params
    gives, and the third run, which changes nothing against the first, registers nothing new. (Before stage
    outputs were addressed by cache key, the third run reused the first run's cached results, which pointed at
    folders the second run had overwritten: version 3 was tagged lr A and held lr B's weights.)"""
    from mlflow.tracking import MlflowClient

    from flows.sft_pipeline import sft_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    calls: list[str] = []
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages(calls))
    gate = "promote.max_action_error_ratio=0.5"
    runs = [sft_pipeline("demo", root=str(tmp_path), overrides=[gate, f"train.lr={lr}"])
            for lr in ("2.0e-3", "3.0e-3", "2.0e-3")]
    assert calls.count("train") == 2  # the third run trained nothing: its inputs are the first's
    client = MlflowClient(tracking_uri=runs[0]["mlflow_uri"], registry_uri=runs[0]["mlflow_uri"])
    versions = {v.version: v for v in client.search_model_versions("name='dreamzero-demo'")}
    assert sorted(int(v) for v in versions) == [1, 2]
    assert [r["promotion"]["version"] for r in runs] == ["1", "2", "1"]
    assert runs[2]["promotion"]["registered"].startswith("unchanged")
    # other weights than the alias holder's: the head to head runs; the stand-in stages' bundles hold no model, so it
    # says that it could not compare them, and the absolute gate decides
    assert "not compared with the current model (v1 could not be compared: " in runs[1]["promotion"]["reason"], runs[1]
    for run, lr in zip(runs, ("0.002", "0.003", "0.002")):
        version = versions[int(run["promotion"]["version"])]
        params = client.get_run(run["mlflow_run_id"]).data.params
        assert params["train.lr"] == lr
        retrained = f"trained at lr {float(lr)}, step 3"  # what the fake train + convert write for these params
        assert version.tags["weights.sha256"] == hashlib.sha256(retrained.encode()).hexdigest(), (lr, version.version)
        bundle = Path(run["package"]).with_suffix("").with_suffix("")
        assert (bundle / "model" / "model.safetensors").read_text() == retrained
    # the run views: three names, each linking to the outputs its own keys address
    views = [tmp_path / "runs" / "demo" / r["run_name"] for r in runs]
    assert len({r["run_name"] for r in runs}) == 3 and all((v / "run.json").is_file() for v in views)
    keys = [json.loads((v / "run.json").read_text())["stages"] for v in views]
    assert keys[0] == keys[2] and keys[0]["train"] != keys[1]["train"] and keys[0]["fetch"] == keys[1]["fetch"]
    assert (views[0] / "train").resolve() == (views[2] / "train").resolve() != (views[1] / "train").resolve()
    assert not list(tmp_path.rglob("UNKEYED"))  # no stage wrote where a later stage's key was not known yet


def test_dz_promote_applies_the_gate_to_a_registered_version(prefect_env, tmp_path, monkeypatch, capsys):
    from dzmodel.cli import main
    from flows.sft_pipeline import sft_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages([]))
    sft_pipeline("demo", root=str(tmp_path), promote=False)
    summary = sft_pipeline("demo", root=str(tmp_path))  # cached stages; registers version 1 (success 0.5)
    assert summary["promotion"]["version"] == "1"
    args = ["promote", "--root", str(tmp_path), "--params", "params.yaml", "--profile", "demo", "--alias", "canary"]
    # the health gate fetches the version's bundle from the registry: the stand-in stages' MANIFEST is no bundle's
    assert main(args + ["--min-success", "0.5", "--version", "1"]) == 1
    out = capsys.readouterr().out
    assert "v1 -> alias canary: refused: " in out and "LIBERO success 50.0% >= gate 50.0%; health: v1: the bundle " \
        "failed its checks (" in out
    monkeypatch.setattr("tasks.registry.registered_health", lambda *a: (True, "health: a stand-in"))
    assert main(args + ["--min-success", "0.75"]) == 1
    assert "refused: LIBERO success 50.0% < gate 75.0%" in capsys.readouterr().out
    assert main(args + ["--min-success", "0.5", "--version", "1"]) == 0
    out = capsys.readouterr().out
    # like the flow, against the model holding the alias it moves (none yet)
    assert "dreamzero-demo v1 -> alias canary: passed" in out
    assert "not compared with the current model (no version holds @canary yet)" in out
    # the demo's own gate is the held-out action error ratio (0.25 here): a tighter bound refuses, exit 1
    assert main(args + ["--max-action-error-ratio", "0.2"]) == 1
    assert "refused: held-out action error ratio 0.25 (vs the mean predictor) > gate 0.20" in capsys.readouterr().out
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "passed: held-out action error ratio 0.25 (vs the mean predictor) <= gate 0.50" in out
    assert "(v1 holds @canary already)" in out


def test_rollback_moves_the_alias_past_the_comparison_with_a_recorded_reason(prefect_env, tmp_path, monkeypatch):
    """v1, then v2 takes @production; `dz promote --version 1` is refused by the comparison with v2 (a worse
    held-out error), `--reason` moves the alias back anyway and records why, who and when; the other gates and the
    health gate still apply; `dz registry list` shows it all; and back to v2 the same way."""
    from mlflow.tracking import MlflowClient

    from dzmodel.cli import main as dz
    from flows.sft_pipeline import sft_pipeline

    said = {"out": "", "err": ""}

    def main(argv):  # `dz ...`, its output kept in `said` (capsys's streams would outlive this test in Prefect's log)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = dz(argv)
        said.update(out=out.getvalue(), err=err.getvalue())
        return code

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages([]))
    gate = "promote.max_action_error_ratio=0.5"
    runs = [sft_pipeline("demo", root=str(tmp_path), overrides=[gate, f"train.lr={lr}"]) for lr in ("2.0e-3", "3.0e-3")]
    assert [r["promotion"]["version"] for r in runs] == ["1", "2"] and runs[1]["promotion"]["promoted"]
    client = MlflowClient(tracking_uri=runs[0]["mlflow_uri"], registry_uri=runs[0]["mlflow_uri"])
    holder = lambda: str(client.get_model_version_by_alias("dreamzero-demo", "production").version)  # noqa: E731
    assert holder() == "2"
    monkeypatch.setattr("tasks.registry.registered_head_to_head", lambda uri, prof, version, *a: {
        "compared": True, "current_version": "2", "candidate": 0.3, "current": 0.2, "windows": 40, "episodes": 2})
    args = ["promote", "--root", str(tmp_path), "--params", "params.yaml", "--profile", "demo", "--set", gate]

    # the override skips the comparison only: the health gate still fetches v1's bundle (a stand-in here) and refuses
    assert main(args + ["--version", "1", "--reason", "rollback: v2 drops grasps"]) == 1
    assert "health: v1: the bundle failed its checks" in said["out"] and holder() == "2"
    monkeypatch.setattr("tasks.registry.registered_health", lambda *a: (True, "health: a stand-in"))
    assert main(args + ["--version", "1"]) == 1  # no override: the comparison refuses
    assert "held-out action error 0.3 vs 0.2 for the current v2, on the same 40 windows: worse by more than 5%" in \
        said["out"]
    assert holder() == "2"
    assert main(args + ["--version", "1", "--reason", "rollback: v2 drops grasps", "--max-action-error-ratio",
                        "0.1"]) == 1  # ... and so do the absolute gates
    assert "refused: held-out action error ratio 0.25" in said["out"] and holder() == "2"

    assert main(args + ["--version", "1", "--reason", "rollback: v2 drops grasps"]) == 0
    out = said["out"]
    assert "dreamzero-demo v1 -> alias production: passed" in out
    assert "not compared with the current model (overridden: rollback: v2 drops grasps)" in out
    assert holder() == "1"
    override = client.get_model_version("dreamzero-demo", "1").tags["promotion_override"]
    assert override.startswith("@production by ") and override.endswith(": rollback: v2 drops grasps")
    # a rerun of v2's parameters (nightly, say) finds v2's policy registered: it does not undo the rollback
    again = sft_pipeline("demo", root=str(tmp_path), overrides=[gate, "train.lr=3.0e-3"])
    assert again["promotion"]["version"] == "2" and not again["promotion"]["promoted"], again["promotion"]
    assert "left alone: v2 passed before, and @production was moved to v1 since" in again["promotion"]["reason"]
    assert holder() == "1"

    listing = ["registry", "list", "--root", str(tmp_path), "--profile", "demo"]
    assert main(listing) == 0
    out = said["out"]
    lines = out.splitlines()
    assert "dreamzero-demo at " in lines[0] and "2 version(s), newest first" in lines[0]
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [r[:2] for r in rows] == [["2", "-"], ["1", "@production"]]
    assert "override: @production by" in out and "rollback: v2 drops grasps" in out
    assert main(listing + ["--json"]) == 0
    listed = json.loads(said["out"])
    assert [(v["version"], v["aliases"], v["run_id"]) for v in listed["versions"]] == \
        [("2", [], runs[1]["mlflow_run_id"]), ("1", ["production"], runs[0]["mlflow_run_id"])]

    assert main(args + ["--version", "2", "--reason", "forward again"]) == 0 and holder() == "2"
    assert main(args + ["--reason", "no version named"]) == 2
    assert "--reason needs --version" in said["err"]
    assert main(args + ["--version", "1", "--reason", "  "]) == 2
    assert "--reason: say why" in said["err"]
    assert holder() == "2"


def test_models_uris_resolve_to_the_promoted_bundle(prefect_env, tmp_path, monkeypatch):
    """`dz serve models:/dreamzero-demo@production` serves what the alias points at: the registry resolves
    through the profile that registers the name (or MLFLOW_TRACKING_URI) into the bundle cache."""
    from dzmodel.cli import main
    from dzmodel.serve.cli import resolve_bundle_source
    from flows.sft_pipeline import sft_pipeline
    from tasks.resolver import RegistryError, resolve_registered_bundle

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DZ_BUNDLE_CACHE", str(tmp_path / "cache"))
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages([]))
    sft_pipeline("demo", root=str(tmp_path))  # version 1, promoted by the demo's action-error gate
    monkeypatch.chdir(tmp_path)
    path, pinned = resolve_bundle_source("models:/dreamzero-demo@production")
    bundle = Path(path)
    manifest = (bundle / "MANIFEST").read_bytes()
    assert bundle.name == "dreamzero-demo-3" and b"  model/model.safetensors\n" in manifest
    assert (bundle / "model" / "model.safetensors").read_text().startswith("trained at lr")
    assert pinned == hashlib.sha256(manifest).hexdigest()  # passed on to the loader
    assert bundle.is_relative_to(next((tmp_path / "cache" / "registry").iterdir()) / "dreamzero-demo" / "1")
    assert resolve_registered_bundle("models:/dreamzero-demo/1") == bundle  # by version, cached
    with pytest.raises(RegistryError, match="not found"):
        resolve_registered_bundle("models:/dreamzero-demo@staging")
    with pytest.raises(RegistryError, match="no profile in params.yaml registers 'other-model'"):
        resolve_registered_bundle("models:/other-model@production")
    with pytest.raises(RegistryError, match="expected models:/<name>@<alias>"):
        resolve_registered_bundle("models:/a/b/c")
    # the served bundle is verified like any other: this stand-in (no model to load) is refused, in one line
    monkeypatch.setenv("DZ_SERVE_TOKEN", "a-long-enough-token")
    assert main(["serve", "models:/dreamzero-demo@production"]) == 2


def test_an_interrupted_run_ends_killed_and_a_dead_ones_run_is_ended(prefect_env, tmp_path, monkeypatch):
    """SIGTERM (raised as SystemExit by `dz pipeline run`) or Ctrl-C mid-stage: the MLflow parent run ends KILLED.
    A run left RUNNING by a process of this host that no longer exists is marked FAILED by the next run."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from flows.sft_pipeline import sft_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    stages = _fake_stages([])

    def killed(prof, paths, log, on_metrics=None):
        raise SystemExit(143)

    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", {**stages, "train": killed})
    with pytest.raises(SystemExit):
        sft_pipeline("demo", root=str(tmp_path))
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("dreamzero-demo")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the classic view, not GenAI
    (parent,) = client.search_runs([exp.experiment_id], "tags.pipeline = 'sft_pipeline'")
    assert parent.info.status == "KILLED" and parent.data.tags["killed_stage"] == "train"

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    orphan = client.create_run(exp.experiment_id, tags={"pipeline": "sft_pipeline", "dz.host": socket.gethostname(),
                                                        "dz.pid": gone.stdout.strip()})
    alive = client.create_run(exp.experiment_id, tags={"pipeline": "sft_pipeline", "dz.host": socket.gethostname(),
                                                       "dz.pid": str(os.getpid())})
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", stages)
    summary = sft_pipeline("demo", root=str(tmp_path))
    assert client.get_run(orphan.info.run_id).info.status == "FAILED"
    assert "is gone" in client.get_run(orphan.info.run_id).data.tags["dz.ended"]
    assert client.get_run(alive.info.run_id).info.status == "RUNNING"  # its process (this one) still runs
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.run_name == summary["run_name"] and summary["run_name"] in run.data.tags["mlflow.note.content"]


def test_dz_pipeline_run_turns_sigterm_into_an_orderly_exit():
    import subprocess
    import sys

    code = ("import os, signal\nfrom flows.commands import _exit_on_sigterm\n_exit_on_sigterm()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGTERM)\nexcept SystemExit as exc:\n    print('exit', exc.code)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "exit 143", out.stderr


def test_dz_deploy_says_what_is_missing(tmp_path, monkeypatch, capsys):
    from flows.commands import cmd_deploy

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    ns = type("Args", (), {"pool": "gpu-pool", "gpu_slots": 1, "prefect_file": "prefect.yaml", "name": "nightly",
                           "cron": None, "param": []})()
    assert cmd_deploy(ns) == 2 and "set PREFECT_API_URL" in capsys.readouterr().err
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setenv("DZ_PROJECT_DIR", str(tmp_path))
    assert cmd_deploy(ns) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} (DZ_PROJECT_DIR) is not the project's checkout" in err and "params.yaml" in err


def test_dz_pipeline_run_sets_the_makefiles_defaults(tmp_path, monkeypatch):
    from flows.commands import project_environment

    monkeypatch.delenv("PREFECT_HOME", raising=False)
    monkeypatch.setenv("DO_NOT_TRACK", "false")  # what the user set stays
    set_here = project_environment(tmp_path)
    assert os.environ["PREFECT_HOME"] == str(tmp_path / ".prefect") == set_here["PREFECT_HOME"]
    assert os.environ["DO_NOT_TRACK"] == "false" and "DO_NOT_TRACK" not in set_here
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    project_environment(tmp_path)
    from prefect.settings import Settings  # settings read from the environment now: the name is Prefect's own

    assert Settings().server.ephemeral.startup_timeout_seconds == 120


def test_the_run_records_its_dataset_and_system_metrics(prefect_env, tmp_path, monkeypatch):
    import time as _time

    from mlflow.tracking import MlflowClient

    from flows.sft_pipeline import sft_pipeline
    from tasks import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "SYSTEM_METRICS_INTERVAL_S", 0.2)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    stages = _fake_stages([])

    def slow_train(prof, paths, log, on_metrics=None):
        _time.sleep(1.5)  # a few samples of CPU and memory while it runs
        return stages["train"](prof, paths, log, on_metrics)

    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", {**stages, "train": slow_train})
    summary = sft_pipeline("demo", root=str(tmp_path))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    (dataset,) = [d.dataset for d in run.inputs.dataset_inputs]
    assert json.loads(dataset.profile)["episodes"] == 20 and len(dataset.digest) == 16
    assert json.loads(dataset.source)["path"].endswith("/dataset")
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "system/system_memory_usage_megabytes")) >= 2


def test_gc_removes_old_runs_and_the_outputs_only_they_used(prefect_env, tmp_path, monkeypatch, capsys):
    from dzmodel.runs import collect_garbage
    from flows.sft_pipeline import sft_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    calls: list[str] = []
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages(calls))
    a, b = (sft_pipeline("demo", root=str(tmp_path), overrides=[f"train.lr={lr}"]) for lr in ("2.0e-3", "3.0e-3"))
    paths = StagePaths(tmp_path, "demo", keyed=True)
    before = sorted(p.name for p in (tmp_path / "runs/demo/store/train").iterdir())
    fresh = collect_garbage(paths, keep=1)  # everything was just written: nothing old enough to go
    assert fresh["views_removed"] == [a["run_name"]] and fresh["outputs_removed"] == []
    assert not (tmp_path / "runs/demo" / a["run_name"]).exists()
    dry = collect_garbage(paths, keep=1, dry_run=True, min_age_s=0)
    assert sorted(p.name for p in (tmp_path / "runs/demo/store/train").iterdir()) == before  # nothing removed
    gone = collect_garbage(paths, keep=1, min_age_s=0)
    assert gone["outputs_removed"] == dry["outputs_removed"] and gone["bytes_freed"] > 0
    assert {f.split("/")[3] for f in gone["outputs_removed"]} == {"train", "convert", "eval", "package"}
    assert len(list((tmp_path / "runs/demo/store/train").iterdir())) == 1  # run b's
    assert all(p.exists() for p in (tmp_path / "runs/demo" / b["run_name"]).iterdir())  # b's links resolve
    calls.clear()
    sft_pipeline("demo", root=str(tmp_path), overrides=["train.lr=2.0e-3"])
    assert calls == ["train", "convert", "eval", "package"]  # a's outputs are gone: its cached results are not used


def test_the_policy_digest_ignores_the_records_of_how_a_bundle_was_made(tmp_path):
    """Two bundles with the same weights and served files are one policy, whatever their training record (another
    run's paths), model card or evaluation; another robot file or another weight is another policy."""
    from tasks.registry import policy_sha256

    def bundle(name: str, **files: str) -> Path:
        root = tmp_path / name
        base = {"model/model.safetensors": "w", "robot.json": "{}", "model/experiment_cfg/train_config.json":
                '{"out_dir": "runs/demo/train"}', "MODEL_CARD.md": "card", "eval/summary.json": "1 episode"}
        for rel, text in {**base, **files}.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        (root / "MANIFEST").write_text("\n".join(_manifest_lines(root)) + "\n")
        return root

    first = policy_sha256(bundle("a"))
    assert policy_sha256(bundle("b", **{"model/experiment_cfg/train_config.json": '{"out_dir": "runs/demo/k1/train"}',
                                        "MODEL_CARD.md": "another card", "eval/summary.json": "3 episodes"})) == first
    assert policy_sha256(bundle("c", **{"robot.json": '{"max_speed": 0.1}'})) != first
    assert policy_sha256(bundle("d", **{"model/model.safetensors": "w2"})) != first
    # the bundle's own MANIFEST rules: a line the policy server would refuse is refused here too, naming the file
    damaged = bundle("e")
    (damaged / "MANIFEST").write_text((damaged / "MANIFEST").read_text().replace("  ", " ", 1))
    with pytest.raises(BundleError, match=r"e/MANIFEST:1: malformed MANIFEST line"):
        policy_sha256(damaged)


def test_a_failed_run_records_the_stage_and_the_error(prefect_env, tmp_path, monkeypatch):
    """A stage that raises: the MLflow parent run ends FAILED with the stage and the error's first line as tags,
    and the stage has a nested run of its own, FAILED, with the whole error as error.txt."""
    from mlflow.tracking import MlflowClient

    from dzmodel.data.errors import DataError
    from flows.sft_pipeline import sft_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")

    def broken(prof, paths, log):
        raise DataError("data/demo/dataset/meta/info.json: field 'fps' is -1\n(a second line of detail)")

    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", {**_fake_stages([]), "metadata": broken})
    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    logging.getLogger("prefect").addHandler(handler)
    try:
        with pytest.raises(DataError):
            sft_pipeline("demo", root=str(tmp_path))
    finally:
        logging.getLogger("prefect").removeHandler(handler)
    assert "fps' is -1" in seen.getvalue()  # the task's log has the error
    assert "Failed to serialize" not in seen.getvalue()  # and no warning about storing it as the task's result
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dreamzero-demo")
    (parent,) = client.search_runs([exp.experiment_id], "tags.pipeline = 'sft_pipeline'")
    assert parent.info.status == "FAILED" and parent.data.tags["failed_stage"] == "metadata"
    assert parent.data.tags["error"] == "DataError: data/demo/dataset/meta/info.json: field 'fps' is -1"
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    status = {c.info.run_name: c.info.status for c in children}
    assert status == {"fetch": "FINISHED", "metadata": "FAILED"}, status
    failed = next(c for c in children if c.info.run_name == "metadata")
    text = client.download_artifacts(failed.info.run_id, "error.txt", str(tmp_path))
    assert Path(text).read_text().endswith("(a second line of detail)\n")


def test_a_stages_progress_reaches_its_prefect_task_log(prefect_env, tmp_path, monkeypatch):
    """A bar inside a stage (the conversion's, the evaluation's, the recording's) writes to the task's own log; in
    a test every update, on a machine every 30 s and at the end. The log starts with the task's cache key."""
    from dzmodel.progress import Progress
    from flows.sft_pipeline import sft_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr("dzmodel.progress.REPORT_EVERY_S", 0.0)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    stages = _fake_stages([])

    def convert(prof, paths, log):
        bar = Progress(2, enabled=False, desc="convert", unit="ckpt")
        out = stages["convert"](prof, paths, log)
        for _ in range(2):
            bar.update()
        return out

    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", {**stages, "convert": convert})
    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    handler.setFormatter(logging.Formatter("%(name)s | %(message)s"))
    logging.getLogger("prefect").addHandler(handler)
    try:
        sft_pipeline("demo", root=str(tmp_path), promote=False)
    finally:
        logging.getLogger("prefect").removeHandler(handler)
    lines = [line for line in seen.getvalue().splitlines() if "| convert: " in line and "cache key" not in line]
    assert [line.split("| ")[1].split(" (")[0] for line in lines] == ["convert: 1/2 ckpts", "convert: 2/2 ckpts"], lines
    assert all(line.startswith("prefect.task_runs") for line in lines)  # the task's logger, not the flow's
    # each task's log names its cache key (Prefect 3 leaves the task page's own field empty)
    keys = [line for line in seen.getvalue().splitlines() if "prefect.task_runs | convert: cache key dz-convert-" in line]
    assert len(keys) == 1, seen.getvalue()[-3000:]
