"""End to end against real local servers: a Prefect server + work pool + worker runs the scheduled deployment
of the demo pipeline, and an MLflow server's REST API compares two demo pipeline runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.flows.servers import BIN, QUIET, background, free_port, mlflow_server, prefect_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# the demo's 1000 steps take 4-10 minutes on 2 cores; these tests are about the servers, and make demo trains fully
# (two checkpoints: the eval stage's LIBERO episodes are most of a short run)
SHORT_TRAIN = ["train.steps=30", "train.save_every=15"]


def _json(url: str, body: dict | None = None) -> dict | list:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("servers")
    pport, mport = free_port(), free_port()
    with prefect_server(base / "prefect_home", pport, base / "prefect.log"), \
            mlflow_server(base / "mlflow", mport, base / "mlflow.log"):
        project = base / "project"
        project.mkdir()
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")
        env = dict(os.environ, **QUIET, PREFECT_HOME=str(base / "prefect_home"),
                   PREFECT_API_URL=f"http://127.0.0.1:{pport}/api", MLFLOW_TRACKING_URI=f"http://127.0.0.1:{mport}",
                   DZ_PROJECT_DIR=str(ROOT), PREFECT_CLI_PROMPT="false")
        yield {"env": env, "project": project, "prefect": f"http://127.0.0.1:{pport}/api",
               "mlflow": f"http://127.0.0.1:{mport}", "base": base}


def test_scheduled_deployment_run_is_created_and_completes(servers):
    env, api, project = servers["env"], servers["prefect"], servers["project"]
    out = subprocess.run([str(BIN / "dz"), "deploy", "--cron", "* * * * *", "--param", "profile=demo",
                          "--param", f"root={project}", "--param", f"overrides={json.dumps(SHORT_TRAIN)}"],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "created work pool gpu-pool" in out.stdout and "gpu-pool = 1" in out.stdout
    deployment = _json(f"{api}/deployments/name/sft-pipeline/nightly")
    crons = {s["schedule"].get("cron") for s in deployment["schedules"]}
    assert {"0 2 * * *", "* * * * *"} <= crons  # prefect.yaml's nightly schedule, plus the test's every-minute one
    assert deployment["parameters"] == {"profile": "demo", "root": str(project), "overrides": SHORT_TRAIN}
    limits = _json(f"{api}/concurrency_limits/filter", {})
    assert any(c["tag"] == "gpu-pool" and c["concurrency_limit"] == 1 for c in limits)

    worker_log = servers["base"] / "worker.log"
    assert deployment["job_variables"]["env"]["DZ_PROJECT_DIR"] == str(ROOT)  # `dz deploy` records the checkout
    worker_env = {k: v for k, v in env.items() if k != "DZ_PROJECT_DIR"}  # the worker's machine need not set it
    worker_env["PREFECT_WORKER_QUERY_SECONDS"] = "2"  # picks the run up within 2 s of its start time, not 10
    with background([str(BIN / "prefect"), "worker", "start", "--pool", "gpu-pool"], worker_env, worker_log):
        deadline, done = time.time() + 540, None
        while time.time() < deadline and done is None:
            try:
                runs = _json(f"{api}/flow_runs/filter", {"deployments": {"id": {"any_": [deployment["id"]]}},
                                                        "sort": "EXPECTED_START_TIME_ASC"})
            except (TimeoutError, urllib.error.URLError):  # the server's SQLite is busy (locked): ask again
                time.sleep(3)
                continue
            bad = [r for r in runs if r["state_type"] in ("FAILED", "CRASHED")]
            assert not bad, (bad[0]["state"], worker_log.read_text()[-4000:])
            done = next((r for r in runs if r["state_type"] == "COMPLETED"), None)
            time.sleep(3)
        _json(f"{api}/deployments/{deployment['id']}/pause_deployment", {})  # no more runs while tearing down
    assert done is not None, worker_log.read_text()[-4000:]
    assert done["auto_scheduled"] is True  # created by the server's scheduler from the cron schedule
    assert done["parameters"]["profile"] == "demo" and done["parameters"]["overrides"] == SHORT_TRAIN
    tasks = _json(f"{api}/task_runs/filter", {"flow_runs": {"id": {"any_": [done["id"]]}}})
    # a stage's task run is named "<stage> <its cache key>"; the registry step's, "register-and-promote-<slug>"
    names = {t["name"].split()[0] if " " in t["name"] else t["name"].rsplit("-", 1)[0] for t in tasks
             if t["state_type"] == "COMPLETED"}
    assert {"fetch", "metadata", "cache", "train", "convert", "eval", "package", "register-and-promote"} <= names
    # the completed run's own view (named after the flow run): by now the next minute's run may have started and
    # pointed `latest` at its own view, which has no package yet
    assert list((project / "runs" / "demo" / done["name"] / "package").glob("*.tar.gz"))


def test_mlflow_server_compares_two_demo_runs(servers):
    env, project, mlf = servers["env"], servers["project"], servers["mlflow"]
    short = [arg for item in SHORT_TRAIN for arg in ("--set", item)]
    for extra in (short, [*short, "--set", "train.lr=1.0e-3"]):
        out = subprocess.run([str(BIN / "dz"), "pipeline", "run", "--profile", "demo", "--root", str(project), *extra],
                             env=env, capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        assert "package" in out.stdout and "MLflow" in out.stdout
    exp = _json(f"{mlf}/api/2.0/mlflow/experiments/get-by-name?experiment_name=dreamzero-demo")["experiment"]
    runs = _json(f"{mlf}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]],
                                                       "filter": "tags.pipeline = 'sft_pipeline'",
                                                       "order_by": ["attributes.start_time DESC"]})["runs"]
    assert len(runs) >= 2
    latest = []
    for run in runs[:2]:
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        if tags.get("dz.cached") == "true":  # the same params as the scheduled run before: every stage cached
            # one small run, nothing copied: it points at the one that ran (MLflow's own system/ samples of
            # this run's host may appear when it lasts longer than their sampling interval)
            copied = [m["key"] for m in run["data"].get("metrics", []) if not m["key"].startswith("system/")]
            assert not copied, copied
            run = _json(f"{mlf}/api/2.0/mlflow/runs/get?run_id={tags['dz.original_run_id']}")["run"]
            assert {t["key"]: t["value"] for t in run["data"]["tags"]}["dz.cached"] == "false"
        metrics = {m["key"]: m["value"] for m in run["data"].get("metrics", [])}
        assert "mfu" not in metrics  # a CPU run has no MFU (no made-up peak)
        for key in ("loss", "action_loss", "dynamics_loss", "samples_per_s_per_gpu", "peak_mem_gib",
                    "train.final_loss", "eval.success_rate", "eval.best_success_rate", "action_error.trained",
                    "action_error.ratio", "action_error.mean_predictor", "action_error.untrained"):
            assert key in metrics, (key, sorted(metrics))
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        q = urllib.parse.urlencode({"run_id": run["info"]["run_id"], "metric_key": "loss"})
        history = _json(f"{mlf}/api/2.0/mlflow/metrics/get-history?{q}")["metrics"]
        assert sorted({h["step"] for h in history}) == list(range(1, 31))  # every training step
        q = urllib.parse.urlencode({"run_id": run["info"]["run_id"], "metric_key": "eval.success_rate"})
        assert sorted(h["step"] for h in _json(f"{mlf}/api/2.0/mlflow/metrics/get-history?{q}")["metrics"]) == [15, 30]
        latest.append((params["train.lr"], metrics["train.final_loss"]))
    assert latest[0][0] == "0.001" and latest[1][0] == "0.003"
    assert latest[0][1] != latest[1][1]  # the changed learning rate shows in the comparison
    children = _json(f"{mlf}/api/2.0/mlflow/runs/search", {
        "experiment_ids": [exp["experiment_id"]], "filter": f"tags.mlflow.parentRunId = '{runs[0]['info']['run_id']}'"})
    stages = {r["info"]["run_name"] for r in children["runs"]}
    assert stages == {"fetch", "metadata", "vision", "cache", "train", "convert", "eval", "package"}
    cached = {r["info"]["run_name"] for r in children["runs"]
              if {t["key"]: t["value"] for t in r["data"]["tags"]}.get("cached") == "true"}
    assert {"fetch", "metadata", "cache"} <= cached and "train" not in cached  # only what lr affects reran
    # a 30-step run does not pass the demo's gate (held-out action error ratio <= 0.5): refused, no alias
    versions = _json(f"{mlf}/api/2.0/mlflow/model-versions/search?" + urllib.parse.urlencode(
        {"filter": "name='dreamzero-demo'"}))["model_versions"]
    tags = {t["key"]: t["value"] for t in max(versions, key=lambda v: int(v["version"]))["tags"]}
    assert tags["promotion"] == "refused" and "held-out action error ratio" in tags["promotion_reason"]


def test_registry_list_rollback_and_forward_again(servers):
    """The registry as a lab operates it, against the MLflow server and the real bundles the demo runs above
    registered: `dz registry list`, `dz promote --version N` (the gate, then the health check on the bundle the
    registry serves), a rollback with `--reason` past the comparison, and forward again the same way."""
    env, project, mlf = servers["env"], servers["project"], servers["mlflow"]

    def dz(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "dz"), *args, "--root", str(project), "--profile", "demo"], env=env,
                              capture_output=True, text=True, cwd=ROOT)

    def holder() -> str:
        q = urllib.parse.urlencode({"name": "dreamzero-demo", "alias": "production"})
        return _json(f"{mlf}/api/2.0/mlflow/registered-models/alias?{q}")["model_version"]["version"]

    out = dz("registry", "list", "--json")
    assert out.returncode == 0, out.stderr
    versions = [v["version"] for v in json.loads(out.stdout)["versions"]]
    assert len(versions) >= 2 and versions == sorted(versions, key=int, reverse=True)
    new, old = versions[0], versions[1]
    loose = ["--max-action-error-ratio", "100"]  # 30-step models do not pass the demo's own gate (0.5)
    out = dz("promote", "--version", new, *loose)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"health: v{new}: " in out.stdout and "weight file(s) finite, every file as its MANIFEST lists" in out.stdout
    assert holder() == new
    out = dz("promote", "--version", old, "--reason", "rollback", *loose)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"dreamzero-demo v{old} -> alias production: passed" in out.stdout
    assert "not compared with the current model (overridden: rollback)" in out.stdout
    assert holder() == old
    out = dz("registry", "list")
    assert out.returncode == 0, out.stderr
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == [old])
    assert row[1] == "@production" and "override: @production by" in out.stdout
    out = dz("promote", "--version", new, "--reason", "forward again", *loose)
    assert out.returncode == 0 and holder() == new, out.stdout + out.stderr
