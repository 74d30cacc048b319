"""DVC end to end on a fresh copy of the project: `dvc repro` reproduces the demo and logs it
to MLflow as a flow run would, a changed parameter (in params.yaml or through `dvc exp run --set-param`) reruns only the stages that
depend on it, and the data goes to and comes back from the local remote and an S3 remote (a local moto S3
server). Before the remotes, an experiment against the committed reproduction: `dvc exp run -S
profiles.demo.train.lr=2e-3` reruns train and the stages after it, changes one line of params.yaml, and
`dvc exp show`, `dvc metrics diff`, `dvc plots diff` and `make exp-show` compare it with the commit."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
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


# --- an experiment against the committed reproduction -----------------------------------------------------------

EXP = "lr-2e-3"


def _stdout(cmd: list[str] | str, cwd: Path) -> str:
    """A command's standard output alone (DVC writes its warnings to stderr)."""
    out = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, shell=isinstance(cmd, str))
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def lr_experiment(project):
    """The reproduction committed as the baseline (`git add -A`: dvc.lock and metrics/, what git does not ignore),
    then `dvc exp run -S profiles.demo.train.lr=2e-3` in the workspace: (clone, baseline commit, the experiment's
    log). The workspace keeps the experiment, as `dvc exp run` leaves it (consistent with its dvc.lock, which the
    remote tests need; the remote tests' `dvc pull` drops the baseline's outputs from the cache, and with them any
    way back). It runs before them: after `dvc pull` rewrites outputs, `dz track` refuses the stage records whose
    mtimes no longer match."""
    dest, _ = project
    _run(["git", "add", "-A"], dest)
    _run(["git", "commit", "-qm", "the demo, reproduced"], dest)
    baseline = _stdout(["git", "rev-parse", "HEAD"], dest).strip()
    log = _run(["dvc", "exp", "run", "-n", EXP, "-S", "profiles.demo.train.lr=2e-3"], dest)
    return dest, baseline, log


def test_exp_run_of_a_learning_rate_reruns_train_and_after_and_sets_one_line(lr_experiment):
    dest, _, log = lr_experiment
    assert _ran(log) == ["train", "convert", "eval", "package", "track"]
    assert all(f"Stage '{s}' didn't change, skipping" in log for s in ("fetch", "metadata", "vision", "cache"))
    diff = _stdout(["git", "diff", "-U0", "params.yaml"], dest)
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["-      lr: 3.0e-3", "+      lr: 0.002"]


def test_exp_show_and_metrics_diff_give_the_baseline_and_the_experiment_numbers(lr_experiment):
    dest, baseline, _ = lr_experiment
    rows = json.loads(_stdout(["dvc", "exp", "show", "--json"], dest))
    base = next(r for r in rows if r["rev"] == baseline)
    exp = next(e for e in base["experiments"] or [] if e["name"] == EXP)["revs"][0]
    for row in (base, exp):
        metrics = row["data"]["metrics"]
        assert not any("error" in m for m in metrics.values()), metrics  # DVC's `!`
        assert isinstance(metrics["metrics/demo/train.json"]["data"]["loss"], float)
        assert isinstance(metrics["metrics/demo/eval.json"]["data"]["action_error_ratio"], float)
    lrs = [r["data"]["params"]["params.yaml"]["data"]["profiles"]["demo"]["train"]["lr"] for r in (base, exp)]
    assert lrs == [0.003, 0.002]

    diff = json.loads(_stdout(["dvc", "metrics", "diff", baseline, EXP, "--json"], dest))
    loss = diff["metrics/demo/train.json"]["loss"]
    ratio = diff["metrics/demo/eval.json"]["action_error_ratio"]
    for change in (loss, ratio):
        assert isinstance(change["old"], float) and isinstance(change["new"], float)
        assert change["diff"] == pytest.approx(change["new"] - change["old"])
    assert loss["old"] != loss["new"]  # another learning rate, another loss
    # the workspace (the experiment's results) against the commit, the lab's first command
    assert json.loads(_stdout(["dvc", "metrics", "diff", "HEAD", "--json"], dest))["metrics/demo/train.json"]["loss"]


def test_plots_diff_draws_the_baseline_and_the_experiment(lr_experiment):
    dest, baseline, _ = lr_experiment
    out = json.loads(_stdout(["dvc", "plots", "diff", baseline, EXP, "--json"], dest))
    assert not out.get("errors"), out.get("errors")
    losses = out["data"]["training losses"][0]
    assert losses["revisions"] == [baseline, EXP]
    points = Counter(v["rev"] for v in losses["content"]["data"]["values"])  # the CSVs, from git
    assert set(points) == {baseline, EXP} and min(points.values()) > 10, points
    images = out["data"]["metrics/demo/plots/losses.png"]  # from DVC's cache
    assert [i["revisions"] for i in images] == [[baseline], [EXP]] and all(Path(i["url"]).is_file() for i in images)


