"""docs/protocol.md, followed by a client written from that page alone: msgpack, numpy and websockets, and nothing
of this project's serving code on the client side. The server is a real `dz serve` of a tiny LIBERO bundle."""

import json
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from .helpers import tiny_bundle

TOKEN = "conformance-token-1"


# --- the client, from docs/protocol.md ------------------------------------------------------------------------

def nd(a) -> dict:
    """Section 4: an array as a map with binary keys, raw C-order bytes and numpy's dtype string."""
    a = np.ascontiguousarray(a)
    return {b"__ndarray__": True, b"data": a.tobytes(), b"dtype": a.dtype.str, b"shape": list(a.shape)}


def un(m):
    if b"__ndarray__" in m:
        return np.frombuffer(m[b"data"], dtype=np.dtype(m[b"dtype"])).reshape(m[b"shape"])
    return m


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(frame: bytes):
    return msgpack.unpackb(frame, object_hook=un, raw=False)


def open_ws(url: str, token: str | None = TOKEN):
    headers = {"Authorization": f"Api-Key {token}"} if token else {}
    return connect(url, additional_headers=headers, compression=None)


def get(url: str, token: str | None = None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read())


def observation(protocol: dict, rng, frames: int = 1, session: str | None = None) -> dict:
    """Section 5: every key of protocol.images as uint8 (T, H, W, 3), every key of protocol.state with its dims."""
    shape = (224, 224, 3) if frames == 1 else (frames, 224, 224, 3)
    request = {key: nd(rng.integers(0, 256, shape, dtype=np.uint8)) for key in protocol["images"]}
    request |= {key: nd(np.zeros(n, np.float64)) for key, n in protocol["state_dims"].items()}
    request["prompt"] = "put the bowl on the plate"
    if session:
        request["session_id"] = session
    return request


# --- against a served bundle ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dzmodel.policy.policy import load_policy
    from dzmodel.model.sampler import SolverConfig
    from dzmodel.serve.package import load_package
    from dzmodel.serve.server import BundlePolicy, ServerThread

    pkg = load_package(tiny_bundle(tmp_path_factory.mktemp("bundle"), "libero_sim_tiny"))
    policy = BundlePolicy(load_policy(pkg.model_dir, solver=SolverConfig(num_steps=2, cfg_scale=1.0)))
    with ServerThread(policy, TOKEN) as srv:
        yield srv


def test_http_health_and_metadata_and_the_token(server):
    base = f"http://127.0.0.1:{server.port}"
    status, health = get(f"{base}/healthz")  # section 2: no token needed
    assert status == 200 and health["status"] == "ok"
    with pytest.raises(urllib.error.HTTPError) as refused:
        get(f"{base}/metadata")
    assert refused.value.code == 401
    status, meta = get(f"{base}/metadata", TOKEN)
    assert status == 200 and set(meta["protocol"]) == {"images", "state", "state_dims", "ignored"}
    with pytest.raises(InvalidStatus) as no_token:
        open_ws(server.url, token=None)
    assert no_token.value.response.status_code == 401


def test_handshake_infer_session_and_reset(server):
    rng = np.random.default_rng(0)
    with open_ws(server.url) as ws:
        handshake = unpack(ws.recv())  # section 3: before any request
        protocol = handshake["protocol"]
        horizon, dim = handshake["action_horizon"], handshake["action_dim"]
        ws.send(pack(observation(protocol, rng, session="episode-1")))
        first = unpack(ws.recv())
        assert first["actions"].dtype == np.float32 and first["actions"].shape == (horizon, dim)
        assert np.isfinite(first["actions"]).all() and first["server_timing"]["infer_ms"] > 0
        assert "prev_total_ms" not in first["server_timing"]
        ws.send(pack(observation(protocol, rng, frames=4, session="episode-1")))  # section 7: the frames since
        second = unpack(ws.recv())
        assert second["actions"].shape == (horizon, dim) and "prev_total_ms" in second["server_timing"]
        ws.send(pack({"endpoint": "reset", "session_id": "episode-1"}))  # section 6
        assert ws.recv() == "reset successful"


def test_a_bad_request_gets_its_reason_then_close_1008(server):
    rng = np.random.default_rng(1)
    with open_ws(server.url) as ws:
        protocol = unpack(ws.recv())["protocol"]
        request = observation(protocol, rng)
        missing = next(iter(protocol["state_dims"]))
        del request[missing]
        ws.send(pack(request))
        reason = ws.recv()
        assert isinstance(reason, str) and reason.startswith(f"bad request: missing {missing!r}")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv()
        assert closed.value.rcvd.code == 1008
    with open_ws(server.url) as ws:  # section 4: an array's keys are binary; as strings it is no array
        protocol = unpack(ws.recv())["protocol"]
        request = observation(protocol, rng)
        image = next(iter(protocol["images"]))
        request[image] = {k.decode(): v for k, v in request[image].items()}
        ws.send(pack(request))
        assert ws.recv().startswith(f"bad request: {image} must be uint8")
    with open_ws(server.url) as ws:
        ws.recv()
        ws.send("not msgpack")  # a text frame
        assert ws.recv().startswith("bad request: ")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv()
        assert closed.value.rcvd.code == 1008
