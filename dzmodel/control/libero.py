"""`dz client URL`: a control node for the LIBERO Panda (the simulated Franka), driven through any policy server
of this protocol (ours, or openpi's for LIBERO), at a fixed control rate, with an action-chunk broker that
infers the next chunk while the current one executes.

The observation goes out under the keys the server's handshake names (`protocol` in our metadata), from the
same env worker and camera orientation as `dz eval libero`; the gripper is binarised as there.
"""

from __future__ import annotations

import csv
import io
import json
import time
import uuid
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_text
from ..progress import Progress
from ..serve.client import ChunkBroker, PolicyClient, ServerError

ENV_FIELDS = ("image", "wrist_image", "state")   # what the LIBERO env worker observes (libero_env.to_policy_obs)


def libero_keys(metadata: dict) -> dict[str, str]:
    """protocol key -> env observation field, from the server's handshake metadata."""
    if "action_space" in metadata:
        raise ServerError("the server speaks RoboArena's DROID protocol (joint-space actions); the LIBERO client "
                          "needs a server for a LIBERO embodiment (delta end-effector actions)")
    proto = metadata.get("protocol")
    if not proto:
        raise ServerError(f"the server's handshake names no observation keys (got {sorted(metadata)}); "
                          "openpi's LIBERO keys are assumed only for servers that send none")
    keys = {**proto["images"], **proto["state"]}
    unknown = sorted(v for v in keys.values() if v not in ENV_FIELDS)
    if unknown:
        raise ServerError(f"the server's embodiment {metadata.get('embodiment')!r} reads {unknown}; the LIBERO "
                          f"env observes {list(ENV_FIELDS)}")
    if metadata.get("action_dim") not in (None, 7):
        raise ServerError(f"the server predicts {metadata['action_dim']}-dim actions; LIBERO takes 7")
    return keys


def run_libero_client(url: str, token: str | None, suite: str = "object", task: int = 0, episodes: int = 1,
                      control_hz: float = 20.0, max_steps: int = 300, seed: int = 0, camera_size: int = 256,
                      actions_per_chunk: int | None = None, out: str | Path | None = None,
                      progress: bool = True, overlap: bool = True) -> dict:
    from ..eval.libero_env import WorkerCrashed, env_action, list_tasks
    from ..eval.libero_workers import EnvWorkerPool

    tasks = list_tasks(suite)
    if not 0 <= task < len(tasks):
        raise ValueError(f"suite {suite!r} has tasks 0..{len(tasks) - 1}; got --task {task}")
    spec = tasks[task]
    if episodes > spec.num_init_states:
        raise ValueError(f"task {task} of {suite!r} has {spec.num_init_states} init states; asked for {episodes}")
    period = 1.0 / control_hz
    rows = []
    with PolicyClient(url, token) as client, EnvWorkerPool(1, camera_size=camera_size, seed=seed) as pool:
        keys = libero_keys(client.metadata)
        print(f"connected to {url}: {client.metadata.get('embodiment')} (step {client.metadata.get('step')}); "
              f"task {task}: {spec.language}", flush=True)
        for ep in range(episodes):
            obs = pool.reset([(0, spec, ep)])[0]
            if isinstance(obs, WorkerCrashed):
                raise RuntimeError(f"the LIBERO env crashed on reset: {obs.reason}")
            session = f"libero-{suite}-{task}-{ep}-{uuid.uuid4().hex[:8]}"

            def infer(o):
                return client.infer(o)["actions"]

            broker = ChunkBroker(infer, control_hz, actions_per_chunk, overlap=overlap)
            current = {"obs": obs}
            observe = lambda: {k: current["obs"][f] for k, f in keys.items()} | {  # noqa: E731
                "prompt": spec.language, "session_id": session}
            steps, success, late = 0, False, 0
            bar = Progress(max_steps, enabled=progress, desc=f"episode {ep}", unit="step")
            t_start = deadline = time.perf_counter()
            try:
                while steps < max_steps and not success:
                    action = env_action(broker.next_action(steps, observe))
                    reply = pool.step({0: action})[0]
                    if isinstance(reply, WorkerCrashed):
                        raise RuntimeError(f"the LIBERO env crashed: {reply.reason}")
                    current["obs"], success = reply[0], bool(reply[1])
                    steps += 1
                    bar.update()
                    deadline += period
                    wait = deadline - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                    else:  # the sim or the server could not keep the rate: note it, do not catch up in a burst
                        late += 1
                        deadline = time.perf_counter()
            finally:
                bar.close()
                broker.close()
            client.reset(session)
            wall = time.perf_counter() - t_start
            lat = np.asarray(broker.latencies_s or [0.0]) * 1e3
            rows.append({"episode": ep, "success": success, "steps": steps, "seconds": round(wall, 2),
                         "achieved_hz": round(steps / wall, 2), "late_steps": late, "chunks": len(broker.latencies_s),
                         "latency_p50_ms": round(float(np.percentile(lat, 50)), 1),
                         "latency_p95_ms": round(float(np.percentile(lat, 95)), 1),
                         "wait_total_s": round(sum(broker.waits_s), 2), "skipped_actions": broker.skipped})
            print(f"episode {ep}: {'success' if success else 'failure'} after {steps} steps, "
                  f"{rows[-1]['achieved_hz']} Hz (target {control_hz:g}), chunk latency p50 "
                  f"{rows[-1]['latency_p50_ms']} ms, waited {rows[-1]['wait_total_s']} s for chunks", flush=True)
    summary = {"url": url, "suite": suite, "task": task, "task_name": spec.name, "episodes": episodes,
               "successes": sum(r["success"] for r in rows), "success_rate": sum(r["success"] for r in rows) / episodes,
               "control_hz": control_hz, "broker": "overlap" if overlap else "sync", "per_episode": rows}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
        text = io.StringIO()
        w = csv.DictWriter(text, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        atomic_write_text(out / "episodes.csv", text.getvalue())
    return summary
