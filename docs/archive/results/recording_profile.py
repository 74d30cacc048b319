"""Where a LIBERO recording step's time goes (the scripted expert, physics, two 128 px cameras), one env process alone
(`single`, with cProfile's top functions) and N at once (`multi N`: mean ms per step, aggregate steps per s). Run from
the repository root with LIBERO importable (suite_gpu.sh prof). STEPS: expert steps per process (default 150)."""

import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import sys
import time

import numpy as np

STEPS = int(os.environ.get("STEPS", 150))


def loop(args):
    task_i, cam, prof = args
    os.environ.setdefault("MUJOCO_GL", "egl")
    from dzmodel.eval.libero_env import ensure_libero_config, init_state, list_tasks
    from dzmodel.eval.libero_workers import _EnvWorker
    ensure_libero_config()
    t = list_tasks("goal")[task_i % 10]
    w = _EnvWorker(cam, keep_raw=False, privileged=True)
    w.reset(t.bddl_file, init_state(t, 0), 0, None, {})
    pr = cProfile.Profile() if prof else None
    t0 = time.perf_counter()
    if pr:
        pr.enable()
    n = 0
    for i in range(STEPS):
        s = w.expert_step(i, {"noise": 0.3, "noise_seed": 1})
        n += 1
        if s.success:
            w.reset(t.bddl_file, init_state(t, 1), 0, None, {})
    if pr:
        pr.disable()
    dt = time.perf_counter() - t0
    out = {"task": task_i, "cam": cam, "steps": n, "ms_per_step": 1000 * dt / n}
    if pr:
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
        out["top"] = buf.getvalue()[-3500:]
    w.close()
    return out


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "single":
        r = loop((0, 128, True))
        print(r.pop("top"))
        print(json.dumps(r))
    else:
        n = int(sys.argv[2])
        ctx = mp.get_context("spawn")
        t0 = time.perf_counter()
        with ctx.Pool(n) as pool:
            rs = pool.map(loop, [(i, 128, False) for i in range(n)])
        wall = time.perf_counter() - t0
        ms = [r["ms_per_step"] for r in rs]
        print(json.dumps({"procs": n, "ms_per_step_mean": float(np.mean(ms)), "min": min(ms), "max": max(ms),
                          "agg_steps_per_s": float(sum(1000 / m for m in ms)), "wall_s": wall}))
