"""LIBERO env worker processes: `EnvWorkerPool` runs one `OffScreenRenderEnv` per worker process (spawn) and steps
them in parallel, each at its own pace; every reply has a timeout, and a worker that dies, hangs or raises is killed
and restarted, reported as `WorkerCrashed`. The scripted expert's steps (`ExpertStep`, with DART noise on the arm
dims) and episode starts (`EpisodeInit`: standard, perturbed or freshly sampled, and the robustness perturbations of
`libero_perturb`) run inside the workers.
Imports nothing beyond numpy at module level, like `libero_env`."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .libero_env import (ACTION_DIM, CAMERAS, SETTLE_ACTION, SETTLE_STEPS, WorkerCrashed, _init_states, check_libero,
                         ensure_libero_config, init_state, to_policy_obs)

log = logging.getLogger(__name__)


# --- env worker processes ----------------------------------------------------------------------------------------

_RAW_KEYS = ("agentview_image", "robot0_eye_in_hand_image", "robot0_eef_pos", "robot0_eef_quat",
             "robot0_gripper_qpos", "robot0_joint_pos")


class ExpertStep(NamedTuple):
    """A worker's reply to `expert_step`: the observation after the step, LIBERO's success, the expert's action at
    the state before the step (the label), the action the env executed (the label, the label plus DART noise, or
    the action the caller passed), and whether the label is valid (`ScriptedExpert.label_valid`)."""

    obs: dict
    success: bool
    label: np.ndarray
    executed: np.ndarray
    label_valid: bool


ARM_DIMS = 6  # the delta position and rotation dims of the 7-dim action (DART noise goes there, not on the gripper)


def _sampled_state(env, avoid, min_distance: float, max_resets: int = 20) -> np.ndarray:
    """A fresh init state from the task's own init distribution (LIBERO's placement samplers, run by `env.reset()`
    on the seeded global numpy generator), redrawn while it is within `min_distance` of a state in `avoid`."""
    from .libero_expert import init_state_distance, movable_xy_index

    index = movable_xy_index(env) if avoid is not None else None
    for _ in range(max_resets):
        state = np.array(env.get_sim_state(), dtype=np.float64)
        if index is None or init_state_distance(index, state, avoid).min() >= min_distance:
            return state
        env.reset()
    raise RuntimeError(f"no sampled init state within {max_resets} resets stays {min_distance} m from every "
                       "standard init state (the task's init regions are small: lower --min-shift)")


def _init_info(env, state, base, avoid) -> dict:
    """How an episode's start relates to its base and to the standard init states (for the recording)."""
    from .libero_expert import init_state_distance, movable_xy_index

    index = movable_xy_index(env)
    info = {"object_xy_index": index.tolist()}
    if base is not None:
        xy = np.stack([index, index + 1], -1)
        info["object_shift_xy"] = (state[xy] - base[xy]).tolist()
    if avoid is not None:
        info["min_distance_to_standard"] = float(init_state_distance(index, state, avoid).min())
    return info


