"""infra/ against real local servers (slow): the Prefect scripts start a server, set up the pool and register a
worker; the compose file's `mlflow server` command stores artifacts in S3 (moto standing in for MinIO, SQLite
for Postgres, which this machine does not run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.flows.servers import background, free_port

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
BIN = Path(sys.executable).parent
QUIET = {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
         "DVC_NO_ANALYTICS": "1"}
pytestmark = pytest.mark.slow


def http(url: str, body: dict | None = None, headers: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def test_prefect_scripts_against_a_server(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    subs = {"DZ_PROJECT_DIR": str(REPO), "PREFECT_API_URL": api, "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(port), "PREFECT_HOME": str(tmp_path / "prefect-home")}
    text = (INFRA / "prefect" / "pool.env.example").read_text()
    for key, value in subs.items():
        text = re.sub(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
    env_file = tmp_path / "pool.env"
    env_file.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DZ_"))}
    env.update(QUIET, DZ_ENV_FILE=str(env_file))

    with background(["bash", str(INFRA / "prefect" / "server.sh")], env, tmp_path / "server.log",
                    health=f"{api}/health", timeout=120):
        for attempt in (1, 2):    # the second run finds everything in place and only updates the deployment
            out = subprocess.run(["bash", str(INFRA / "prefect" / "setup.sh"), "demo"], env=env, capture_output=True,
                                 text=True, timeout=300)
            assert out.returncode == 0, out.stdout + out.stderr
        assert "work pool gpu-pool exists" in out.stdout and "concurrency limit gpu-pool exists" in out.stdout
        pool = http(f"{api}/work_pools/gpu-pool")
        assert pool["type"] == "process"
        limits = http(f"{api}/concurrency_limits/filter", {})
        assert [(c["tag"], c["concurrency_limit"]) for c in limits] == [("gpu-pool", 1)]
        deployment = http(f"{api}/deployments/name/sft-pipeline/nightly")
        assert deployment["work_pool_name"] == "gpu-pool"
        assert deployment["parameters"]["profile"] == "demo"
        assert deployment["entrypoint"] == "flows/sft_pipeline.py:sft_pipeline"
        http(f"{api}/deployments/{deployment['id']}/pause_deployment", {})   # nothing to run while the worker polls

        with background(["bash", str(INFRA / "prefect" / "worker.sh")], env, tmp_path / "worker.log"):
            deadline, workers = time.time() + 120, []
            while time.time() < deadline and not workers:
                time.sleep(2)
                workers = http(f"{api}/work_pools/gpu-pool/workers/filter", {})
        assert [w["name"] for w in workers] == [f"dz-{os.uname().nodename.split('.')[0]}"], \
            (tmp_path / "worker.log").read_text()[-3000:]


def test_compose_mlflow_command_serves_artifacts_from_s3(tmp_path):
    boto3 = pytest.importorskip("boto3")
    if not (BIN / "moto_server").exists():
        pytest.skip("moto_server not installed (moto[server], the dev extra)")
    compose = yaml.safe_load((INFRA / "mlflow" / "docker-compose.yaml").read_text())
    service = compose["services"]["mlflow"]
    cmd = list(service["command"])
    s3_port, port = free_port(), free_port()
    s3_url = f"http://127.0.0.1:{s3_port}"
    # This machine has no Postgres: SQLite stands in; the rest is the compose file's command as written.
    cmd[cmd.index("--backend-store-uri") + 1] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd[cmd.index("--host") + 1] = "127.0.0.1"
    cmd[cmd.index("--port") + 1] = str(port)
    cmd[cmd.index("--allowed-hosts") + 1] = f"mlflow-host:{port},localhost:{port},127.0.0.1:{port}"
    bucket, _, prefix = cmd[cmd.index("--artifacts-destination") + 1].removeprefix("s3://").partition("/")
    creds = {"AWS_ACCESS_KEY_ID": "dreamzero", "AWS_SECRET_ACCESS_KEY": "secret-key", "AWS_DEFAULT_REGION": "us-east-1"}
    env = {**os.environ, **QUIET, **{k: str(v) for k, v in service["environment"].items()}, **creds,
           "MLFLOW_S3_ENDPOINT_URL": s3_url}
    with background([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)], env, tmp_path / "s3.log",
                    health=f"{s3_url}/moto-api/", timeout=120):
        s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1",
                          aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"])
        s3.create_bucket(Bucket=bucket)
        with background([str(BIN / cmd[0]), *cmd[1:]], env, tmp_path / "mlflow.log",
                        health=f"http://127.0.0.1:{port}/health", timeout=120):
            # A client with no S3 credentials: artifacts go through the server.
            client_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
            client_env.update(QUIET, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}")
            script = ("import mlflow, pathlib, sys\n"
                      "p = pathlib.Path(sys.argv[1]); p.write_text('checkpoint summary')\n"
                      "with mlflow.start_run() as run:\n"
                      "    mlflow.log_metric('loss', 0.5); mlflow.log_artifact(str(p))\n"
                      "print(run.info.run_id)\n")
            out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "summary.txt")], env=client_env,
                                 capture_output=True, text=True, timeout=180)
            assert out.returncode == 0, out.stderr[-3000:]
            run_id = out.stdout.strip().splitlines()[-1]
            keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
            assert any(k.startswith(f"{prefix}/") and k.endswith(f"{run_id}/artifacts/summary.txt") for k in keys), keys
            with pytest.raises(urllib.error.HTTPError) as refused:    # a Host header not in --allowed-hosts
                http(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1",
                     headers={"Host": "attacker.example"})
            assert refused.value.code in (400, 403)