def test_make_exp_show_is_a_table_a_person_reads(lr_experiment):
    """`make exp-show`: the experiment, the headline params and metrics and what differs, under 40 columns, where
    DVC's default table has several hundred."""
    dest, _, _ = lr_experiment
    venv = Path(sys.executable).parent.parent
    cmd = _stdout(["make", "-s", "-n", "-o", "setup", "exp-show", f"VENV={venv}", "EXP_ARGS=--csv"], dest).strip()
    assert cmd.startswith(f"{venv}/bin/dvc exp show") and "\n" not in cmd
    table = list(csv.DictReader(io.StringIO(_stdout(cmd, dest))))
    default = next(csv.reader(io.StringIO(_stdout(["dvc", "exp", "show", "--csv"], dest))))
    columns = list(table[0])
    assert len(columns) <= 40 < 400 < len(default), (len(columns), columns)
    assert not [c for c in columns if "/" in c and ":" not in c]  # no dep hashes (a metric's own file: FILE:NAME)
    assert not [c for c in columns if c.startswith("profiles.") and not c.startswith("profiles.demo.")]
    assert {"profiles.demo.train.lr", "loss", "action_error_ratio", "samples_per_s_per_gpu"} <= set(columns)
    base = next(r for r in table if r["typ"] == "baseline" and r["rev"] != "workspace")
    exp = next(r for r in table if r["Experiment"] == EXP)
    assert (base["profiles.demo.train.lr"], exp["profiles.demo.train.lr"]) == ("0.003", "0.002")
    assert all(float(r["loss"]) > 0 and float(r["action_error_ratio"]) > 0 for r in (base, exp))


# --- the flow and DVC share one store of outputs --------------------------------------------------------------


def _flow(dest: Path) -> tuple[dict, str]:
    """`make demo`'s command in the clone (a temporary Prefect server of its own): (its summary, its log)."""
    env = _env(PREFECT_HOME=str(dest / ".prefect"))
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    summary = dest / "runs" / "demo" / "pipeline_summary.json"
    out = subprocess.run(["dz", "pipeline", "run", "--profile", "demo", "--summary-json", str(summary)], cwd=dest,
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(summary.read_text()), out.stdout + out.stderr


def _train_files(dest: Path) -> dict[str, int]:
    root = dest / "runs" / "demo" / "train"
    return {str(f.relative_to(root)): f.stat().st_mtime_ns for f in root.rglob("*") if f.is_file()}


@pytest.fixture(scope="module")
def flow_then_dvc(tmp_path_factory):
    """On a fresh clone: the flow as `make demo` runs it, then `dvc status` and `dvc repro` (`make repro`), then
    `dvc exp run -S profiles.demo.train.lr=2e-3`, then the flow again on what the experiment left (params.yaml
    with its lr)."""
    from tests.demo_clone import clone

    dest = clone(tmp_path_factory.mktemp("flow-clone") / "project")
    first, first_log = _flow(dest)
    status = json.loads(_stdout(["dvc", "status", "--json"], dest))
    client = _mlflow(dest)
    production = str(client.get_model_version_by_alias("dreamzero-demo", "production").version)
    repro = _run(["dvc", "repro"], dest)
    after_repro = ([str(v.version) for v in client.search_model_versions("name='dreamzero-demo'")],
                   str(client.get_model_version_by_alias("dreamzero-demo", "production").version))
    exp = _run(["dvc", "exp", "run", "-S", "profiles.demo.train.lr=2e-3"], dest)
    before = _train_files(dest)
    second, second_log = _flow(dest)
    return {"dest": dest, "first": first, "first_log": first_log, "status": status, "production": production,
            "repro": repro, "after_repro": after_repro, "exp": exp,
            "second": second, "second_log": second_log, "train_before": before, "train_after": _train_files(dest)}


def test_after_the_flow_dvc_finds_its_stages_unchanged(flow_then_dvc):
    r = flow_then_dvc
    assert not r["first"]["cached_stages"]  # the flow ran every stage
    assert r["first"]["shared_with_dvc"] == ["fetch", "metadata", "vision", "cache", "train", "convert", "eval",
                                             "package"]
    assert set(r["status"]) <= {"track"}, r["status"]  # only DVC's own MLflow stage has not run
    assert (r["dest"] / "runs" / "demo" / "package").is_dir() and not (r["dest"] / "runs" / "demo" / "store").exists()


def test_make_repro_after_make_demo_runs_only_its_mlflow_stage_and_registers_nothing(flow_then_dvc):
    r = flow_then_dvc
    assert _ran(r["repro"]) == ["track"]
    assert r["production"] == "1" and r["after_repro"] == (["1"], "1")  # no version added, no alias moved


def test_after_the_flow_exp_run_of_a_learning_rate_reruns_only_train_and_after(flow_then_dvc):
    log = flow_then_dvc["exp"]
    assert _ran(log) == ["train", "convert", "eval", "package", "track"]
    assert all(f"Stage '{s}' didn't change, skipping" in log for s in ("fetch", "metadata", "vision", "cache"))


def test_the_flow_reuses_what_dvc_ran_and_registers_no_second_version_of_it(flow_then_dvc):
    r = flow_then_dvc
    assert r["train_after"] == r["train_before"]  # nothing retrained, nothing rewritten
    for stage in ("train", "convert", "eval", "package"):  # DVC's experiment made them, with these inputs
        assert f"{stage}: dvc.lock describes these inputs and outputs; reused" in r["second_log"], stage
    assert r["second"]["cached_stages"] == ["fetch", "metadata", "vision", "cache"]  # the flow's own, from before
    assert r["second"]["reused_from_dvc"] == ["train", "convert", "eval", "package"]
    assert "from DVC    train, convert, eval, package" in r["second_log"]
    versions = _mlflow(r["dest"]).search_model_versions("name='dreamzero-demo'")
    assert sorted(int(v.version) for v in versions) == [1, 2]  # the flow's lr, the experiment's; none for the reuse
    assert r["second"]["promotion"]["version"] == "2"


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
