"""The client side of the policy protocol: a connection (`PolicyClient`), an action-chunk broker that infers the
next chunk while the current one executes (`ChunkBroker`), a synthetic robot for `--dry-run`, and a load test.

`PolicyClient` speaks what openpi's and RoboArena's clients speak: `Authorization: Api-Key <token>` when a token
is given, msgpack-numpy frames, `actions` in the reply, a text frame meaning an error.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

import numpy as np

from .protocol import pack, unpack

ROBOARENA_STATE = {"observation/joint_position": 7, "observation/cartesian_position": 6,
                   "observation/gripper_position": 1}


class ServerError(RuntimeError):
    """The server refused the connection or answered with an error."""


class PolicyClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 120.0):
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        headers = {"Authorization": f"Api-Key {token}"} if token else None
        try:
            self.ws = connect(url, additional_headers=headers, max_size=None, compression=None,
                              open_timeout=timeout, close_timeout=5)
        except InvalidStatus as exc:
            body = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
            raise ServerError(f"{url}: the server refused the connection (HTTP {exc.response.status_code}"
                              f"{': ' + body if body else ''})") from None
        self.url, self.timeout = url, timeout
        self.metadata = self._recv()

    def _recv(self):
        from websockets.exceptions import ConnectionClosed

        try:
            reply = self.ws.recv(timeout=self.timeout)
        except ConnectionClosed as exc:
            raise ServerError(f"{self.url}: connection closed ({exc.rcvd.code if exc.rcvd else 'no close frame'}"
                              f"{': ' + exc.rcvd.reason if exc.rcvd and exc.rcvd.reason else ''})") from None
        if isinstance(reply, str):  # the protocol's error frame
            raise ServerError(f"{self.url}: {reply}")
        return unpack(reply)

    def infer(self, obs: dict) -> dict:
        self.ws.send(pack(obs))
        reply = self._recv()
        if not isinstance(reply, dict) or "actions" not in reply:
            raise ServerError(f"{self.url}: expected a reply with 'actions', got {type(reply).__name__}")
        return reply

    def reset(self, session_id: str | None = None) -> None:
        """End the session on the server (RoboArena's `endpoint: reset`); it answers with a text frame."""
        self.ws.send(pack({"endpoint": "reset", **({"session_id": session_id} if session_id else {})}))
        self.ws.recv(timeout=self.timeout)

    def close(self) -> None:
        self.ws.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ChunkBroker:
    """Executes one action chunk while the next is inferred.

    `next_action(step, observe)` returns the action for control step `step`. When the current chunk has `lead`
    actions left, the observation of that moment goes to the server in the background; the chunk it returns
    was predicted for the step of that observation, so the actions for the steps already executed meanwhile
    are skipped. `lead` follows the measured latency in control steps (at the rate the loop actually runs), so
    the robot waits only when a chunk is shorter than the latency.

    `overlap=False` is the synchronous broker of `dz eval libero`: ask when the chunk is used up, wait, execute
    the whole next chunk (nothing skipped; the robot stands still while the server thinks)."""

    def __init__(self, infer: Callable[[dict], np.ndarray], control_hz: float, actions_per_chunk: int | None = None,
                 lead: int = 2, overlap: bool = True):
        self.infer, self.period, self.per_chunk = infer, 1.0 / control_hz, actions_per_chunk
        self.lead, self.overlap = (lead if overlap else 0), overlap
        self._last_call: tuple[int, float] | None = None
        self._step_s = self.period      # the measured time per control step (the target period or slower)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="chunk-broker")
        self._pending: tuple[int, Future] | None = None
        self._chunk: np.ndarray | None = None
        self._chunk_step = 0          # the control step of the chunk's first action
        self.latencies_s: list[float] = []
        self.waits_s: list[float] = []
        self.skipped = 0

    def _request(self, step: int, obs: dict) -> None:
        def call():
            t0 = time.perf_counter()
            actions = np.asarray(self.infer(obs))
            self.latencies_s.append(time.perf_counter() - t0)
            return actions

        self._pending = (step, self._pool.submit(call))

    def _left(self, step: int) -> int:
        if self._chunk is None:
            return 0
        usable = len(self._chunk) if self.per_chunk is None else min(self.per_chunk, len(self._chunk))
        return usable - (step - self._chunk_step)

    def next_action(self, step: int, observe: Callable[[], dict]) -> np.ndarray:
        now = time.perf_counter()
        if self._last_call is not None and step > self._last_call[0]:
            per_step = (now - self._last_call[1]) / (step - self._last_call[0])
            self._step_s = max(self.period, 0.8 * self._step_s + 0.2 * per_step)
        self._last_call = (step, now)
        if self._pending is None and self._left(step) <= self.lead:
            self._request(step, observe())
        if self._left(step) <= 0:
            obs_step, future = self._pending
            t0 = time.perf_counter()
            chunk = future.result()
            self.waits_s.append(time.perf_counter() - t0)
            self._pending = None
            self.skipped += step - obs_step
            self._chunk, self._chunk_step = chunk, obs_step
            if self._left(step) <= 0:  # the reply came too late to use any of it: ask again from here
                self._request(step, observe())
                return self.next_action(step, observe)
            if self.overlap and self.latencies_s:  # ask early enough for the reply to come before the chunk ends
                self.lead = max(1, int(np.ceil(np.median(self.latencies_s[-5:]) / self._step_s)) + 1)
        return self._chunk[step - self._chunk_step]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Robot(Protocol):
    def get_observation(self) -> dict: ...

    def apply_actions(self, actions: np.ndarray) -> None: ...


def synthetic_observation(metadata: dict, rng: np.random.Generator, size=(180, 320), prompt: str = "pick up the cube"):
    """An observation with the keys a server's handshake asks for: RoboArena's PolicyServerConfig fields, or our
    own metadata's `protocol` (image keys and state widths)."""
    h, w = size
    img = lambda: rng.integers(0, 255, (h, w, 3), dtype=np.uint8)  # noqa: E731
    if "action_space" in metadata:  # RoboArena's handshake
        obs = {f"observation/exterior_image_{i}_left": img() for i in range(metadata.get("n_external_cameras", 1))}
        if metadata.get("needs_wrist_camera", True):
            obs["observation/wrist_image_left"] = img()
        obs |= {k: np.zeros(n, dtype=np.float32) for k, n in ROBOARENA_STATE.items()}
    elif "protocol" in metadata:
        proto = metadata["protocol"]
        obs = {k: img() for k in proto["images"]} | {k: np.zeros(n) for k, n in proto["state_dims"].items()}
    else:
        raise ServerError(f"the server's handshake names no observation keys: {sorted(metadata)}")
    return obs | {"prompt": prompt}


class DryRunRobot:
    """Synthetic camera frames and a resting state; prints the chunks instead of moving anything."""

    def __init__(self, prompt: str = "pick up the cube and place it in the bowl", size=(180, 320), seed: int = 0):
        self.prompt, self.size, self.rng = prompt, size, np.random.default_rng(seed)
        self.metadata: dict = {}

    def get_observation(self) -> dict:
        return synthetic_observation(self.metadata, self.rng, self.size, self.prompt)

    def apply_actions(self, actions: np.ndarray) -> None:
        with np.printoptions(precision=3, suppress=True):
            print(f"  {len(actions)} actions, first {actions[0]}, last {actions[-1]}", flush=True)


def run_client(url: str, token: str | None, robot: DryRunRobot, chunks: int = 3,
               session_id: str | None = None) -> list[np.ndarray]:
    out = []
    with PolicyClient(url, token) as client:
        print(f"connected: {client.metadata}", flush=True)
        robot.metadata = client.metadata
        for i in range(chunks):
            obs = robot.get_observation()
            if session_id:
                obs["session_id"] = session_id
            reply = client.infer(obs)
            print(f"chunk {i}: {reply['actions'].shape}, {reply['server_timing']['infer_ms']:.1f} ms", flush=True)
            robot.apply_actions(reply["actions"])
            out.append(reply["actions"])
    return out


def load_test(url: str, token: str | None, sessions: int = 50, requests_per_session: int = 4,
              timeout_s: float = 300.0, image_size=(64, 64)) -> dict:
    """`sessions` concurrent connections, each sending `requests_per_session` observations; bounded by timeout_s.
    Reports the requests answered per second over the run, the latency percentiles over all requests, and each
    session's own p95 (median and worst over the sessions): the tail one robot feels."""
    latencies: dict[int, list[float]] = {}
    errors, lock = [], threading.Lock()
    deadline = time.monotonic() + timeout_s

    def one(i):
        try:
            rng = np.random.default_rng(i)
            with PolicyClient(url, token, timeout=timeout_s) as c:
                for _ in range(requests_per_session):
                    if time.monotonic() > deadline:
                        raise TimeoutError("load test deadline")
                    t0 = time.perf_counter()
                    reply = c.infer({**synthetic_observation(c.metadata, rng, image_size), "session_id": f"load-{i}"})
                    assert reply["actions"].ndim == 2
                    with lock:
                        latencies.setdefault(i, []).append((time.perf_counter() - t0) * 1e3)
        except Exception as exc:
            with lock:
                errors.append(f"session {i}: {type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 5)
    wall = time.perf_counter() - t0
    with lock:  # a thread past the deadline may still be adding
        measured = {i: list(per) for i, per in latencies.items()}
        failed = list(errors)
    every = [ms for per in measured.values() for ms in per]
    arr = np.asarray(every) if every else np.zeros(1)
    per_session_p95 = np.asarray([np.percentile(per, 95) for per in measured.values()]) if measured else np.zeros(1)
    return {"sessions": sessions, "requests": len(every), "errors": len(failed), "error_samples": failed[:3],
            "wall_s": round(wall, 2), "requests_per_s": round(len(every) / wall, 2),
            "latency_ms": {k: round(float(np.percentile(arr, q)), 1) for k, q in (("p50", 50), ("p95", 95), ("p99", 99))}
            | {"max": round(float(arr.max()), 1)},
            "session_p95_ms": {"median": round(float(np.median(per_session_p95)), 1),
                               "max": round(float(per_session_p95.max()), 1)}}
