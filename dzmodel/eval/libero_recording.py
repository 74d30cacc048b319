"""The attempts of one LIBERO recording (`dz data record libero`, libero_record.py), run over a pool of env workers:
each attempt's rows as the scripted expert labels them, DAgger's policy chunks, and the episodes kept, written in
(task, attempt) order. `cfg` is a `RecordConfig`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..data.lerobot_writer import LeRobotV3Writer, VectorFeature

FPS = 10                 # the public LIBERO LeRobot datasets' fps (one row per 20 Hz control step, as theirs)
ROBOT_TYPE = "panda"
IMAGE_KEY, WRIST_KEY = "observation.images.image", "observation.images.wrist_image"
STATE_KEY, ACTION_KEY = "observation.state", "action"
OBJECTS_KEY, EXECUTED_KEY = "observation.objects", "executed_action"
STATE_NAMES = {"motors": ["x", "y", "z", "roll", "pitch", "yaw", "gripper", "gripper"]}
ACTION_NAMES = {"motors": ["x", "y", "z", "roll", "pitch", "yaw", "gripper"]}
OBJECTS_NAMES = {"axes": ["object_x", "object_y", "object_z", "target_x", "target_y", "target_z"]}


@dataclass
class Attempt:
    task: object                       # TaskSpec
    number: int                        # attempt index within the task
    init_index: int
    env_seed: int
    expert_seed: int
    perturb_seed: int | None
    noise_seed: int = 0
    mix_seed: int = 0
    noise: float = 0.0                 # DART σ of this try
    retry: int = 0                     # 0: the start's first try; k: its k-th retry
    images: list = field(default_factory=list)
    wrists: list = field(default_factory=list)
    states: list = field(default_factory=list)
    actions: list = field(default_factory=list)    # the expert's labels
    executed: list = field(default_factory=list)   # what the env executed
    objects: list = field(default_factory=list)
    init_state: np.ndarray | None = None
    init_info: dict | None = None
    obs: dict | None = None
    success: bool = False
    note: str = ""
    mix_rng: object = None                         # DAgger: who acts per chunk
    queue: list = field(default_factory=list)      # DAgger: the policy's actions left in this chunk
    chunk_left: int = 0
    actors: list = field(default_factory=list)     # DAgger: "E" (expert) or "P" (policy) per chunk
    policy_steps: int = 0

    def drop_frames(self) -> None:
        self.images, self.wrists, self.states, self.actions, self.executed, self.objects = [], [], [], [], [], []


def attempts(cfg, tasks) -> list[Attempt]:
    out = []
    for t in tasks:
        for k in range(cfg.episodes):
            seq = np.random.SeedSequence([cfg.seed, t.index, k])  # a prefix-stable stream: old seeds unchanged
            words = seq.generate_state(5) % (2**31 - 1)
            env_seed, expert_seed, perturb_seed, noise_seed, mix_seed = (int(x) for x in words)
            out.append(Attempt(t, k, k % t.num_init_states, env_seed, expert_seed,
                                perturb_seed if cfg.init == "perturbed" else None, noise_seed, mix_seed,
                                noise=cfg.dart_noise))
    return out


def at_level(cfg, a: Attempt, level: int) -> Attempt:
    """`a`'s start begun at retry level `level`: the attempt that `level` retries of `a` would be (the same seeds and
    σ), as if the tries below it had failed."""
    for _ in range(level):
        a = retry_of(cfg, a)
    return a


def retry_of(cfg, a: Attempt) -> Attempt:
    """The next try of `a`'s start: the same env and perturbation seeds (the same start), fresh expert, noise and
    mixing seeds, and the DART σ scaled by `cfg.retry_noise_scale`."""
    retry = a.retry + 1
    seq = np.random.SeedSequence([cfg.seed, a.task.index, a.number, retry])
    expert_seed, noise_seed, mix_seed = (int(x) for x in seq.generate_state(3) % (2**31 - 1))
    return Attempt(a.task, a.number, a.init_index, a.env_seed, expert_seed, a.perturb_seed, noise_seed, mix_seed,
                   noise=a.noise * cfg.retry_noise_scale, retry=retry)


def session_name(a: Attempt) -> str:
    return f"record-task{a.task.index}-attempt{a.number}"  # one policy session per DAgger episode


class Recording:
    """One recording's attempts run over a pool of env workers, and the episodes kept, written to a LeRobot writer
    in (task, attempt) order on one thread beside the loop (the dataset does not depend on timing, and the workers
    are not left idle while a finished attempt's videos compress)."""

    def __init__(self, cfg, tmp: Path, todo: list, max_steps: int, policy, bar):
        self.cfg, self.todo, self.max_steps, self.policy, self.bar = cfg, todo, max_steps, policy, bar
        self.dagger = policy is not None
        self.per_chunk = min(cfg.actions_per_chunk or policy.action_horizon, policy.action_horizon) \
            if self.dagger else 0
        self.keep_all = cfg.keep_mode == "all"
        self.extra = self.dagger or cfg.dart_noise > 0  # the executed actions differ from the labels: both written
        vectors = {STATE_KEY: VectorFeature(8, STATE_NAMES), ACTION_KEY: VectorFeature(7, ACTION_NAMES),
                   OBJECTS_KEY: VectorFeature(6, OBJECTS_NAMES)}
        if self.extra:
            vectors[EXECUTED_KEY] = VectorFeature(7, ACTION_NAMES)
        self.options = recording_options(cfg, self.dagger)
        self.writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record-writer")
        self.writer = LeRobotV3Writer(tmp, FPS, ROBOT_TYPE,
                                      {IMAGE_KEY: (cfg.image_size,) * 2, WRIST_KEY: (cfg.image_size,) * 2},
                                      vectors, codec=cfg.codec, episodes_per_video_file=1,
                                      image_names=("height", "width", "rgb"), gop=cfg.gop)
        self.order = {id(a): i for i, a in enumerate(todo)}
        self.finished: dict[int, Attempt] = {}
        self.next_to_write = 0
        self.written: list = []
        self.kept: list[dict] = []
        self.object_xy_index: dict[int, list] = {}
        self.results: list[Attempt] = []
        self.env_steps = 0  # steps with a valid label, every attempt's
        self.queue: list[Attempt] = []
        self.running: dict[int, Attempt] = {}
        self.starting: dict[int, Attempt] = {}  # worker -> attempt whose reset is in flight
        self.free: list[int] = []
        # noise_pilot, per task: how many pilot starts have ended; the retry levels at which pilots succeeded (not
        # counting a pilot whose tries include a crashed worker or a failed reset: those say nothing about the noise,
        # and depend on timing); the level the task's other starts begin at once every pilot has ended
        self.pilot_done: dict[int, int] = {}
        self.pilot_levels: dict[int, list[int]] = {}
        self.pilot_unsure: set[tuple[int, int]] = set()
        self.first_level: dict[int, int] = {}

    # -- writing --

    def _write(self, a: Attempt) -> None:
        cfg = self.cfg
        columns = {STATE_KEY: np.stack(a.states), ACTION_KEY: np.stack(a.actions), OBJECTS_KEY: np.stack(a.objects)}
        if self.extra:
            columns[EXECUTED_KEY] = np.stack(a.executed)
        steps = len(a.actions)
        ep = self.writer.add_episode(a.task.language, {IMAGE_KEY: np.stack(a.images), WRIST_KEY: np.stack(a.wrists)},
                                     columns)
        a.drop_frames()
        info = dict(a.init_info or {})
        self.object_xy_index.setdefault(a.task.index, info.pop("object_xy_index", None))
        row = {"episode_index": ep, "task": a.task.index, "task_name": a.task.name,
               "attempt": a.number, "init_index": a.init_index, "perturbed": a.perturb_seed is not None,
               "env_seed": a.env_seed, "expert_seed": a.expert_seed, "steps": steps,
               "success": a.success,
               "init": {"mode": cfg.init, "base_index": None if cfg.init == "sampled" else a.init_index,
                        "perturb_seed": a.perturb_seed, **info},
               "init_state": [float(x) for x in a.init_state]}
        if cfg.dart_noise > 0:
            row["noise_seed"] = a.noise_seed
        if cfg.retries:
            row.update(retry=a.retry, expert_seed=a.expert_seed, dart_noise=a.noise)
        if self.dagger:
            row.update(policy_steps=a.policy_steps, chunk_actors="".join(a.actors))
        if a.note:
            row["note"] = a.note
        self.kept.append(row)

    def _flush(self) -> None:
        """Queue finished attempts for writing in (task, attempt) order: the dataset does not depend on timing."""
        while self.next_to_write in self.finished:
            a = self.finished.pop(self.next_to_write)
            self.next_to_write += 1
            if a.actions and (a.success or self.keep_all):
                self.written.append(self.writes.submit(self._write, a))
        while self.written and self.written[0].done():
            self.written.pop(0).result()  # a failed write stops the recording here

    def finish_writes(self) -> None:
        self.writes.shutdown(wait=True)
        for f in self.written:
            f.result()

    # -- the attempts --

    def _done(self, w: int, a: Attempt, note: str = "") -> None:
        a.note = note
        self.running.pop(w, None)
        if w not in self.free:
            self.free.append(w)
        if self.dagger:
            self.policy.end_session(session_name(a))
        self.results.append(a)
        if self._is_pilot(a) and note.startswith(("reset failed", "env worker crashed")):
            self.pilot_unsure.add((a.task.index, a.number))
        if not (a.success or self.keep_all):  # free the frames now; a failure is never written
            a.drop_frames()
        if not a.success and a.retry < self.cfg.retries:  # the start is tried again, first in the queue; its
            nxt = retry_of(self.cfg, a)                    # place in the dataset's order is the start's
            self.order[id(nxt)] = self.order[id(a)]
            self.queue.insert(0, nxt)
            return
        if self._is_pilot(a):
            t = a.task.index
            self.pilot_done[t] = self.pilot_done.get(t, 0) + 1
            if a.success and (t, a.number) not in self.pilot_unsure:
                self.pilot_levels.setdefault(t, []).append(a.retry)
        self.finished[self.order[id(a)]] = a
        self._flush()
        ok = sum(r.success for r in self.results)
        if self.bar.bar is not None:
            self.bar.bar.set_postfix(success=f"{ok}/{len(self.results)}", refresh=False)
        self.bar.update()

    def _started(self, w: int, r) -> bool:
        from .libero_env import WorkerCrashed

        a = self.starting.pop(w)
        if isinstance(r, WorkerCrashed) or r is None:
            self._done(w, a, f"reset failed: {getattr(r, 'reason', 'no reply')}".splitlines()[0])
            return False
        a.obs, a.init_state = r, np.asarray(r["init_state"], dtype=np.float64)
        a.init_info = r.get("init_info")
        if self.dagger:
            a.mix_rng = np.random.default_rng(a.mix_seed)
        self.running[w] = a
        return True

    def _stepped(self, w: int, r) -> bool:
        """An expert step's reply; False when the attempt ended."""
        from .libero_env import WorkerCrashed

        a = self.running[w]
        if isinstance(r, WorkerCrashed) or r is None:
            reason = getattr(r, "reason", "no reply").strip().splitlines()
            self._done(w, a, f"env worker crashed: {reason[-1] if reason else ''}")
            return False
        if not r.label_valid:  # the rows end before the first step without a valid label
            self._done(w, a, "the expert gave up (no valid label from here)")
            return False
        a.images.append(a.obs["image"])
        a.wrists.append(a.obs["wrist_image"])
        a.states.append(a.obs["state"])
        a.objects.append(np.asarray(a.obs["objects"], dtype=np.float32))
        self.env_steps += 1
        a.actions.append(np.asarray(r.label, dtype=np.float32))
        a.executed.append(np.asarray(r.executed, dtype=np.float32))
        a.obs = r.obs
        if r.success:
            a.success = True
            self._done(w, a)
            return False
        if len(a.actions) >= self.max_steps:
            self._done(w, a, f"no success within the suite's {self.max_steps} steps" if self.cfg.max_steps is None
                       else f"no success within {self.max_steps} steps (--max-steps)")
            return False
        return True

    def _step_options(self, idle: list[int]) -> dict:
        """Each idle worker's expert-step options: DART noise, and DAgger's executed policy action."""
        opts = {}
        for w in idle:
            a, o = self.running[w], {}
            if a.noise > 0:
                o.update(noise=a.noise, noise_seed=a.noise_seed)
            if self.dagger:
                o.update(recover=True, hold_orientation=True)
                if a.queue:
                    o["execute"] = a.queue.pop(0)
                    a.policy_steps += 1
                a.chunk_left -= 1
            if o:
                opts[w] = o
        return opts

    # -- noise_pilot: a task whose first starts never succeed under the full σ begins its other starts lower --

    def _is_pilot(self, a: Attempt) -> bool:
        return a.number < self.cfg.noise_pilot

    def _ready(self, a: Attempt) -> Attempt | None:
        """`a` as it is to be run now, or None while it must wait: a task's starts beyond its pilots wait until every
        pilot has ended, then begin at the lowest retry level at which a pilot succeeded (the full σ if one did
        there, or if none succeeded at any level). A pilot whose tries include a crashed worker or a failed reset
        is not counted."""
        if not self.cfg.noise_pilot or a.retry or self._is_pilot(a):
            return a
        t = a.task.index
        if t not in self.first_level:
            if self.pilot_done.get(t, 0) < min(self.cfg.noise_pilot, self.cfg.episodes):
                return None
            self.first_level[t] = min(self.pilot_levels.get(t, []), default=0)
        if not self.first_level[t]:
            return a
        b = at_level(self.cfg, a, self.first_level[t])
        self.order[id(b)] = self.order.pop(id(a))
        return b

    def _next_ready(self) -> Attempt | None:
        """The first attempt in the queue that may run now (`_ready`), taken out of the queue."""
        for i, a in enumerate(self.queue):
            b = self._ready(a)
            if b is not None:
                del self.queue[i]
                return b
        return None

    def run(self, pool) -> None:
        """Every attempt to its end; every worker runs its attempt at its own pace (one worker's reset, seconds,
        holds up no other)."""
        from .libero_env import env_action
        from .libero_workers import EpisodeInit

        cfg, queue = self.cfg, self.queue
        # in (task, attempt) order, a task's pilots (`noise_pilot`) first; a start that waits for its task's pilots
        # is passed over for the next task's, so that finished episodes held for the ordered writes stay few
        queue[:] = self.todo
        self.free = list(range(pool.num_workers))
        while queue or self.running or self.starting:
            assign = {}
            while queue and self.free and (a := self._next_ready()) is not None:
                assign[self.free.pop(0)] = a
            if assign:  # empty while the only starts left wait for their task's pilots (`noise_pilot`)
                inits = {w: EpisodeInit(env_seed=a.env_seed, perturb_seed=a.perturb_seed, max_shift_m=cfg.max_shift_m,
                                        sample=cfg.init == "sampled", min_shift_m=cfg.min_shift, describe=True)
                         for w, a in assign.items()}
                pool.submit_reset([(w, a.task, a.init_index) for w, a in assign.items()], inits)
                self.starting.update(assign)
            replies = pool.wait()
            if not replies:
                raise RuntimeError("the env worker pool has no command in flight, yet attempts are running")
            idle = [w for w, r in replies.items()
                    if (self._started(w, r) if w in self.starting else self._stepped(w, r))]
            if not idle:
                continue
            if self.dagger:
                dagger_chunks(cfg, self.policy, {w: self.running[w] for w in idle}, self.per_chunk, env_action)
            opts = self._step_options(idle)
            seeds = {w: self.running[w].expert_seed for w in idle}
            pool.submit_expert_step(seeds, opts) if opts else pool.submit_expert_step(seeds)

    def _per_task(self, tasks) -> list[dict]:
        rows = per_task(tasks, self.results, self.kept, self.object_xy_index)
        if self.cfg.noise_pilot:  # the σ each task's starts beyond its pilots began at
            for row in rows:
                level = self.first_level.get(row["task"], 0)
                row["first_noise"] = round(self.cfg.dart_noise * self.cfg.retry_noise_scale ** level, 6)
        return rows

    def summary(self, tasks, seconds: float) -> dict:
        cfg = self.cfg
        return {
            "generator": "dz data record libero",
            "expert": "dzmodel.eval.libero_scripted.ScriptedExpert",
            "suite": cfg.suite,
            "max_steps": self.max_steps,
            "config": asdict(cfg),
            "options": self.options,
            "per_task": self._per_task(tasks),
            "starts": len(self.todo),
            "attempts": len(self.results),
            "successes": sum(a.success for a in self.results),
            "kept": len(self.kept),
            "failures": [{"task": a.task.index, "attempt": a.number, "init_index": a.init_index, "note": a.note,
                          **({"retry": a.retry} if cfg.retries else {})}
                         for a in sorted(self.results, key=lambda a: (self.order[id(a)], a.retry)) if not a.success],
            "episodes": self.kept,
            "seconds": seconds,
            "env_steps": self.env_steps,
        }


def dagger_chunks(cfg, policy, running: dict, per_chunk: int, env_action) -> None:
    """At a chunk boundary, every episode there asks the policy (one batched forward, so its session sees the
    same observations as in `dz eval libero`), then draws who acts for the chunk: the expert with probability beta."""
    need = [w for w, a in running.items() if a.chunk_left <= 0]
    if not need:
        return
    chunks = None
    if cfg.dagger_beta < 1:
        requests = [(session_name(a), {"image": a.obs["image"], "wrist_image": a.obs["wrist_image"]}, a.obs["state"],
                     a.task.language) for a in (running[w] for w in need)]
        chunks = policy.predict_batch(requests)
    for i, w in enumerate(need):
        a = running[w]
        by_policy = bool(a.mix_rng.random() >= cfg.dagger_beta)
        a.chunk_left = per_chunk
        a.queue = [env_action(x) for x in chunks[i][:per_chunk]] if by_policy else []
        a.actors.append("P" if by_policy else "E")


def recording_options(cfg, dagger: bool) -> dict:
    """What the labels and starts of a recording are (meta/info.json's `dz_recording`, and the summary's)."""
    opts = {"init": cfg.init, "max_shift_m": cfg.max_shift_m if cfg.init == "perturbed" else None,
            "min_shift_m": cfg.min_shift, "dart_noise": cfg.dart_noise,
            "label": "the scripted expert's clean action at each row's state",
            "executed_key": EXECUTED_KEY if (dagger or cfg.dart_noise > 0) else None,
            "keep": cfg.keep_mode,
            "retries": cfg.retries, "retry_noise_scale": cfg.retry_noise_scale, "noise_pilot": cfg.noise_pilot,
            "objects_key": OBJECTS_KEY, "objects_layout": OBJECTS_NAMES["axes"],
            "objects_note": "privileged world xyz of the goal's object and its target (region site for In, body for "
                            "On); diagnostics only, not a model input"}
    if dagger:
        opts.update(dagger_model=str(cfg.dagger) if cfg.dagger else "(given policy)", dagger_beta=cfg.dagger_beta,
                    dagger_mixing="per chunk")
    return opts


def per_task(tasks, results: list[Attempt], kept: list[dict], object_xy_index: dict) -> list[dict]:
    rows = []
    for t in tasks:
        rs = [a for a in results if a.task.index == t.index]
        ok = [e["steps"] for e in kept if e["task"] == t.index and e["success"]]
        n_ok = sum(a.success for a in rs)
        row = {"task": t.index, "name": t.name, "language": t.language, "attempts": len(rs),
               "starts": len({a.number for a in rs}),
               "successes": n_ok, "success_rate": round(n_ok / len(rs), 4) if rs else 0.0,
               "mean_steps": round(float(np.mean(ok)), 1) if ok else None,
               "kept": sum(e["task"] == t.index for e in kept)}
        if object_xy_index.get(t.index) is not None:
            row["object_xy_index"] = object_xy_index[t.index]  # flat-state index of each movable object's x
        rows.append(row)
    return rows
