"""`dz serve BUNDLE`: the policy server, WebSocket + msgpack-numpy (openpi / RoboArena protocol, reference §6.2).

- The handshake needs `Authorization: Bearer <token>`; anything else gets HTTP 401 and no connection.
- `GET /healthz` (no token) returns status, open sessions, requests served and latency percentiles.
- On connect the server sends the policy metadata; then every message is one observation and gets one reply,
  `{"action": float32 (N, D), "server_timing": {"infer_ms": ...}}`, or an error frame `{"error": "..."}`:
  a malformed message never crashes the server or drops the connection.
- A session (KV cache) is per `session_id`, default one per connection; it is released when the connection closes.
- Inference runs in a worker thread behind one lock, so the event loop keeps answering health checks.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .protocol import Observation, ProtocolError, pack, unpack, validate_observation


class Policy(Protocol):
    metadata: dict

    def infer(self, obs: Observation, session_id: str) -> np.ndarray: ...

    def end_session(self, session_id: str) -> None: ...


class BundlePolicy:
    """An EmbodiedPolicy behind the RoboArena keys: exterior camera 1 and the wrist camera become the
    embodiment's first and second views; the state is joint position (7) + gripper position (1)."""

    def __init__(self, embodied):
        self.embodied = embodied
        views = list(embodied.embodiment.views)
        if len(views) != 2:
            raise ValueError(f"embodiment {embodied.embodiment.tag!r} has views {views}; the server maps exactly "
                             "two (exterior camera 1, wrist camera)")
        self.views = views
        self.metadata = {"embodiment": embodied.embodiment.tag, "action_horizon": embodied.action_horizon,
                         "action_dim": embodied.action_dim, "views": views, "step": embodied.step}

    def infer(self, obs: Observation, session_id: str) -> np.ndarray:
        views = {self.views[0]: obs.images["observation/exterior_image_1_left"],
                 self.views[1]: obs.images["observation/wrist_image_left"]}
        state = np.concatenate([obs.joint_position, obs.gripper_position])
        return self.embodied.predict(session_id, views, state, obs.prompt)

    def end_session(self, session_id: str) -> None:
        self.embodied.end_session(session_id)


@dataclass
class ServerStats:
    requests: int = 0
    errors: int = 0
    sessions: int = 0
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=10000))

    def percentiles(self) -> dict:
        if not self.latencies_ms:
            return {}
        arr = np.asarray(self.latencies_ms)
        return {k: round(float(np.percentile(arr, q)), 2) for k, q in (("p50", 50), ("p95", 95), ("p99", 99))} | \
            {"max": round(float(arr.max()), 2)}


class PolicyServer:
    def __init__(self, policy: Policy, token: str, max_sessions: int = 64):
        if not token:
            raise ValueError("a bearer token is required (--token or DZ_SERVE_TOKEN)")
        self.policy, self.token, self.max_sessions = policy, token, max_sessions
        self.stats = ServerStats()
        self._lock = threading.Lock()

    # -- HTTP side: health and auth --
    def _process_request(self, connection, request):
        if request.path == "/healthz":
            body = {"status": "ok", "sessions": self.stats.sessions, "requests": self.stats.requests,
                    "errors": self.stats.errors, "latency_ms": self.stats.percentiles()}
            return connection.respond(200, json.dumps(body) + "\n")
        if request.headers.get("Authorization", "") != f"Bearer {self.token}":
            return connection.respond(401, "missing or wrong bearer token\n")
        return None

    def _infer(self, obs: Observation, session_id: str) -> tuple[np.ndarray, float]:
        with self._lock:  # one model, one request at a time
            t0 = time.perf_counter()
            actions = self.policy.infer(obs, session_id)
            return np.asarray(actions, dtype=np.float32), (time.perf_counter() - t0) * 1e3

    async def _handler(self, ws):
        if self.stats.sessions >= self.max_sessions:
            await ws.send(pack({"error": f"server full: {self.max_sessions} sessions"}))
            await ws.close(1013, "server full")
            return
        self.stats.sessions += 1
        default_sid, seen = uuid.uuid4().hex, set()
        try:
            await ws.send(pack(self.policy.metadata))
            async for message in ws:
                try:
                    if isinstance(message, str):
                        raise ProtocolError("send binary msgpack frames, not text")
                    obs = validate_observation(unpack(message))
                    sid = obs.session_id or default_sid
                    seen.add(sid)
                    actions, ms = await asyncio.to_thread(self._infer, obs, sid)
                    self.stats.requests += 1
                    self.stats.latencies_ms.append(ms)
                    await ws.send(pack({"action": actions, "server_timing": {"infer_ms": round(ms, 2)}}))
                except Exception as exc:  # an error frame, never a dropped connection
                    self.stats.errors += 1
                    kind = "bad request" if isinstance(exc, ProtocolError) else f"inference failed ({type(exc).__name__})"
                    await ws.send(pack({"error": f"{kind}: {exc}"}))
        except Exception:
            pass  # the client went away mid-send
        finally:
            self.stats.sessions -= 1
            for sid in seen:
                await asyncio.to_thread(self._end, sid)

    def _end(self, sid: str) -> None:
        with self._lock:
            self.policy.end_session(sid)

    async def serve(self, host: str, port: int, ready: threading.Event | None = None, stop: asyncio.Event | None = None,
                    bound: list | None = None):
        from websockets.asyncio.server import serve

        async with serve(self._handler, host, port, process_request=self._process_request, max_size=2**26,
                         ping_interval=None) as server:
            if bound is not None:
                bound.append(server.sockets[0].getsockname()[1])
            if ready is not None:
                ready.set()
            await (stop.wait() if stop is not None else asyncio.Future())


class ServerThread:
    """The server on a background thread (tests, notebooks): `with ServerThread(policy, token) as s: s.url`."""

    def __init__(self, policy: Policy, token: str, host: str = "127.0.0.1", port: int = 0, max_sessions: int = 64):
        self.server = PolicyServer(policy, token, max_sessions)
        self.host, self._port, self._bound = host, port, []
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        self._loop.run_until_complete(self.server.serve(self.host, self._port, self._ready, self._stop, self._bound))

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self._bound[0]}"

    def __enter__(self):
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("policy server did not start within 30 s")
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def serve_bundle(bundle: str, token: str, host: str = "0.0.0.0", port: int = 8000, device: str = "cpu",
                 max_sessions: int = 64, solver=None) -> None:
    from ..eval.policy import load_policy
    from .package import load_package

    pkg = load_package(bundle)
    policy = BundlePolicy(load_policy(pkg.model_dir, device=device, solver=solver))
    print(f"serving {pkg.root.name} ({policy.metadata}) on ws://{host}:{port}  health: http://{host}:{port}/healthz",
          flush=True)
    asyncio.run(PolicyServer(policy, token, max_sessions).serve(host, port))