class _EnvWorker:
    """The env of one worker process and its running episode: the latest raw observation, the scripted expert and
    its DART noise generator. Each command is a method; `_worker_main` carries them over the pipe."""

    def __init__(self, camera_size: int, keep_raw: bool, privileged: bool):
        self.camera_size, self.keep_raw, self.privileged = camera_size, keep_raw, privileged
        self.env, self.env_bddl = None, None
        self.last_raw, self.expert, self.noise_rng = None, None, None

    def convert(self, raw) -> dict:
        obs = to_policy_obs(raw)
        if self.keep_raw:
            obs["raw"] = {k: np.array(raw[k]) for k in _RAW_KEYS}
        if self.privileged:
            from .libero_scripted import goal_positions

            obs["objects"] = goal_positions(self.env).astype(np.float32)
        return obs

    def _open(self, bddl_file: str) -> None:
        if self.env is not None and self.env_bddl == bddl_file:
            return
        self.close()
        ensure_libero_config()  # normally written by the parent already
        with contextlib.redirect_stdout(sys.stderr):
            from libero.libero.envs import OffScreenRenderEnv
        self.env = OffScreenRenderEnv(bddl_file_name=bddl_file, camera_heights=self.camera_size,
                                      camera_widths=self.camera_size, camera_names=list(CAMERAS))
        self.env_bddl = bddl_file

    def reset(self, bddl_file: str, state, seed: int, perturb, extra: dict) -> dict:
        if extra.get("scene"):  # a perturbation may need a problem of its own (extra objects)
            from .libero_perturb import scene_bddl

            bddl_file = scene_bddl(bddl_file, *extra["scene"])
        self._open(bddl_file)
        env = self.env
        env.seed(seed)
        env.reset()
        self.expert, self.noise_rng = None, None
        avoid, min_shift = extra.get("avoid"), float(extra.get("min_shift_m", 0.0))
        base = None
        if extra.get("sample"):
            state = _sampled_state(env, avoid, min_shift)
        elif perturb is not None:
            from .libero_expert import perturb_init_state

            base = np.asarray(state, dtype=np.float64)
            state = perturb_init_state(env, base, np.random.default_rng(perturb[0]), perturb[1], min_shift, avoid)
        scene_info = None
        if extra.get("scene"):  # robustness perturbations (libero_perturb): model edits, moved objects
            from .libero_perturb import apply_scene

            state, scene_info = apply_scene(env, state, *extra["scene"])
        raw = env.set_init_state(state)
        for _ in range(SETTLE_STEPS):
            raw, _, _, _ = env.step(list(SETTLE_ACTION))
        self.last_raw = raw
        reply = self.convert(raw)
        reply["init_state"] = np.array(state, dtype=np.float64)
        if extra.get("describe"):
            reply["init_info"] = _init_info(env, reply["init_state"], base, avoid)
        if scene_info is not None:
            reply["perturbation"] = scene_info
        return reply

    def step(self, action) -> tuple[dict, bool]:
        if self.env is None:
            raise RuntimeError("step before reset")
        raw, _, done, _ = self.env.step(action)
        self.last_raw = raw
        return self.convert(raw), bool(done)  # LIBERO's done is its success check

    def expert_step(self, seed: int, opts: dict) -> "ExpertStep":
        """The scripted expert acts from privileged simulator state, so it runs here beside the env; its action is
        the label, the executed one may be noised (DART) or the caller's (DAgger)."""
        if self.env is None:
            raise RuntimeError("expert_step before reset")
        sigma = float(opts.get("noise", 0.0))
        if self.expert is None:
            from .libero_scripted import ScriptedExpert

            self.expert = ScriptedExpert(self.env, seed=seed, recover=bool(opts.get("recover")),
                                         hold_orientation=bool(opts.get("hold_orientation", sigma > 0)))
            self.noise_rng = np.random.default_rng(int(opts.get("noise_seed", 0)))
        label = np.asarray(self.expert.act(self.last_raw), dtype=np.float64)
        valid = self.expert.label_valid
        if not np.all(np.isfinite(label)):  # neither executed nor recorded: the attempt ends here
            label, valid = np.zeros(ACTION_DIM), False
        noise = self.noise_rng.normal(0.0, sigma, ARM_DIMS) if sigma > 0 else None
        if opts.get("execute") is not None:
            executed = np.asarray(opts["execute"], dtype=np.float64).reshape(ACTION_DIM).copy()
        else:
            executed = label.copy()
            if noise is not None:  # DART: the expert's action plus noise on the arm dims, clipped
                executed[:ARM_DIMS] = np.clip(executed[:ARM_DIMS] + noise, -1.0, 1.0)
        raw, _, done, _ = self.env.step(executed)
        self.last_raw = raw
        return ExpertStep(self.convert(raw), bool(done), label, executed, bool(valid))

    def handle(self, msg: tuple):
        if msg[0] == "reset":
            _, bddl_file, state, seed, perturb, *rest = msg
            return self.reset(bddl_file, state, seed, perturb, rest[0] if rest else {})
        if msg[0] == "step":
            return self.step(msg[1])
        if msg[0] == "expert_step":
            return self.expert_step(msg[1], msg[2] if len(msg) > 2 and msg[2] else {})
        raise ValueError(f"unknown command {msg[0]!r}")

    def close(self) -> None:
        if self.env is not None:
            with contextlib.suppress(Exception):
                self.env.close()  # releases the EGL context (else noise at exit)
        self.env, self.env_bddl = None, None


