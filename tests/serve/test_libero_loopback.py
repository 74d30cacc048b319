"""End to end: `dz client` drives the LIBERO Franka Panda through `dz serve` of a packaged policy over loopback,
at a control rate, with the chunk broker inferring the next chunk while the current one executes. The server
runs in its own process and reads its token from DZ_SERVE_TOKEN, as docs/deploy.md tells a lab to."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from dzmodel.serve.client import ChunkBroker

from .helpers import tiny_bundle

TOKEN = "loopback-token"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("loopback"), "libero_sim_tiny")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_libero_panda_through_the_packaged_server(bundle, tmp_path):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DZ_SERVE_TOKEN": TOKEN}
    server = subprocess.Popen([sys.executable, "-m", "dzmodel.cli", "serve", str(bundle), "--port", str(port),
                               "--solver-steps", "1", "--cfg-scale", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                              text=True)
    try:
        deadline, health = time.time() + 180, None
        while time.time() < deadline and server.poll() is None:
            try:
                health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read())
                break
            except OSError:
                time.sleep(0.5)
        assert health is not None and health["status"] == "ok", "server did not come up"
        out = subprocess.run([sys.executable, "-m", "dzmodel.cli", "client", f"ws://127.0.0.1:{port}", "--suite",
                              "spatial", "--task", "0", "--episodes", "1", "--max-steps", "24", "--control-hz", "20",
                              "--camera-size", "128", "--out", str(tmp_path / "client")],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        summary = json.loads((tmp_path / "client" / "summary.json").read_text())
        ep = summary["per_episode"][0]
        assert summary["episodes"] == 1 and ep["steps"] == 24 and ep["chunks"] >= 2
        assert ep["latency_p50_ms"] > 0 and ep["achieved_hz"] > 0
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read())
        assert health["requests"] == ep["chunks"] and health["errors"] == 0 and health["sessions"] == 0
        # the client's token came from the environment too; without it the server refuses
        env.pop("DZ_SERVE_TOKEN")
        refused = subprocess.run([sys.executable, "-m", "dzmodel.cli", "client", f"ws://127.0.0.1:{port}",
                                  "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
        assert refused.returncode == 2 and "HTTP 401" in refused.stderr
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        log = server.communicate(timeout=30)[0]
    assert log.count(" infer session=libero-spatial-0-0-") == ep["chunks"] and "Traceback" not in log


def test_the_broker_infers_the_next_chunk_while_one_executes():
    """A fake server that takes 3 control periods per chunk: the broker asks early enough that the robot never
    waits after the first chunk, and it skips the actions whose time passed while the reply was on its way."""
    period = 0.02
    requested = []

    def infer(obs):
        requested.append(obs["step"])
        time.sleep(3 * period)
        return np.arange(obs["step"], obs["step"] + 8, dtype=np.float64)[:, None]  # action k is "step k"

    broker = ChunkBroker(infer, control_hz=1 / period, lead=2)
    executed = []
    try:
        for step in range(40):
            action = broker.next_action(step, lambda: {"step": step})
            executed.append(int(action[0]))
            time.sleep(period)
    finally:
        broker.close()
    assert executed == list(range(40))  # every step got the action predicted for it
    assert len(requested) >= 5 and requested[0] == 0
    assert sum(broker.waits_s[1:]) < 0.5 * sum(broker.latencies_s[1:])  # the later chunks were mostly ready
    assert broker.lead >= 3


def test_the_sync_broker_waits_and_executes_whole_chunks():
    requested = []

    def infer(obs):
        requested.append(obs["step"])
        return np.arange(obs["step"], obs["step"] + 8, dtype=np.float64)[:, None]

    broker = ChunkBroker(infer, control_hz=1000, overlap=False)
    try:
        executed = [int(broker.next_action(step, lambda: {"step": step})[0]) for step in range(24)]
    finally:
        broker.close()
    assert executed == list(range(24)) and requested == [0, 8, 16] and broker.skipped == 0
