"""The policy server over real loopback sockets: wire format, auth, health, error frames, sessions, load."""

import json
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest

from dzmodel.serve.client import DryRunRobot, PolicyClient, ServerError, load_test, run_client
from dzmodel.serve.protocol import ProtocolError, pack, unpack, validate_observation
from dzmodel.serve.server import ServerThread

TOKEN = "s3cret"


class FakePolicy:
    metadata = {"embodiment": "fake", "action_horizon": 12, "action_dim": 8}

    def __init__(self, delay=0.0):
        self.delay, self.ended, self.calls = delay, [], 0

    def infer(self, obs, session_id):
        self.calls += 1
        time.sleep(self.delay)
        return np.tile(np.concatenate([obs.joint_position, obs.gripper_position]), (12, 1))

    def end_session(self, session_id):
        self.ended.append(session_id)


def test_wire_format_matches_openpi_msgpack_numpy():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    expected = msgpack.packb({"a": {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": "<f4", b"shape": [2, 3]}},
                             use_bin_type=True)
    assert pack({"a": arr}) == expected
    out = unpack(expected)["a"]
    assert out.dtype == np.float32 and out.shape == (2, 3) and np.array_equal(out, arr)
    for dt in (np.uint8, np.int64, np.float64, np.bool_):
        x = np.ones((3, 2), dtype=dt)
        assert np.array_equal(unpack(pack(x)), x) and unpack(pack(x)).dtype == dt
    assert unpack(pack(np.float32(1.5))) == np.float32(1.5)
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        pack(np.array([object()]))
    with pytest.raises(ProtocolError, match="not a msgpack"):
        unpack(b"\xc1garbage")


@pytest.mark.parametrize("change, field", [
    ({"observation/wrist_image_left": None}, "observation/wrist_image_left"),
    ({"observation/exterior_image_1_left": np.zeros((64, 64, 3), np.float32)}, "exterior_image_1_left must be uint8"),
    ({"observation/exterior_image_1_left": np.zeros((2000, 64, 3), np.uint8)}, "outside 8..1024"),
    ({"observation/joint_position": np.zeros(6)}, r"joint_position must be 7 numbers"),
    ({"observation/cartesian_position": np.array([0, 0, np.nan, 0, 0, 0])}, "non-finite"),
    ({"observation/gripper_position": "open"}, "gripper_position must be 1 numbers"),
    ({"prompt": ""}, "prompt must be"),
    ({"session_id": 7}, "session_id"),
])
def test_validation_names_the_field(change, field):
    obs = DryRunRobot(size=(64, 64)).get_observation()
    for k, v in change.items():
        if v is None:
            obs.pop(k)
        else:
            obs[k] = v
    with pytest.raises(ProtocolError, match=field):
        validate_observation(obs)


def test_auth_health_error_frames_and_sessions():
    policy = FakePolicy()
    with ServerThread(policy, TOKEN) as srv:
        health_url = srv.url.replace("ws://", "http://") + "/healthz"
        with pytest.raises(ServerError, match="HTTP 401"):
            PolicyClient(srv.url, "wrong")
        with PolicyClient(srv.url, TOKEN) as c:
            assert c.metadata["action_dim"] == 8
            robot = DryRunRobot(size=(64, 64))
            reply = c.infer(robot.get_observation())
            assert reply["action"].shape == (12, 8) and reply["action"].dtype == np.float32
            np.testing.assert_allclose(reply["action"][0, :7], robot.joints)
            bad = robot.get_observation()
            bad["observation/joint_position"] = np.zeros(3)
            with pytest.raises(ServerError, match="joint_position"):
                c.infer(bad)
            c.ws.send(b"\x00\x01garbage")
            assert "error" in unpack(c.ws.recv(timeout=10))
            assert c.infer({**robot.get_observation(), "session_id": "arm-1"})["action"].shape == (12, 8)  # still alive
            health = json.loads(urllib.request.urlopen(health_url, timeout=10).read())
            assert health["status"] == "ok" and health["sessions"] == 1 and health["requests"] == 2
            assert health["errors"] == 2 and set(health["latency_ms"]) == {"p50", "p95", "p99", "max"}
        deadline = time.time() + 10
        while len(policy.ended) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert "arm-1" in policy.ended and len(policy.ended) == 2  # both sessions released on disconnect


def test_dry_run_client_prints_chunks(capsys):
    with ServerThread(FakePolicy(), TOKEN) as srv:
        chunks = run_client(srv.url, TOKEN, DryRunRobot(size=(64, 64)), chunks=2)
    assert len(chunks) == 2 and "chunk 1: (12, 8)" in capsys.readouterr().out


def test_fifty_concurrent_sessions_without_errors():
    with ServerThread(FakePolicy(delay=0.002), TOKEN, max_sessions=64) as srv:
        report = load_test(srv.url, TOKEN, sessions=50, requests_per_session=3, timeout_s=120)
    assert report["errors"] == 0, report["error_samples"]
    assert report["requests"] == 150 and report["wall_s"] < 120