def _worker_main(conn, camera_size: int, keep_raw: bool, privileged: bool = False) -> None:
    """One env worker: commands in, ("ok", payload) or ("error", traceback) out, until "close" or EOF."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    worker = _EnvWorker(camera_size, keep_raw, privileged)
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "close":
                break
            try:
                out = ("ok", worker.handle(msg))
            except Exception:
                out = ("error", traceback.format_exc(limit=8))
            try:
                conn.send(out)
            except (OSError, ValueError):  # the parent is gone
                break
    finally:
        worker.close()
        conn.close()


@dataclass(frozen=True)
class EpisodeInit:
    """How an episode starts, beyond its task's standard init state: an explicit MuJoCo state (a recorded
    episode's), a seeded perturbation of the standard one (`libero_expert.perturb_init_state`), the env seed."""

    state: np.ndarray | None = None
    perturb_seed: int | None = None
    max_shift_m: float = 0.0
    env_seed: int | None = None
    # recording only: `sample` a fresh init state from the task's init distribution (env.reset's placement
    # samplers) instead of a standard one; `min_shift_m` > 0: a perturbed or sampled start keeps at least this
    # x/y distance (some object) from every standard init state of the task, and a perturbation moves every
    # object by at least this much; `describe`: the reply's `init_info` says how the start was made
    sample: bool = False
    min_shift_m: float = 0.0
    describe: bool = False
    # robustness perturbations of the scene (`libero_perturb.Perturbation`s), applied after the reset and before the
    # init state is set, seeded by `scene_key` = (eval seed, suite, task index, init state index)
    scene: tuple = ()
    scene_key: tuple = ()


class _Worker:
    def __init__(self, process, conn):
        self.process, self.conn = process, conn
        self.bddl_file: str | None = None  # the task its env was built for
        self.active = False                # an episode is running (reset done, no crash since)


