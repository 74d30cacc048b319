"""Real local servers for the end-to-end tests: started in their own session, torn down with their children."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dzmodel.proctree import alive, descendants, kill_tree

BIN = Path(sys.executable).parent
QUIET = {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
         "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def background(cmd: list[str], env: dict, log: Path, health: str | None = None, timeout: float = 90):
    """Run `cmd` in its own process group; on exit SIGTERM the group (SIGKILL if it lingers), and kill what it
    started in sessions of their own (a Prefect worker's flow runs, their training processes), which the group's
    signals miss and which would otherwise run on into the next tests."""
    f = log.open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if health:
            wait_http(health, timeout, proc, log)
        yield proc
    finally:
        started = descendants(proc.pid)  # now: once `cmd` exits, they are no longer below it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # children too (uvicorn/gunicorn workers)
        proc.wait()
        for pid in started:
            if alive(pid):
                kill_tree(pid)
        f.close()


def prefect_server(home: Path, port: int, log: Path):
    env = dict(os.environ, **QUIET, PREFECT_HOME=str(home))
    env.pop("PREFECT_API_URL", None)
    return background([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                      env, log, health=f"http://127.0.0.1:{port}/api/health")


def mlflow_server(root: Path, port: int, log: Path):
    env = dict(os.environ, **QUIET, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    root.mkdir(parents=True, exist_ok=True)
    return background([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                       "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                       "--artifacts-destination", (root / "artifacts").as_uri(), "--serve-artifacts"],
                      env, log, health=f"http://127.0.0.1:{port}/health")
