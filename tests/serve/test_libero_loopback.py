"""End to end: a LIBERO Franka Panda driven through the packaged policy server over loopback.
The bundle comes from a tiny-preset checkpoint; the server runs in its own process; the client sends the
RoboArena keys and steps the env with the returned chunks."""

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

from dzmodel.data.dataset import embodiment_metadata
from dzmodel.data.embodiments import get_embodiment, load_embodiments
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.eval.libero_env import EnvWorkerPool, list_tasks
from dzmodel.serve.client import PolicyClient
from dzmodel.serve.package import RobotConfig, build_package
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.train.trainer import train

# Franka-like: 8-dim state (LIBERO's eef pose + gripper) and 8-dim actions (7 + gripper), as the protocol returns.
FRANKA_TINY = """
franka_sim_tiny:
  views: {image: observation.images.image, wrist_image: observation.images.wrist_image}
  view_size: [64, 64]
  layout: [[image, wrist_image]]
  state: {state: {column: observation.state, dim: 8}}
  action: {arm: {column: action, slice: [0, 7]}, gripper: {column: action, slice: [6, 7]}}
  action_horizon: 16
"""
TOKEN = "loopback-token"
ROBOT = {"robot_ip": "127.0.0.1", "camera_serials": ["sim-agentview", "sim-wrist"],
         "target_ee_pose": [0.0, 0.0, 1.0, 3.14, 0.0, 0.0], "workspace_min": [-1, -1, 0], "workspace_max": [1, 1, 2]}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("loopback")
    ds = make_synthetic_dataset(root / "ds", num_episodes=2, episode_length=40)
    (root / "emb.yaml").write_text(FRANKA_TINY)
    embodiment_metadata(ds, get_embodiment("franka_sim_tiny", load_embodiments([root / "emb.yaml"])), root / "meta.json")
    train(TrainConfig(preset="tiny", model_overrides={"num_action_per_block": 16}, datasets=[str(ds)],
                      embodiment="franka_sim_tiny", embodiment_files=[str(root / "emb.yaml")],
                      metadata=str(root / "meta.json"), steps=1, save_every=1, out_dir=str(root / "run"), progress=False))
    hf = convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf")
    _, tarball = build_package(hf, root / "dist", RobotConfig.from_dict(ROBOT), "0.1.0")
    return tarball


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_libero_panda_through_the_packaged_server(bundle, tmp_path):
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "dzmodel.cli", "serve", str(bundle), "--token", TOKEN, "--host",
                               "127.0.0.1", "--port", str(port), "--solver-steps", "2", "--cfg-scale", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline, health = time.time() + 180, None
        while time.time() < deadline and server.poll() is None:
            try:
                health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read())
                break
            except OSError:
                time.sleep(0.5)
        assert health is not None and health["status"] == "ok", server.stdout.read().decode()[-3000:] if server.poll() is not None else "no health"
        task = list_tasks("spatial")[0]
        with EnvWorkerPool(1, keep_raw=True) as pool, PolicyClient(f"ws://127.0.0.1:{port}", TOKEN) as client:
            assert client.metadata["embodiment"] == "franka_sim_tiny" and client.metadata["action_dim"] == 8
            obs = pool.reset([(0, task, 0)])[0]
            for chunk in range(3):
                raw = obs["raw"]
                msg = {"observation/exterior_image_1_left": obs["image"], "observation/wrist_image_left": obs["wrist_image"],
                       "observation/joint_position": np.asarray(raw["robot0_joint_pos"], dtype=np.float64),
                       "observation/cartesian_position": obs["state"][:6],
                       "observation/gripper_position": obs["state"][6:7], "prompt": task.language,
                       "session_id": "panda-0"}
                reply = client.infer(msg)
                actions = reply["action"]
                assert actions.shape == (16, 8) and actions.dtype == np.float32 and np.isfinite(actions).all()
                assert reply["server_timing"]["infer_ms"] > 0
                for a in actions[:4]:  # a few env steps per chunk; the sim's OSC action is 7-dim
                    obs, success = pool.step({0: np.clip(a[:7], -1, 1)})[0]
                    assert obs["image"].shape == (128, 128, 3) and isinstance(success, bool)
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read())
        assert health["requests"] == 3 and health["errors"] == 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
