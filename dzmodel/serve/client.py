"""`dz client`: the small client a Franka control node runs, and a loopback load test.

The robot side is a hook (`Robot`: get_observation / apply_actions). `--dry-run` uses a synthetic robot that
only prints the action chunks, so nothing moves.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import numpy as np

from .protocol import pack, unpack


class ServerError(RuntimeError):
    """The server refused the connection or answered with an error frame."""


class PolicyClient:
    def __init__(self, url: str, token: str, timeout: float = 60.0):
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        try:
            self.ws = connect(url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=2**26,
                              open_timeout=timeout, close_timeout=5)
        except InvalidStatus as exc:
            raise ServerError(f"{url}: the server refused the connection (HTTP {exc.response.status_code})") from None
        self.timeout = timeout
        self.metadata = unpack(self.ws.recv(timeout=timeout))
        if "error" in self.metadata:
            raise ServerError(self.metadata["error"])

    def infer(self, obs: dict) -> dict:
        self.ws.send(pack(obs))
        reply = unpack(self.ws.recv(timeout=self.timeout))
        if "error" in reply:
            raise ServerError(reply["error"])
        return reply

    def close(self) -> None:
        self.ws.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Robot(Protocol):
    def get_observation(self) -> dict: ...

    def apply_actions(self, actions: np.ndarray) -> None: ...


class DryRunRobot:
    """Synthetic camera frames and joints; prints the chunks instead of moving anything."""

    def __init__(self, prompt: str = "pick up the cube and place it in the bowl", size=(180, 320), seed: int = 0):
        self.prompt, self.size, self.rng = prompt, size, np.random.default_rng(seed)
        self.joints = np.array([0.0, -0.78, 0.0, -2.36, 0.0, 1.57, 0.78])

    def get_observation(self) -> dict:
        h, w = self.size
        img = lambda: self.rng.integers(0, 255, (h, w, 3), dtype=np.uint8)  # noqa: E731
        return {"observation/exterior_image_1_left": img(), "observation/wrist_image_left": img(),
                "observation/joint_position": self.joints.copy(), "observation/cartesian_position": np.zeros(6),
                "observation/gripper_position": np.zeros(1), "prompt": self.prompt}

    def apply_actions(self, actions: np.ndarray) -> None:
        with np.printoptions(precision=3, suppress=True):
            print(f"  {len(actions)} actions, first {actions[0]}, last {actions[-1]}", flush=True)


def run_client(url: str, token: str, robot: Robot, chunks: int = 3, session_id: str | None = None) -> list[np.ndarray]:
    out = []
    with PolicyClient(url, token) as client:
        print(f"connected: {client.metadata}", flush=True)
        for i in range(chunks):
            obs = robot.get_observation()
            if session_id:
                obs["session_id"] = session_id
            reply = client.infer(obs)
            print(f"chunk {i}: {reply['action'].shape}, {reply['server_timing']['infer_ms']:.1f} ms", flush=True)
            robot.apply_actions(reply["action"])
            out.append(reply["action"])
    return out


def load_test(url: str, token: str, sessions: int = 50, requests_per_session: int = 4, timeout_s: float = 300.0,
              image_size=(64, 64)) -> dict:
    """`sessions` concurrent connections, each sending `requests_per_session` observations; bounded by timeout_s."""
    latencies, errors, lock = [], [], threading.Lock()
    deadline = time.monotonic() + timeout_s

    def one(i):
        try:
            robot = DryRunRobot(size=image_size, seed=i)
            with PolicyClient(url, token, timeout=timeout_s) as c:
                for _ in range(requests_per_session):
                    if time.monotonic() > deadline:
                        raise TimeoutError("load test deadline")
                    t0 = time.perf_counter()
                    reply = c.infer({**robot.get_observation(), "session_id": f"load-{i}"})
                    assert reply["action"].ndim == 2
                    with lock:
                        latencies.append((time.perf_counter() - t0) * 1e3)
        except Exception as exc:
            with lock:
                errors.append(f"session {i}: {type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 5)
    arr = np.asarray(latencies) if latencies else np.zeros(1)
    return {"sessions": sessions, "requests": len(latencies), "errors": len(errors), "error_samples": errors[:3],
            "wall_s": round(time.perf_counter() - t0, 2),
            "latency_ms": {k: round(float(np.percentile(arr, q)), 1) for k, q in (("p50", 50), ("p95", 95), ("p99", 99))}
            | {"max": round(float(arr.max()), 1)}}
