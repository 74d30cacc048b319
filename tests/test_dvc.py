"""DVC end to end on a fresh copy of the project: `dvc repro` reproduces the demo, a changed parameter reruns only
the stages that depend on it, and the data goes to and comes back from the local remote and an S3 remote
(a local moto S3 server)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flows.servers import QUIET, background, free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _env(**extra) -> dict:
    return dict(os.environ, **QUIET, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra)


def _run(cmd: list[str], cwd: Path, **env) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def _ran(log: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", log)


def _set_param(project: Path, old: str, new: str) -> None:
    text = (project / "params.yaml").read_text()
    assert text.count(old) >= 1, old
    (project / "params.yaml").write_text(text.replace(old, new, 1))


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The project as a fresh clone has it (tracked files), then `dvc repro`."""
    dest = tmp_path_factory.mktemp("clone") / "project"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "clone"]):
        _run(cmd, dest)
    log = _run(["dvc", "repro"], dest)
    return dest, log


def test_repro_on_a_fresh_clone_reproduces_the_demo(project):
    dest, log = project
    assert _ran(log) == ["fetch", "metadata", "vision", "cache", "train", "convert", "eval", "package"]
    assert list((dest / "runs" / "demo" / "package").glob("*.tar.gz"))
    assert (dest / "runs" / "demo" / "eval" / "results.csv").is_file()
    assert "Data and pipelines are up to date" in _run(["dvc", "status"], dest)
    metrics = _run(["dvc", "metrics", "show"], dest)
    assert "samples_per_s_per_gpu" in metrics and "best_success_rate" in metrics and "action_error_ratio" in metrics
    assert (dest / "dvc.lock").is_file()


def test_a_changed_parameter_reruns_only_the_stages_that_depend_on_it(project):
    dest, _ = project
    _set_param(dest, "version: 0.1.0-demo", "version: 0.1.1-demo")
    log = _run(["dvc", "repro"], dest)
    assert _ran(log) == ["package"]
    assert all(f"Stage '{s}' didn't change, skipping" in log for s in ("fetch", "metadata", "train", "eval"))
    assert list((dest / "runs" / "demo" / "package").glob("*0.1.1-demo+*.tar.gz"))

    _set_param(dest, "videos: 1", "videos: 0")  # an eval parameter: eval reruns, and package after it
    log = _run(["dvc", "repro"], dest)
    assert _ran(log) == ["eval", "package"]
    assert not list((dest / "runs" / "demo" / "eval" / "videos").glob("*.mp4"))


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
