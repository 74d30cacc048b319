"""`dz bench serve`: what one GPU running `dz serve` gives several robots at once. N concurrent clients (openpi's own
websocket client where it is installed), each one session of `requests` observations, against the server of
`dz serve` (`PolicyServer`, its dynamic batcher, the bundle's protocol and safety layer) on localhost.

Rows, one server each: one client with batching off (the single-robot baseline), N clients with batching off (one
forward per request), N clients with `--max-batch`. Each row reports the chunks per second over all clients, the
latency percentiles over every request, each client's own p95 (the tail one robot feels) against the one-client
p95, and the batch sizes the server formed. With a period, the N clients ask as robots do, each for a chunk every
period (the one-client baseline stays back to back).

The model is the preset's with random weights behind an embodiment's protocol (no bundle: a chunk's latency does not
depend on the weights' values, and a 5B bundle with its encoders is tens of GB), at the solver setting given.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..data.embodiments import get_embodiment, load_embodiments
from ..policy.policy import EmbodiedPolicy
from .policy_bench import PolicySetting, _configure, random_policy

TOKEN = "bench-serve-token"


def served_policy(preset_name: str, embodiment: str, device: str, setting: PolicySetting, seed: int = 0,
                  embodiment_files: list[str] | None = None) -> EmbodiedPolicy:
    """The preset's model with random weights as `load_policy` gives a bundle's: `embodiment`'s views, layout,
    action horizon and state and action widths (`embodiment_files`: YAML files that declare more), the solver and
    speed settings of `setting`."""
    emb = get_embodiment(embodiment, load_embodiments(embodiment_files or []))
    state_dims = {k.name: k.dim for k in emb.state}
    policy = random_policy(preset_name, device, "bf16" if setting.weights in ("bf16", "fp8") else "fp32", seed,
                           overrides={"num_action_per_block": emb.action_horizon},
                           action_dim=sum(k.dim for k in emb.action), state_dim=sum(state_dims.values()),
                           image_size=emb.image_size)
    _configure(policy, setting, device)
    return EmbodiedPolicy(policy=policy, embodiment=emb, relative_pairs=[], step=None,
                          model_dir=Path(f"<{preset_name}, random weights>"), state_dims=state_dims)


def _client(port: int):
    """openpi's websocket client where it is installed, else the project's own (the same wire protocol)."""
    try:
        from openpi_client.websocket_client_policy import WebsocketClientPolicy
    except ImportError:
        from ..serve.client import PolicyClient

        client = PolicyClient(f"ws://127.0.0.1:{port}", TOKEN)
        return client, client.metadata, "dz"
    client = WebsocketClientPolicy("127.0.0.1", port, api_key=TOKEN)
    return client, client.get_server_metadata(), "openpi"


def drive(port: int, clients: int, requests: int, warmup: int, seed: int = 0, timeout_s: float = 600.0,
          period_ms: float = 0.0) -> dict:
    """`clients` threads, each one connection (one session) sending `warmup` then `requests` observations. The clock
    runs from the moment every client has warmed up (a barrier) to the last answer.

    period_ms 0: each client asks again as soon as it is answered (closed loop: the server's full load; by Little's
    law a client then waits about clients / throughput). period_ms P: each client asks for a chunk every P ms, as a
    robot that plays each chunk for P ms, the clients' phases spread evenly over P; a request whose time came while
    the last was unanswered goes as soon as the answer comes and counts as late (the robot waited)."""
    from ..serve.client import synthetic_observation

    latencies: dict[int, list[float]] = {}
    errors: list[str] = []
    kinds: list[str] = []
    barrier = threading.Barrier(clients + 1)
    done = [0.0]
    late_total = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            client, metadata, kind = _client(port)
            rng = np.random.default_rng(seed + i)
            size = tuple((metadata.get("roboarena") or metadata).get("image_resolution") or (224, 224))
            for _ in range(warmup):
                client.infer(synthetic_observation(metadata, rng, size))
            barrier.wait(timeout=timeout_s)
            first_due = time.perf_counter() + period_ms / 1e3 * i / clients
            own, late = [], 0
            for k in range(requests):
                if period_ms:
                    wait = first_due + k * period_ms / 1e3 - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                    elif k:
                        late += 1
                t0 = time.perf_counter()
                reply = client.infer(synthetic_observation(metadata, rng, size))
                own.append((time.perf_counter() - t0) * 1e3)
                if np.asarray(reply["actions"]).ndim != 2:
                    raise ValueError(f"a reply's actions have shape {np.shape(reply['actions'])}")
            with lock:
                latencies[i] = own
                late_total[0] += late
                kinds.append(kind)
                done[0] = max(done[0], time.perf_counter())
        except Exception as exc:  # reported in the row
            with lock:
                errors.append(f"client {i}: {type(exc).__name__}: {exc}")
            barrier.abort()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=timeout_s)
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    for t in threads:
        t.join(timeout_s)
    every = [ms for own in latencies.values() for ms in own]
    row = {"clients": clients, "requests": len(every), "errors": errors[:3], "client": sorted(set(kinds))}
    if period_ms:
        row.update(period_ms=period_ms, late_requests=late_total[0])
    if every and not errors:
        wall = done[0] - start
        row.update(wall_s=round(wall, 3), chunks_per_s=round(len(every) / wall, 2),
                   latency_ms={k: round(float(np.percentile(every, q)), 1) for k, q in (("p50", 50), ("p95", 95))},
                   client_p95_ms=sorted(round(float(np.percentile(own, 95)), 1) for own in latencies.values()))
    return row


def _health(port: int) -> dict:
    """The server's /healthz (its batch counts and sizes)."""
    import json
    from urllib.request import urlopen

    with urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
        return json.loads(reply.read())


