"""The clients labs use, unchanged, against `dz serve` of real (tiny) bundles:

- openpi's `openpi-client` 0.1.2 from PyPI (WebsocketClientPolicy with an API key) with its LIBERO example's
  observation, against a libero_sim_tiny bundle;
- a client that follows RoboArena's client and test script (tests/serve/roboarena_client.py) against an
  oxe_droid_tiny bundle served with --no-auth, as RoboArena's evaluator needs;
- DreamZero's own pattern: one frame, then 4-frame clips in the same session, which extend the KV cache.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import websockets
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dzmodel.serve.server import ServerThread

from .helpers import served_policy
from .roboarena_client import PolicyServerConfig, RoboArenaClient, dummy_observation, run_test_script

TOKEN = "openpi-api-key-123"



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openpi_libero_observation(rng):
    """What openpi's examples/libero/main.py sends: 224x224 uint8 views rotated 180 degrees, eef pos + axis-angle +
    gripper qpos, the task's instruction."""
    agent = rng.integers(0, 255, (256, 256, 3), dtype=np.uint8)[::-1, ::-1][16:240, 16:240]
    wrist = rng.integers(0, 255, (256, 256, 3), dtype=np.uint8)[::-1, ::-1][16:240, 16:240]
    state = np.concatenate([[-0.2, 0.0, 1.17], [3.1, 0.0, 0.1], [0.039, -0.039]]).astype(np.float64)
    return {"observation/image": np.ascontiguousarray(agent), "observation/wrist_image": np.ascontiguousarray(wrist),
            "observation/state": state, "prompt": "pick up the black bowl and place it on the plate"}


def test_openpi_client_from_pypi_reads_actions(libero_bundle):
    with ServerThread(served_policy(libero_bundle), TOKEN) as srv:
        client = WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN)
        meta = client.get_server_metadata()
        assert meta["embodiment"] == "libero_sim_tiny" and meta["protocol"]["images"]["observation/image"] == "image"
        rng = np.random.default_rng(0)
        result = client.infer(openpi_libero_observation(rng))
        actions = result["actions"]
        assert actions.shape == (16, 7) and np.isfinite(actions).all()
        assert len(actions) >= 5  # the LIBERO example executes the first replan_steps = 5
        assert result["server_timing"]["infer_ms"] > 0
        second = client.infer(openpi_libero_observation(rng))
        assert "prev_total_ms" in second["server_timing"]
        with pytest.raises(RuntimeError, match="Error in inference server:\nbad request: missing 'observation/state'"):
            obs = openpi_libero_observation(rng)
            del obs["observation/state"]
            client.infer(obs)
        with pytest.raises(websockets.exceptions.InvalidStatus, match="401"):
            WebsocketClientPolicy("127.0.0.1", srv.port, api_key="not-the-key")


def test_roboarena_test_script_against_a_droid_bundle(droid_bundle):
    with ServerThread(served_policy(droid_bundle), None) as srv:  # RoboArena sends no auth header
        open_after_reset = []
        report = run_test_script("127.0.0.1", srv.port,
                                 before_close=lambda: open_after_reset.append(srv.server.stats.sessions))
        assert report["config"] == PolicyServerConfig(image_resolution=[180, 320], needs_wrist_camera=True,
                                                      n_external_cameras=2, needs_stereo_camera=False,
                                                      needs_session_id=True, action_space="joint_position")
        assert report["actions"].shape == (24, 8)  # 7 joint positions + gripper
        assert report["reset_reply"] == "reset successful"
        assert open_after_reset == [0] and srv.server.stats.errors == 0  # the reset ended the script's session
    with ServerThread(served_policy(droid_bundle), TOKEN) as srv:  # with auth on, RoboArena's client is refused
        with pytest.raises(Exception):
            RoboArenaClient("127.0.0.1", srv.port)


def test_dreamzero_clips_extend_the_session(droid_bundle):
    """Upstream DreamZero's client: a first frame, then 4-frame clips (T, H, W, 3) in one session. Every 8 new
    frames complete a causal block (2 latent frames) that extends the KV cache, so the third call continues the
    context: it differs from a fresh session on the same clip, and equals the same history sent as one clip (the
    whole history prefilled at once, as the teacher-forcing forward sees it: tests/model/test_inference.py shows
    the cached blocks equal that forward)."""
    policy = served_policy(droid_bundle)
    rng = np.random.default_rng(3)
    config = PolicyServerConfig(**policy.handshake)
    first = dummy_observation(config)
    image_keys = [k for k in first if "image" in k]
    for k in image_keys:
        first[k] = rng.integers(0, 255, first[k].shape, dtype=np.uint8)
    clips = [{**first, **{k: rng.integers(0, 255, (4, *first[k].shape), dtype=np.uint8) for k in image_keys}}
             for _ in range(2)]
    with ServerThread(policy, None) as srv:
        client = RoboArenaClient("127.0.0.1", srv.port)
        client.infer(dict(first, session_id="episode-1"))
        client.infer(dict(clips[0], session_id="episode-1"))
        continued = client.infer(dict(clips[1], session_id="episode-1"))["actions"]
        assert policy.embodied.policy.sessions["episode-1"].caches[0].num_frames == 3  # frame 0 + one block
        fresh = client.infer(dict(clips[1], session_id="episode-2"))["actions"]
        assert policy.embodied.policy.sessions["episode-2"].caches[0].num_frames == 1
        whole = {**first, **{k: np.concatenate([clips[0][k], clips[1][k]]) for k in image_keys}}
        client.infer(dict(first, session_id="episode-3"))
        at_once = client.infer(dict(whole, session_id="episode-3"))["actions"]
        client.close()
    assert not np.allclose(continued, fresh, atol=1e-3)
    np.testing.assert_allclose(at_once, continued, rtol=1e-4, atol=1e-4)


def test_dz_serve_cli_no_auth_warns_and_serves(droid_bundle, tmp_path):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DZ_SERVE_TOKEN", None)
    out = subprocess.run([sys.executable, "-m", "dzmodel.cli", "serve", str(droid_bundle), "--port", str(port)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "needs a token" in out.stderr and "--no-auth" in out.stderr
    server = subprocess.Popen([sys.executable, "-m", "dzmodel.cli", "serve", str(droid_bundle), "--no-auth", "--port",
                               str(port), "--solver-steps", "1", "--cfg-scale", "1", "--precision", "fp8",
                               "--max-batch", "4"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                report = run_test_script("127.0.0.1", port)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the server did not come up")
        assert report["actions"].shape == (24, 8)
        clash = subprocess.run([sys.executable, "-m", "dzmodel.cli", "serve", str(droid_bundle), "--no-auth", "--port",
                                str(port)], capture_output=True, text=True, env=env, timeout=180)
        assert clash.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in clash.stderr
        assert "Traceback" not in clash.stderr and len(clash.stderr.strip().splitlines()) == 1
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        log = server.communicate(timeout=30)[0]
    assert "WARNING: --no-auth" in log and "on ws://127.0.0.1:" in log
    assert "precision fp8 falls back to fp32: FP8 matmuls need an NVIDIA GPU" in log  # no GPU: the fp32 weights
    assert "batching: up to 4 sessions a forward, 5 ms window" in log
    assert " infer session=38DSA3hd3 ok " in log and " reset session=all ok " in log
    assert "Traceback" not in log
