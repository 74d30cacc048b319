"""DVC end to end on a fresh copy of the project: `dvc repro` reproduces the demo and logs it
to MLflow as a flow run would, a changed parameter (in params.yaml or through `dvc exp run --set-param`) reruns only the stages that
depend on it, and the data goes to and comes back from the local remote and an S3 remote (a local moto S3
server)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.demo_clone import env as _env
from tests.demo_clone import run as _run
from tests.flows.servers import BIN, background, free_port

pytestmark = pytest.mark.slow


def _ran(log: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", log)


def _set_param(project: Path, old: str, new: str) -> None:
    text = (project / "params.yaml").read_text()
    assert text.count(old) >= 1, old
    (project / "params.yaml").write_text(text.replace(old, new, 1))


@pytest.fixture(scope="module")
def project(demo_repro):
    """The project as a fresh clone has it (tracked files), then `dvc repro` (the session's, tests/conftest.py)."""
    return demo_repro


def _mlflow(dest: Path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{dest / 'mlruns' / 'mlflow.db'}"
    return MlflowClient(uri, registry_uri=uri)  # not a registry another test set process-wide


def _tracked(dest: Path) -> dict:
    return json.loads((dest / "runs" / "demo" / "tracking.json").read_text())


def test_repro_on_a_fresh_clone_reproduces_the_demo(project):
    dest, log = project
    assert _ran(log) == ["fetch", "metadata", "vision", "cache", "train", "convert", "eval", "package", "track"]
    assert list((dest / "runs" / "demo" / "package").glob("*.tar.gz"))
    assert (dest / "runs" / "demo" / "eval" / "results.csv").is_file()
    assert "Data and pipelines are up to date" in _run(["dvc", "status"], dest)
    metrics = _run(["dvc", "metrics", "show"], dest)
    assert "samples_per_s_per_gpu" in metrics and "best_success_rate" in metrics and "action_error_ratio" in metrics
    assert (dest / "dvc.lock").is_file()


def test_repro_logs_to_mlflow_as_a_flow_run_does(project):
    dest, _ = project
    tracked = _tracked(dest)
    assert re.fullmatch(r"demo-[0-9a-f]{8}-dvc-1", tracked["run_name"]), tracked["run_name"]
    client = _mlflow(dest)
    run = client.get_run(tracked["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == tracked["run_name"]
    assert run.data.tags["dz.source"] == "dvc" and run.data.params["train.lr"]  # the params as columns
    assert "train.samples_per_s_per_gpu" in run.data.metrics and "loss" in run.data.metrics  # also per step
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert {c.info.run_name for c in children} >= {"fetch", "train", "eval", "package"}
    assert run.inputs.dataset_inputs  # the dataset, as a flow run logs it
    versions = client.search_model_versions("name='dreamzero-demo'")
    assert [str(v.version) for v in versions] == [tracked["promotion"]["version"]] == ["1"]
    version = client.get_model_version("dreamzero-demo", "1")
    assert version.tags["run_name"] == tracked["run_name"] and version.tags["params_digest"] in tracked["run_name"]


def test_a_changed_parameter_reruns_only_the_stages_that_depend_on_it(project):
    dest, _ = project
    _set_param(dest, "version: 0.1.0-demo", "version: 0.1.1-demo")
    log = _run(["dvc", "repro"], dest)
    assert _ran(log) == ["package", "track"]
    assert all(f"Stage '{s}' didn't change, skipping" in log for s in ("fetch", "metadata", "train", "eval"))
    assert list((dest / "runs" / "demo" / "package").glob("*0.1.1-demo+*.tar.gz"))
    tracked = _tracked(dest)
    assert tracked["run_name"].endswith("-dvc-1")  # another params digest: its first run
    # another package version around the same policy (only the model card names it): no new registry version
    assert tracked["promotion"]["registered"].startswith("unchanged") and tracked["promotion"]["version"] == "1"
    assert _ran(_run(["dvc", "repro"], dest)) == []  # nothing changed: no stage, no MLflow run, no version

    _set_param(dest, "videos: 1", "videos: 0")  # an eval parameter: eval reruns, and package after it
    log = _run(["dvc", "repro"], dest)
    assert _ran(log) == ["eval", "package", "track"]
    assert not list((dest / "runs" / "demo" / "eval" / "videos").glob("*.mp4"))


def test_exp_run_set_param_overrides_reach_the_stages_and_mlflow(project):
    dest, _ = project
    log = _run(["dvc", "exp", "run", "--set-param", "profiles.demo.package.version=0.2.0-demo"], dest)
    assert _ran(log) == ["package", "track"]
    assert list((dest / "runs" / "demo" / "package").glob("*0.2.0-demo+*.tar.gz"))
    run = _mlflow(dest).get_run(_tracked(dest)["mlflow_run_id"])
    assert run.data.params["package.version"] == "0.2.0-demo"
    assert "0.2.0-demo" in _run(["dvc", "exp", "show", "--no-pager", "--csv"], dest)


def test_local_remote_push_and_pull(project):
    dest, _ = project
    _run(["dvc", "push"], dest)
    assert any((dest / "dvc-remote").rglob("*"))  # the default remote: ./dvc-remote (see .dvc/config)
    shutil.rmtree(dest / ".dvc" / "cache")
    shutil.rmtree(dest / "data" / "demo" / "dataset")
    _run(["dvc", "pull"], dest)
    assert (dest / "data" / "demo" / "dataset" / "meta" / "info.json").is_file()
    assert "Data and pipelines are up to date" in _run(["dvc", "status"], dest)


def test_s3_remote_on_a_local_s3_server(project, tmp_path):
    boto3 = pytest.importorskip("boto3")
    dest, _ = project
    port = free_port()
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    url = f"http://127.0.0.1:{port}"
    with background([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], _env(**creds),
                    tmp_path / "moto.log", health=f"{url}/moto-api/"):
        s3 = boto3.client("s3", endpoint_url=url, **{k.lower(): v for k, v in creds.items()
                                                     if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
        s3.create_bucket(Bucket="dz-dvc")
        _run(["dvc", "remote", "add", "pool", "s3://dz-dvc/store"], dest)
        _run(["dvc", "remote", "modify", "pool", "endpointurl", url], dest)
        _run(["dvc", "push", "-r", "pool"], dest, **creds)
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="dz-dvc").get("Contents", [])]
        assert keys and all(k.startswith("store/") for k in keys)
        shutil.rmtree(dest / ".dvc" / "cache")
        shutil.rmtree(dest / "runs" / "demo" / "converted")
        _run(["dvc", "pull", "-r", "pool"], dest, **creds)
        assert list((dest / "runs" / "demo" / "converted").glob("step_*/model.safetensors"))
        assert "Data and pipelines are up to date" in _run(["dvc", "status"], dest)


def _charts_drawn(page: Path, tmp_path: Path) -> int:
    """Vega charts that headless Chromium draws on `page` with the network off (a proxy nobody listens on)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("chromium is not installed (make test-slow installs Debian's chromium)")
    out = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'chromium'}", "--proxy-server=http://127.0.0.1:9",
                          "--proxy-bypass-list=<-loopback>", "--virtual-time-budget=20000", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return len(re.findall(r'class="marks"', out.stdout))


def test_plots_show_renders_offline(project, tmp_path):
    dest, _ = project
    _run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], dest)
    page = tmp_path / "plots" / "index.html"
    assert "cdn.jsdelivr" not in page.read_text()
    vega_plots = 4  # dvc.yaml's top-level plots: losses, throughput, success rate, action error
    assert _charts_drawn(page, tmp_path) == vega_plots
    # the check can fail: DVC's own page (Vega from a CDN) draws nothing offline
    from dvc_render.html import PAGE_HTML

    cdn = tmp_path / "cdn_template.html"
    cdn.write_text(PAGE_HTML)
    _run(["dvc", "plots", "show", "--html-template", str(cdn), "-o", str(tmp_path / "cdn")], dest)
    assert "cdn.jsdelivr" in (tmp_path / "cdn" / "index.html").read_text()
    assert _charts_drawn(tmp_path / "cdn" / "index.html", tmp_path) == 0