class EnvWorkerPool:
    """`num_workers` processes, each owning one LIBERO `OffScreenRenderEnv` (cameras agentview and
    robot0_eye_in_hand, `camera_size` square). Each reply has `timeout_s`; a worker that dies, hangs, or raises
    is killed and replaced by a fresh process, and its entry in the result is a `WorkerCrashed`.

    Two ways to drive it. `reset`, `step` and `expert_step` send to every addressed worker, then wait for all of
    their replies (the workers run in parallel, in lockstep). `submit_reset`, `submit_step` and
    `submit_expert_step` only send; `wait()` returns the replies of whichever workers have answered. A loop on
    those never stalls the other workers while one of them rebuilds its env for a new episode (a LIBERO reset
    reloads the MuJoCo model: seconds), so recording and evaluation keep every worker busy.
    Use as a context manager, or call `close()`."""

    def __init__(self, num_workers: int = 2, camera_size: int = 128, timeout_s: float = 120.0, seed: int = 0,
                 keep_raw: bool = False, privileged: bool = False):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        ensure_libero_config()  # before spawning: the workers inherit LIBERO_CONFIG_PATH and MUJOCO_GL
        check_libero()
        self.num_workers = num_workers
        self.camera_size = camera_size
        self.timeout_s = timeout_s
        self.seed = seed
        self.keep_raw = keep_raw
        self.privileged = privileged  # observations also carry `objects` (libero_expert.goal_positions)
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * num_workers
        self._in_flight: dict[int, tuple[str, float, str | None]] = {}  # worker -> (command, deadline, bddl file)
        self._answered: dict = {}  # replies known before any wait (a send that failed)
        self._closed = False
        self.workers_started = 0  # restarts after a crash included
        try:
            for w in range(num_workers):
                self._start(w)
        except BaseException:
            self.close()
            raise

    # -- public API --

    @property
    def pids(self) -> dict[int, int]:
        return {w: wk.process.pid for w, wk in enumerate(self._workers) if wk is not None}

    @property
    def busy(self) -> set[int]:
        """The workers whose command has not been answered by `wait()` yet."""
        return set(self._in_flight) | set(self._answered)

    def reset(self, assignments, inits: dict | None = None) -> dict[int, dict | WorkerCrashed]:
        """assignments: [(worker_id, TaskSpec, episode_index)]. Each addressed worker (re)builds its env if the task
        changed, seeds it (pool seed + episode index), resets, sets the episode's fixed init state, runs the
        SETTLE_STEPS no-op steps, and returns its observation (`to_policy_obs`, plus `init_state`: the MuJoCo
        state the episode started from). `inits` {worker_id: EpisodeInit} replaces a worker's standard init state
        (a recorded one) or perturbs it (seeded), and may set the env seed."""
        self._check_idle()
        return self._lockstep(self._reset_commands(assignments, inits))

    def expert_step(self, seeds: dict[int, int],
                    options: dict[int, dict] | None = None) -> dict[int, ExpertStep | WorkerCrashed]:
        """Let each addressed worker's scripted expert (`libero_scripted.ScriptedExpert`, built on the first call
        after a reset with the given seed) choose an action from the simulator state (the label) and step the env.
        `options` {worker_id: {...}}: `execute` an action instead of the label (DAgger: the learned policy's),
        `noise` σ: execute the label plus N(0, σ²) on the 6 arm dims, clipped to [-1, 1] (DART; `noise_seed` seeds it
        per episode), `recover` / `hold_orientation`: the expert's modes (read when it is built).
        Returns {worker_id: ExpertStep} (or WorkerCrashed)."""
        self._check_idle()
        return self._lockstep(self._expert_commands(seeds, options))

    def step(self, actions: dict) -> dict[int, tuple[dict, bool] | WorkerCrashed]:
        """actions: {worker_id: (7,) action}. Returns {worker_id: (obs, success)} (or WorkerCrashed)."""
        self._check_idle()
        return self._lockstep(self._step_commands(actions))

    def submit_reset(self, assignments, inits: dict | None = None) -> None:
        """`reset` without waiting: its replies come from `wait()`."""
        self._submit(self._reset_commands(assignments, inits))

    def submit_expert_step(self, seeds: dict[int, int], options: dict[int, dict] | None = None) -> None:
        """`expert_step` without waiting: its replies come from `wait()`."""
        self._submit(self._expert_commands(seeds, options))

    def submit_step(self, actions: dict) -> None:
        """`step` without waiting: its replies come from `wait()`."""
        self._submit(self._step_commands(actions))

    def wait(self) -> dict:
        """The replies of the busy workers that have answered ({worker_id: reply or WorkerCrashed}): blocks until
        at least one has, or its reply is overdue (then it is a WorkerCrashed). {} when no worker is busy."""
        out, self._answered = self._answered, {}
        while self._in_flight and not out:
            wait = max(0.0, min(d for _, d, _ in self._in_flight.values()) - time.monotonic())
            out.update(self._receive(wait))
            now = time.monotonic()
            for w, (_, deadline, _) in list(self._in_flight.items()):
                if now >= deadline:
                    del self._in_flight[w]
                    out[w] = self._crash(w, f"no reply within {self.timeout_s:g} s")
        out.update(self._receive(0.0))  # whatever else is ready: one batch for the caller
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for wk in self._workers:
            if wk is not None:
                with contextlib.suppress(Exception):
                    wk.conn.send(("close",))
        deadline = time.monotonic() + 15
        for w, wk in enumerate(self._workers):
            if wk is None:
                continue
            wk.process.join(max(0.0, deadline - time.monotonic()))
            if wk.process.is_alive():
                wk.process.kill()
                wk.process.join(5)
            with contextlib.suppress(Exception):
                wk.conn.close()
            self._workers[w] = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals --

    def _check_worker(self, w) -> None:
        if self._closed:
            raise RuntimeError("the env worker pool is closed")
        if not isinstance(w, (int, np.integer)) or not 0 <= w < self.num_workers:
            raise ValueError(f"worker ids are 0..{self.num_workers - 1}; got {w!r}")
        if w in self.busy:
            raise ValueError(f"env worker {w} is busy: wait() for its reply first")

    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=_worker_main, args=(child, self.camera_size, self.keep_raw, self.privileged),
                              name=f"libero-env-{w}", daemon=True)
        p.start()
        child.close()  # so that the worker's death reads as EOF here
        self._workers[w] = _Worker(p, parent)
        self.workers_started += 1

    def _crash(self, w: int, reason: str) -> WorkerCrashed:
        wk = self._workers[w]
        if wk.process.is_alive():
            wk.process.kill()
        wk.process.join(10)
        code = wk.process.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                code = signal.Signals(-code).name
        with contextlib.suppress(Exception):
            wk.conn.close()
        log.warning("LIBERO env worker %d (pid %s, exit %s) crashed: %s; restarting it",
                    w, wk.process.pid, code, reason.strip().splitlines()[-1] if reason.strip() else reason)
        self._start(w)
        return WorkerCrashed(w, f"{reason} (pid {wk.process.pid}, exit {code})")

    def _reset_commands(self, assignments, inits: dict | None) -> dict:
        cmds = {}
        inits = inits or {}
        for w, task, episode in assignments:
            self._check_worker(w)
            if w in cmds:
                raise ValueError(f"worker {w} assigned twice in one reset")
            spec = inits.get(w) or EpisodeInit()
            state = init_state(task, episode) if spec.state is None else np.asarray(spec.state, dtype=np.float64)
            seed = self.seed + episode if spec.env_seed is None else spec.env_seed
            perturb = None if spec.perturb_seed is None else (spec.perturb_seed, spec.max_shift_m)
            extra = {}
            if spec.sample or spec.min_shift_m > 0 or spec.describe or spec.scene:
                extra = {"sample": spec.sample, "min_shift_m": spec.min_shift_m, "describe": spec.describe,
                         "avoid": _init_states(task.suite, task.index) if spec.min_shift_m > 0 else None}
                if spec.scene:
                    extra["scene"] = (tuple(spec.scene), tuple(spec.scene_key))
            cmds[w] = ("reset", task.bddl_file, state, seed, perturb, extra) if extra else \
                ("reset", task.bddl_file, state, seed, perturb)
        return cmds

    def _expert_commands(self, seeds: dict, options: dict | None) -> dict:
        cmds = {}
        options = options or {}
        for w, seed in seeds.items():
            self._check_running(w)
            opts = options.get(w)
            if opts and opts.get("execute") is not None:
                a = np.asarray(opts["execute"], dtype=np.float64).reshape(-1)
                if a.shape != (ACTION_DIM,) or not np.all(np.isfinite(a)):
                    raise ValueError(f"worker {w}: an action must be {ACTION_DIM} finite numbers, got {a}")
            cmds[w] = ("expert_step", int(seed), opts) if opts else ("expert_step", int(seed))
        return cmds

    def _step_commands(self, actions: dict) -> dict:
        cmds = {}
        for w, a in actions.items():
            self._check_running(w)
            a = np.asarray(a, dtype=np.float64).reshape(-1)
            if a.shape != (ACTION_DIM,) or not np.all(np.isfinite(a)):
                raise ValueError(f"worker {w}: an action must be {ACTION_DIM} finite numbers, got {a}")
            cmds[w] = ("step", a)
        return cmds

    def _check_running(self, w) -> None:
        self._check_worker(w)
        if not self._workers[w].active:
            raise ValueError(f"env worker {w} has no running episode: reset it first")

    def _submit(self, cmds: dict) -> set[int]:
        """Send each worker its command; a worker may have one command in flight. Returns the workers addressed."""
        for w, msg in cmds.items():
            if msg[0] == "reset":
                self._workers[w].active = False
            try:
                self._workers[w].conn.send(msg)
                self._in_flight[w] = (msg[0], time.monotonic() + self.timeout_s,
                                      msg[1] if msg[0] == "reset" else None)
            except (OSError, ValueError) as exc:  # a dead worker's pipe
                self._answered[w] = self._crash(w, f"send failed: {type(exc).__name__}: {exc}")
        return set(cmds)

    def _check_idle(self) -> None:
        if self.busy:
            raise RuntimeError(f"env workers {sorted(self.busy)} have replies pending: a lockstep call would take "
                               "them; wait() for them first")

    def _lockstep(self, cmds: dict) -> dict:
        """Send, then wait until every addressed worker has answered."""
        workers = self._submit(cmds)
        out: dict = {}
        while workers - set(out):
            got = self.wait()
            if not got:  # nothing in flight: cannot happen for submitted workers
                raise RuntimeError(f"env workers {sorted(workers - set(out))} have no command in flight")
            out.update(got)
        return out

    def _receive(self, timeout: float) -> dict:
        out: dict = {}
        conns = {self._workers[w].conn: w for w in self._in_flight}
        for conn in mp.connection.wait(list(conns), timeout=timeout):
            w = conns[conn]
            command, _, bddl_file = self._in_flight.pop(w)
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                out[w] = self._crash(w, "the worker process died")
                continue
            if kind != "ok":
                out[w] = self._crash(w, f"error in the worker:\n{payload}")
                continue
            if command == "reset":
                self._workers[w].active = True
                self._workers[w].bddl_file = bddl_file
            out[w] = payload
        return out