def run_serve_bench(preset_name: str = "tiny", embodiment: str = "libero_sim_tiny", device: str = "cpu",
                    setting: PolicySetting | None = None, clients: int = 8, max_batch: int = 8,
                    batch_window_ms: float = 5.0, requests: int = 20, warmup: int = 3, seed: int = 0,
                    embodiment_files: list[str] | None = None, progress=None, period_ms: float = 0.0) -> list[dict]:
    """Three rows on one model: 1 client unbatched, `clients` unbatched, `clients` with `max_batch`; period_ms > 0:
    the clients of the last two rows ask every period_ms (`drive`), the one-client row stays closed loop."""
    from ..serve.server import BundlePolicy, ServerLimits, ServerThread, freeze_heap, warm_up

    setting = setting or PolicySetting()
    embodied = served_policy(preset_name, embodiment, device, setting, seed, embodiment_files)
    warm_up(embodied, max_batch)
    freeze_heap()  # as dz serve does after its warm-up
    common = {"preset": preset_name, "embodiment": embodiment, "image_size": list(embodied.policy.image_size),
              "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
              "solver_steps": setting.solver_steps, "cfg_scale": setting.cfg_scale, "dit_steps": setting.dit_steps,
              "cuda_graphs": setting.cuda_graphs, "compile": setting.compile, "weights": setting.weights,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    rows: list[dict] = []
    for n, batch in ((1, 1), (clients, 1), (clients, max_batch)):
        limits = ServerLimits(max_batch=batch, batch_window_ms=batch_window_ms, max_connections_per_client=max(16, n))
        with ServerThread(BundlePolicy(embodied), TOKEN, limits=limits) as srv:
            row = {**common, "max_batch": batch, "batch_window_ms": batch_window_ms,
                   **drive(srv.port, n, requests, warmup, seed, period_ms=period_ms if n > 1 else 0.0)}
            health = _health(srv.port)
        if "batching" in health:
            row["batching"] = health["batching"]
        if rows and "client_p95_ms" in rows[0] and "client_p95_ms" in row:
            row["worst_client_p95_vs_one_client"] = round(row["client_p95_ms"][-1] / rows[0]["client_p95_ms"][0], 2)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows
