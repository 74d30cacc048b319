"""The policy server over real loopback sockets: wire format, request validation, auth, error frames and close
codes, reset, session bounds, health/metadata, probes, port conflicts, TLS, load."""

import json
import logging
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from dzmodel.data.embodiments import ServeSpec, load_embodiments
from dzmodel.serve import server as server_mod
from dzmodel.serve.client import DryRunRobot, PolicyClient, ServerError, load_test, run_client, synthetic_observation
from dzmodel.serve.protocol import ProtocolError, RequestLimits, pack, parse_request, unpack
from dzmodel.serve.server import PolicyServer, ServeError, ServerLimits, ServerThread, TokenAuth, run_server

TOKEN = "s3cret-token"
LIBERO = load_embodiments()["libero_sim"].wire
DROID = load_embodiments()["oxe_droid"].wire
LIBERO_DIMS, DROID_DIMS = {"state": 8}, {"joint_position": 7, "gripper_position": 1}


class FakePolicy:
    """The server's Policy protocol with openpi's LIBERO keys: actions echo the state."""

    spec: ServeSpec = LIBERO
    state_dims = LIBERO_DIMS

    def __init__(self, delay=0.0, fail=False):
        self.delay, self.fail, self.ended, self.calls = delay, fail, [], []
        self.metadata = {"embodiment": "fake", "action_horizon": 12, "action_dim": 8,
                         "protocol": {"images": dict(self.spec.images), "state": dict(self.spec.state),
                                      "state_dims": {"observation/state": 8}, "ignored": []}}
        self.handshake = self.metadata

    def check_request(self, request):
        if np.abs(request.state["state"]).max() > 100:
            raise ProtocolError("observation/state is far outside the trained range")

    def infer(self, request, session_id):
        if self.fail:
            raise RuntimeError("CUDA out of memory")
        self.calls.append((session_id, request.images["image"].shape[0]))
        time.sleep(self.delay)
        return np.tile(request.state["state"], (12, 1))

    def end_session(self, session_id):
        self.ended.append(session_id)


def libero_obs(rng=None, frames=1, **extra):
    rng = rng or np.random.default_rng(0)
    shape = (224, 224, 3) if frames == 1 else (frames, 224, 224, 3)
    return {"observation/image": rng.integers(0, 255, shape, dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 255, shape, dtype=np.uint8),
            "observation/state": np.arange(8, dtype=np.float64) / 10, "prompt": "pick up the bowl", **extra}


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


def test_requests_in_both_protocols_parse():
    req = parse_request(libero_obs(), LIBERO, LIBERO_DIMS)
    assert req.endpoint == "infer" and req.session_id is None and req.images["image"].shape == (1, 224, 224, 3)
    req = parse_request(libero_obs(frames=4, session_id="ep-1"), LIBERO, LIBERO_DIMS)
    assert req.images["wrist_image"].shape == (4, 224, 224, 3) and req.session_id == "ep-1"
    droid = synthetic_observation(load_embodiments()["oxe_droid"].serve.roboarena, np.random.default_rng(0))
    assert "observation/cartesian_position" in droid  # accepted and unused
    droid |= {"observation/joint_position": np.zeros((1, 7), np.float32), "session_id": np.zeros(1, np.int32),
              "endpoint": "infer"}
    req = parse_request(droid, DROID, DROID_DIMS)
    assert set(req.images) == {"exterior_1", "exterior_2", "wrist"} and req.state["joint_position"].shape == (7,)
    assert req.session_id == "0"
    del droid["observation/cartesian_position"]  # openpi's DROID example does not send it
    parse_request(droid, DROID, DROID_DIMS)
    reset = parse_request({"endpoint": "reset", "session_id": "ep-1"}, DROID, DROID_DIMS)
    assert reset.endpoint == "reset" and reset.session_id == "ep-1"


@pytest.mark.parametrize("change, field", [
    ({"observation/wrist_image": None}, "missing 'observation/wrist_image'.*this policy reads"),
    ({"observation/image": np.zeros((64, 64, 3), np.float32)}, "observation/image must be uint8"),
    ({"observation/image": np.zeros((4, 64, 3), np.uint8)}, "each side needs at least 8 pixels"),
    ({"observation/image": np.zeros((1500, 1500, 3), np.uint8)}, r"2,250,000 pixels, over .*--max-image-pixels"),
    ({"observation/image": np.zeros((40, 64, 64, 3), np.uint8)}, "40 frames; send 1..33"),
    ({"observation/image": np.zeros((4, 64, 64, 3), np.uint8)}, "same number of frames"),
    ({"observation/state": np.zeros(6)}, r"observation/state must be 8 numbers"),
    ({"observation/state": np.array([0, 0, np.nan, 0, 0, 0, 0, 0])}, r"observation/state\[2\] = nan"),
    ({"observation/state": np.array([0, 0, 0, 1e308, 0, 0, 0, 0])}, r"observation/state\[3\] = 1e\+308"),
    ({"observation/state": "open"}, "observation/state must be 8 numbers"),
    ({"prompt": ""}, "prompt must be"),
    ({"session_id": 7.5}, "session_id"),
    ({"session_id": "x" * 200}, "session_id"),
    ({"endpoint": "train"}, "endpoint must be one of"),
])
def test_bad_requests_name_the_field(change, field):
    obs = libero_obs()
    for k, v in change.items():
        if v is None:
            obs.pop(k)
        else:
            obs[k] = v
    with pytest.raises(ProtocolError, match=field):
        parse_request(obs, LIBERO, LIBERO_DIMS, RequestLimits())
    with pytest.raises(ProtocolError, match="must be a map"):
        parse_request([1, 2], LIBERO, LIBERO_DIMS)


def test_tokens_api_key_or_bearer_in_constant_time(monkeypatch):
    auth = TokenAuth(TOKEN)
    assert auth.accepts(f"Api-Key {TOKEN}") and auth.accepts(f"Bearer {TOKEN}") and auth.accepts(f"bearer {TOKEN}")
    for header in (None, "", TOKEN, f"Basic {TOKEN}", f"Api-Key {TOKEN}x", "Api-Key", f"Bearer {TOKEN[:-1]}"):
        assert not auth.accepts(header), header
    calls = []
    monkeypatch.setattr(server_mod.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or a == b)
    auth.accepts("Bearer nope")
    assert calls == [(b"nope", TOKEN.encode())]
    with pytest.raises(ServeError, match="at least 8"):
        TokenAuth("short")


def test_auth_health_metadata_replies_and_timing():
    policy = FakePolicy()
    with ServerThread(policy, TOKEN) as srv:
        http = srv.url.replace("ws://", "http://")
        health = json.loads(urllib.request.urlopen(f"{http}/healthz", timeout=10).read())
        assert health["status"] == "ok" and health["requests"] == 0
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"{http}/metadata", timeout=10)
        req = urllib.request.Request(f"{http}/metadata", headers={"Authorization": f"Bearer {TOKEN}"})
        assert json.loads(urllib.request.urlopen(req, timeout=10).read())["embodiment"] == "fake"
        with pytest.raises(ServerError, match="HTTP 401.*Api-Key"):
            PolicyClient(srv.url, "wrong-token")
        with pytest.raises(ServerError, match="HTTP 401"):
            PolicyClient(srv.url, None)
        with PolicyClient(srv.url, TOKEN) as c:  # sends Api-Key, as openpi's client does
            assert c.metadata["action_dim"] == 8
            first = c.infer(libero_obs())
            assert first["actions"].shape == (12, 8) and first["actions"].dtype == np.float32
            np.testing.assert_allclose(first["actions"][0], np.arange(8) / 10, rtol=1e-6)
            assert set(first["server_timing"]) == {"infer_ms"}
            second = c.infer(libero_obs(frames=4))
            assert set(second["server_timing"]) == {"infer_ms", "prev_total_ms"}
        bearer = connect(srv.url, additional_headers={"Authorization": f"Bearer {TOKEN}"})
        assert unpack(bearer.recv(timeout=10))["embodiment"] == "fake"
        bearer.close()
    assert [n for _, n in policy.calls] == [1, 4]  # all four frames reach the policy


def _expect_close(ws, code, text):
    message = ws.recv(timeout=10)
    assert isinstance(message, str) and text in message, message  # a text frame: the clients raise it
    with pytest.raises(ConnectionClosed) as info:
        ws.recv(timeout=10)
    assert info.value.rcvd.code == code


def test_errors_are_text_frames_then_a_close_code():
    with ServerThread(FakePolicy(), TOKEN) as srv:
        headers = {"Authorization": f"Api-Key {TOKEN}"}
        for payload, text in ((pack({**libero_obs(), "observation/state": np.zeros(3)}), "observation/state must be 8"),
                              (b"\x00\x01garbage", "not a msgpack"), ("a text frame", "send binary msgpack"),
                              (pack({**libero_obs(), "observation/state": np.full(8, 1e3)}), "trained range")):
            ws = connect(srv.url, additional_headers=headers)
            ws.recv(timeout=10)
            ws.send(payload)
            _expect_close(ws, 1008, text)
        with PolicyClient(srv.url, TOKEN) as c:
            with pytest.raises(ServerError, match="bad request: missing 'observation/image'"):
                c.infer({"prompt": "x"})
        health = json.loads(urllib.request.urlopen(srv.url.replace("ws://", "http://") + "/healthz", timeout=10).read())
        assert health["errors"] == 5 and health["connections"] == 0
    with ServerThread(FakePolicy(fail=True), TOKEN) as srv:
        ws = connect(srv.url, additional_headers={"Authorization": f"Api-Key {TOKEN}"})
        ws.recv(timeout=10)
        ws.send(pack(libero_obs()))
        _expect_close(ws, 1011, "inference failed: RuntimeError: CUDA out of memory")


def test_reset_ends_the_session_and_sessions_are_bounded():
    policy = FakePolicy()
    limits = ServerLimits(max_sessions=3, sessions_per_connection=2)
    with ServerThread(policy, TOKEN, limits=limits) as srv:
        with PolicyClient(srv.url, TOKEN) as c:
            c.infer(libero_obs(session_id="ep-1"))
            c.ws.send(pack({"endpoint": "reset", "session_id": "ep-1"}))
            assert c.ws.recv(timeout=10) == "reset successful"  # RoboArena's server answers the same text
            assert policy.ended == ["ep-1"]
            for sid in ("a", "b", "c"):  # a third session on one connection ends its least recently used
                c.infer(libero_obs(session_id=sid))
            assert policy.ended == ["ep-1", "a"]
            with PolicyClient(srv.url, TOKEN) as other:
                other.infer(libero_obs(session_id="d"))  # 3 open: b, c, d
                with pytest.raises(ServerError, match="server full: 3 sessions"):
                    other.infer(libero_obs(session_id="e"))
        deadline = time.time() + 10
        while len(policy.ended) < 5 and time.time() < deadline:
            time.sleep(0.05)
        assert sorted(policy.ended) == sorted(["ep-1", "a", "b", "c", "d"])  # released on disconnect
        with PolicyClient(srv.url, TOKEN) as c:  # and usable again
            c.infer(libero_obs(session_id="b"))


def test_no_auth_mode_accepts_clients_without_a_header():
    with ServerThread(FakePolicy(), None) as srv, PolicyClient(srv.url, None) as c:
        assert c.infer(libero_obs())["actions"].shape == (12, 8)


def test_probes_and_bad_handshakes_log_one_line(caplog):
    caplog.set_level(logging.INFO, logger="dzmodel.serve")
    with ServerThread(FakePolicy(), TOKEN) as srv:
        with socket.create_connection(("127.0.0.1", srv.port)):
            pass  # a port scan
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # plain HTTP, no upgrade
            s.recv(4096)
        with PolicyClient(srv.url, TOKEN) as c:
            c.infer(libero_obs(session_id="log-me"))
        time.sleep(0.5)
    records = [r for r in caplog.records if r.name.startswith("dzmodel.serve")]
    assert all(r.exc_info is None and "Traceback" not in r.getMessage() for r in records)
    handshakes = [r.getMessage() for r in records if "handshake failed" in r.getMessage()]
    assert len(handshakes) >= 1 and all("\n" not in m for m in handshakes)
    access = [r.getMessage() for r in records if "session=log-me" in r.getMessage()]
    assert len(access) == 1 and " infer " in access[0] and " ok " in access[0] and access[0].endswith("ms")


def test_a_port_in_use_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{port}.*pick --port"):
            run_server(PolicyServer(FakePolicy(), TokenAuth(TOKEN)), "127.0.0.1", port)


def test_tls_serves_wss(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with pytest.raises(ServeError, match="TLS: cannot load"):
        server_mod.tls_context(str(tmp_path / "missing.pem"), None)
    with ServerThread(FakePolicy(), TOKEN, ssl=server_mod.tls_context(str(cert), str(key))) as srv:
        assert srv.url.startswith("wss://")
        client_ctx = ssl.create_default_context(cafile=str(cert))
        ws = connect(srv.url, ssl=client_ctx, additional_headers={"Authorization": f"Api-Key {TOKEN}"})
        assert unpack(ws.recv(timeout=10))["embodiment"] == "fake"
        ws.send(pack(libero_obs()))
        assert unpack(ws.recv(timeout=10))["actions"].shape == (12, 8)
        ws.close()


def test_dry_run_client_prints_chunks(capsys):
    with ServerThread(FakePolicy(), TOKEN) as srv:
        chunks = run_client(srv.url, TOKEN, DryRunRobot(size=(64, 64)), chunks=2)
    assert len(chunks) == 2 and "chunk 1: (12, 8)" in capsys.readouterr().out


def test_fifty_concurrent_sessions_without_errors():
    with ServerThread(FakePolicy(delay=0.002), TOKEN) as srv:
        report = load_test(srv.url, TOKEN, sessions=50, requests_per_session=3, timeout_s=120)
    assert report["errors"] == 0, report["error_samples"]
    assert report["requests"] == 150 and report["wall_s"] < 120


def test_an_oversized_frame_is_refused_with_1009(caplog):
    caplog.set_level(logging.INFO, logger="dzmodel.serve")
    with ServerThread(FakePolicy(), TOKEN, limits=ServerLimits(max_frame_bytes=1 << 20)) as srv:
        ws = connect(srv.url, additional_headers={"Authorization": f"Api-Key {TOKEN}"}, max_size=None)
        ws.recv(timeout=10)
        send_failed = False
        try:  # refused from its header: the server may close before the client has sent the rest
            ws.send(pack(libero_obs(frames=8)))  # 8 x 2 views x 224 x 224 x 3 = 2.4 MB
        except (ConnectionClosed, OSError):
            send_failed = True
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=10)
        # The close frame reaches the client, unless the connection was reset while the client was still writing
        # the rest of the frame (then the client's send fails, and it never reads the close): the server's log
        # says what it sent either way.
        assert info.value.rcvd is not None or send_failed
        assert info.value.rcvd is None or info.value.rcvd.code == 1009  # message too big
        # the server logs the refusal after it sent the close, so the client can read the close first
        deadline = time.monotonic() + 10
        while not (refused := [r.getMessage() for r in caplog.records if "refused: frame too big" in r.getMessage()]) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(refused) == 1 and refused[0].endswith("(1009)"), refused
        with PolicyClient(srv.url, TOKEN) as c:  # the server carries on
            assert c.infer(libero_obs())["actions"].shape == (12, 8)


def test_serving_a_bundle_freezes_the_heap_before_the_first_request(libero_bundle, monkeypatch):
    """After loading (and, on a GPU, the warm-up) the collector's permanent generation holds the policy's objects,
    so no full collection rescans them inside a request."""
    import gc

    from dzmodel.serve import server

    seen = []
    monkeypatch.setattr(server, "run_server", lambda *args, **kwargs: seen.append(gc.get_freeze_count()))
    try:
        server.serve_bundle(str(libero_bundle), TOKEN, port=0)
    finally:
        gc.unfreeze()
    assert seen and seen[0] > 10_000
