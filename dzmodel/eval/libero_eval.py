"""`dz eval libero`: LIBERO success rate of a policy, and of a training run across its checkpoint steps.

Episodes run in parallel env worker processes (vectorised stepping); the policy runs here, through the
model's own inference API with one KV-cache session per episode: at each step the observations of every
episode that needs a new chunk go through one batched forward (`predict_batch`). Per episode: the standard init state,
10 settle steps, then action chunks (`actions_per_chunk` of each, then a new query) until success or
`max_steps`. Each query after the first sends the frames observed since the previous one at the model's frame
rate (`EmbodiedPolicy.frame_stride`), so the policy predicts from the history a training window holds
(`context: episode`); `context: frame` restarts from the current frame at every query (upstream's LIBERO eval). The metric is `success_once`: an episode counts if the task succeeded at any step.

A crashed worker is restarted and its episode retried once; a second crash counts the episode as failed,
with a note, unless the env could not even start (its reset crashed on the fresh worker too): that stops the
evaluation with EnvStartError, since a scene that cannot be built (a missing asset, say) says nothing about the
policy. Nothing waits forever: every worker reply has a timeout.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_text
from ..train.metrics import Progress
from ..policy.policy import EmbodiedPolicy
from .rollout import RolloutParams


@dataclass
class EvalConfig(RolloutParams):
    """The rollouts (`RolloutParams`: the eval stage's and `dz eval libero`'s options, by the same names) plus what
    only the evaluator sets."""
    first_init_state: int = 0               # where the init states start (a set kept apart to pick checkpoints)
    binarize_gripper: bool = True           # the last action dim becomes ±1 (reference §6.1)
    worker_timeout_s: float = 300.0
    batch_policy: bool = True               # one batched policy forward for all episodes that need a chunk

    def __post_init__(self) -> None:
        from ..schema import field_problems
        from .libero_env import auto_env_workers
        from .perturb_spec import parse_perturbations

        problems = field_problems(self, "eval")
        if self.first_init_state < 0:
            problems.append(f"eval.first_init_state: must be >= 0, got {self.first_init_state}")
        if problems:
            raise ValueError("; ".join(problems))
        self.workers = auto_env_workers(self.workers)
        parse_perturbations(self.perturb, "eval.perturb")


class EnvStartError(RuntimeError):
    """An episode's env failed to start on two workers in a row: a problem of the install or the scene, not a policy
    outcome, so no success rate is reported for it."""


@dataclass
class EpisodeResult:
    task: int
    task_name: str
    episode: int
    success: bool
    steps: int
    seconds: float
    attempts: int = 1
    note: str = ""
    video: str = ""


@dataclass
class _Running:
    task: object
    episode: int
    attempt: int
    obs: dict
    started: float
    steps: int = 0
    success: bool = False
    queue: list = field(default_factory=list)
    frames: list | None = None
    init: object = None  # the EpisodeInit it started from (None: the standard init state)
    new_frames: list = field(default_factory=list)  # views at the model's frame rate since the last query
    queried: bool = False


def selected_tasks(cfg: EvalConfig, tasks: list | None = None) -> list:
    """The TaskSpecs `cfg.tasks` names (all of them when None), out of `tasks` (default: the suite's)."""
    from .libero_env import list_tasks

    tasks = list(list_tasks(cfg.suite)) if tasks is None else tasks
    if cfg.tasks is None:
        return tasks
    bad = [t for t in cfg.tasks if not 0 <= t < len(tasks)]
    if bad:
        raise ValueError(f"suite {cfg.suite!r} has tasks 0..{len(tasks) - 1}; got {bad}")
    return [tasks[t] for t in cfg.tasks]


def evaluate_policy(policy: EmbodiedPolicy, cfg: EvalConfig, out_dir: str | Path | None = None,
                    progress: bool = True, tag: str = "", tasks: list | None = None,
                    pool_factory=None, episodes: list | None = None, timing: dict | None = None,
                    perturbation=None) -> list[EpisodeResult]:
    """Run the configured episodes; videos go to `out_dir/videos/` when out_dir is given.
    `tasks` and `pool_factory(num_workers)` default to the suite's LIBERO tasks and env worker processes.
    `episodes` [(TaskSpec, episode id, EpisodeInit)] replaces the grid of tasks x standard init states
    (the oracle replays recorded episodes from their recorded init states this way).
    `timing`, if given, receives the seconds spent in the policy and in env steps, the chunks and the forwards.
    `perturbation` (a `libero_perturb.Perturbation`) perturbs every episode of the grid, seeded per (cfg.seed,
    suite, task, init state)."""
    from .libero_env import get_suite

    tasks = selected_tasks(cfg, tasks)
    max_steps = cfg.max_steps or get_suite(cfg.suite).max_steps
    per_chunk = min(cfg.actions_per_chunk or policy.action_horizon, policy.action_horizon)
    stride = getattr(policy, "frame_stride", None) if cfg.context == "episode" else None
    if stride is not None and per_chunk % stride:
        raise ValueError(f"eval.actions_per_chunk ({per_chunk}) must be a multiple of {stride}: the model saw a frame "
                         f"every {stride} steps, and each query must end on one")
    if episodes is None:
        first = cfg.first_init_state
        todo = [(t, e, 1, None) for t in tasks for e in range(first, first + cfg.episodes)]
        for t, e, _, _ in todo:
            if e >= t.num_init_states:
                raise ValueError(f"task {t.index} of {cfg.suite!r} has {t.num_init_states} init states; "
                                 f"asked for {e + 1}")
        if perturbation is not None:
            todo = [_perturbed(t, e, cfg, perturbation) for t, e, _, _ in todo]
    else:
        todo = [(t, e, 1, init) for t, e, init in episodes]
    bar = Progress(len(todo), enabled=progress, desc=f"LIBERO {tag}".strip(), unit="episode")
    if pool_factory is None:
        def pool_factory(n):
            return _env_pool(cfg, n)
    clock = timing if timing is not None else {}
    for key in ("policy_s", "env_s", "chunks", "forwards"):
        clock.setdefault(key, 0)
    run = _Evaluation(policy, cfg, todo, max_steps, per_chunk, stride, out_dir, tag, bar, clock)
    with pool_factory(min(cfg.workers, len(todo))) as pool:
        run.run(pool)
    bar.close()
    return sorted(run.results, key=lambda r: (r.task, r.episode))


def _perturbed(task, episode: int, cfg: EvalConfig, perturbation) -> tuple:
    """A todo entry of a perturbed episode: the task with the instruction the policy reads, and the EpisodeInit that
    carries a scene perturbation to the env worker."""
    import dataclasses

    from .libero_perturb import episode_language
    from .libero_workers import EpisodeInit

    key = (cfg.seed, task.suite, task.index, episode)
    language = episode_language(task.language, perturbation, key)
    if language != task.language:
        task = dataclasses.replace(task, language=language)
    init = EpisodeInit(scene=(perturbation,), scene_key=key) if perturbation.scene else None
    return task, episode, 1, init


def _env_pool(cfg: EvalConfig, num_workers: int):
    from .libero_workers import EnvWorkerPool

    return EnvWorkerPool(num_workers, camera_size=cfg.camera_size, timeout_s=cfg.worker_timeout_s, seed=cfg.seed)


class _OnePool:
    """One env worker pool for all the checkpoints of an evaluation (`pool_factory` of each): its workers start
    and build their tasks' envs once, where a pool per checkpoint would again spend ~8 s per worker on 2 CPU
    cores. Episodes still start from their own seeded reset and init state."""

    def __init__(self, cfg: EvalConfig):
        self.cfg, self.pool = cfg, None

    def __call__(self, num_workers: int):
        if self.pool is None:
            self.pool = _env_pool(self.cfg, num_workers)
        elif self.pool.num_workers != num_workers:
            raise ValueError(f"the shared env pool has {self.pool.num_workers} workers; asked for {num_workers}")
        return contextlib.nullcontext(self.pool)

    @property
    def workers_started(self) -> int:
        return self.pool.workers_started if self.pool is not None else 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.close()


class _Evaluation:
    """The episodes of one evaluation over a pool of env workers. Each worker runs its episode at its own pace: a
    reset (seconds: LIBERO reloads the model) or a slow step holds up no other worker, and the episodes that need a
    chunk when the policy is free share its forward."""

    def __init__(self, policy, cfg, todo: list, max_steps: int, per_chunk: int, stride: int | None, out_dir,
                 tag: str, bar, clock: dict):
        self.policy, self.cfg, self.todo, self.max_steps = policy, cfg, todo, max_steps
        self.per_chunk, self.stride, self.out_dir, self.tag, self.bar, self.clock = \
            per_chunk, stride, out_dir, tag, bar, clock
        self.results: list[EpisodeResult] = []
        self.videos_left = cfg.videos
        self.running: dict[int, _Running] = {}
        self.starting: dict[int, tuple] = {}  # worker -> (task, episode, attempt, init) whose reset is in flight
        self.free: list[int] = []

    def _start(self, pool) -> None:
        assign = {}
        while self.todo and self.free:
            assign[self.free.pop(0)] = self.todo.pop(0)
        if not assign:
            return
        inits = {w: init for w, (_, _, _, init) in assign.items() if init is not None}
        resets = [(w, t, e) for w, (t, e, _, _) in assign.items()]
        pool.submit_reset(resets, inits) if inits else pool.submit_reset(resets)
        self.starting.update(assign)

    def _started(self, w: int, r) -> bool:
        from .libero_env import WorkerCrashed

        t, e, attempt, init = self.starting.pop(w)
        if isinstance(r, WorkerCrashed) or r is None:
            self._finish_crash(w, t, e, attempt, f"reset: {getattr(r, 'reason', 'no reply')}", init)
            return False
        record = self.videos_left > 0
        self.videos_left -= int(record)
        self.running[w] = _Running(t, e, attempt, r, time.perf_counter(), frames=[r["image"]] if record else None,
                                   init=init)
        return True

    def _finish(self, w: int, run: _Running, note: str = "") -> None:
        video = ""
        if run.frames is not None and self.out_dir is not None:
            name = f"{self.tag or 'eval'}_task{run.task.index:02d}_ep{run.episode:02d}.mp4"
            video = _write_video(Path(self.out_dir) / "videos" / name, run.frames)
        self.results.append(EpisodeResult(run.task.index, run.task.name, run.episode, run.success, run.steps,
                                          round(time.perf_counter() - run.started, 2), run.attempt, note, video))
        self.policy.end_session(_session(run))
        self.running.pop(w, None)
        self.free.append(w)
        self.bar.update()

    def _finish_crash(self, w: int, t, e: int, attempt: int, reason: str, init=None) -> None:
        if w in self.running:
            self.policy.end_session(_session(self.running.pop(w)))
        if w not in self.free:
            self.free.append(w)
        if attempt == 1:
            self.todo.append((t, e, 2, init))  # retried once on a fresh worker
        elif reason.startswith("reset:"):
            raise EnvStartError(f"LIBERO-{self.cfg.suite} task {t.index} ({t.name}), init state {e}: the env could not "
                                f"start on two workers ({reason}); nothing is counted for this evaluation")
        else:
            self.results.append(EpisodeResult(t.index, t.name, e, False, 0, 0.0, attempt,
                                              f"failed: env worker crashed twice ({reason})"))
            self.bar.update()

    def _stepped(self, w: int, r) -> bool:
        """An env step's reply; False when the episode ended."""
        from .libero_env import WorkerCrashed

        run = self.running[w]
        if isinstance(r, WorkerCrashed) or r is None:
            self._finish_crash(w, run.task, run.episode, run.attempt, getattr(r, "reason", "no reply"), run.init)
            return False
        obs, success = r
        run.obs, run.steps = obs, run.steps + 1
        if self.stride is not None and run.steps % self.stride == 0:
            run.new_frames.append(_views(obs))
        run.success = run.success or bool(success)
        if run.frames is not None:
            run.frames.append(obs["image"])
        if run.success or run.steps >= self.max_steps:
            self._finish(w, run, "retried after a worker crash" if run.attempt > 1 else "")
            return False
        return True

    def _query(self, need: list[int]) -> None:
        """New chunks for the episodes `need`: one batched forward (or one call each, for comparison)."""
        requests = [_request(self.running[w], self.stride) for w in need]
        t0 = time.perf_counter()
        if self.cfg.batch_policy:  # every episode that needs a chunk now, in one policy forward
            chunks = self.policy.predict_batch(requests)
        else:
            chunks = [self.policy.predict(*r) for r in requests]
        self.clock["policy_s"] += time.perf_counter() - t0
        self.clock["chunks"] += len(requests)
        self.clock["forwards"] += 1 if self.cfg.batch_policy else len(requests)
        for w, chunk in zip(need, chunks):
            self.running[w].queue = list(chunk[:self.per_chunk])

    def run(self, pool) -> None:
        from .libero_env import env_action

        self.free = list(range(pool.num_workers))
        running = self.running
        ready: set[int] = set()  # running episodes with no env command in flight
        while self.todo or running or self.starting:
            self._start(pool)
            t0 = time.perf_counter()
            replies = pool.wait()
            self.clock["env_s"] += time.perf_counter() - t0
            if not replies:
                raise RuntimeError("the env worker pool has no command in flight, yet episodes are running")
            ready |= {w for w, r in replies.items()
                      if (self._started(w, r) if w in self.starting else self._stepped(w, r))}
            ready &= set(running)
            # episodes with actions left step first, so that their envs run while the policy computes
            ready -= self._step(pool, env_action, ready)
            need = [w for w in sorted(ready) if not running[w].queue]
            # an episode whose step is in flight with its chunk used up needs one at its reply (one env step
            # away): wait for it, so that both share the forward (fewer, larger forwards take less policy time)
            due = [w for w in running if w not in ready and not running[w].queue]
            if need and not due:
                self._query(need)
                ready -= self._step(pool, env_action, ready)

    def _step(self, pool, env_action, ready: set[int]) -> set[int]:
        """Submit the next action of every ready episode that has one; returns those episodes."""
        go = [w for w in sorted(ready) if self.running[w].queue]
        if go:
            pool.submit_step({w: env_action(self.running[w].queue.pop(0), self.cfg.binarize_gripper) for w in go})
        return set(go)


SESSION_FORMAT = "task{task}-ep{episode}-try{attempt}"  # one KV-cache session per episode attempt


def _session(run: _Running) -> str:
    return SESSION_FORMAT.format(task=run.task.index, episode=run.episode, attempt=run.attempt)


def _views(obs: dict) -> dict:
    return {"image": obs["image"], "wrist_image": obs["wrist_image"]}


def _request(run: _Running, stride: int | None) -> tuple:
    """A policy query: (session, views, state, instruction[, reset]). With a frame stride the episode is one
    session: the first query starts it from the current frame, later ones send the frames since the last query
    (every `stride` steps, the current one last)."""
    base = (_session(run), _views(run.obs), run.obs["state"], run.task.language)
    if stride is None:
        return base
    if not run.queried:
        run.queried = True
        run.new_frames = []
        return base + (True,)
    views = {k: np.stack([f[k] for f in run.new_frames]) for k in ("image", "wrist_image")}
    run.new_frames = []
    return (base[0], views, *base[2:], False)


def _write_video(path: Path, frames: list) -> str:
    from ..data.video import encode_video

    path.parent.mkdir(parents=True, exist_ok=True)
    encode_video(path, np.stack(frames), fps=20, codec="libx264", crf=23, gop=30)
    return str(path)


# --- tables and across checkpoint steps ------------------------------------------------------------


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of a success rate (sound at 0 and 1 successes, unlike the normal one)."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def _row(step, task, name: str, episodes: int, successes: int) -> dict:
    low, high = wilson_interval(successes, episodes)
    return {"step": step, "task": task, "task_name": name, "episodes": episodes, "successes": successes,
            "rate": round(successes / episodes, 4) if episodes else 0.0, "ci_low": round(low, 4),
            "ci_high": round(high, 4)}


def summarize(results: list[EpisodeResult], step: int | None = None) -> list[dict]:
    """Rows step, task, episodes, successes, rate and its 95 % Wilson interval: one per task, then `all`."""
    rows = []
    for task in sorted({r.task for r in results}):
        rs = [r for r in results if r.task == task]
        rows.append(_row(step, task, rs[0].task_name, len(rs), sum(r.success for r in rs)))
    rows.append(_row(step, "all", "", len(results), sum(r.success for r in results)))
    return rows


def pooled(rows: list[dict], steps: list) -> dict:
    """The `all` rows of `steps` pooled into one (e.g. the last 3 checkpoints: a rate no checkpoint was picked for)."""
    chosen = [r for r in rows if r["task"] == "all" and r["step"] in steps]
    return _row(",".join(str(s) for s in steps), "all", "", sum(int(r["episodes"]) for r in chosen),
                sum(int(r["successes"]) for r in chosen))


PER_EPISODE_COLUMNS = ("seed", "task", "init_state", "checkpoint_step", "success")  # seed: the run's train.seed


ROBUSTNESS_COLUMNS = ("step", "perturbation", "task", "task_name", "episodes", "successes", "rate", "ci_low", "ci_high")


def robustness_rows(results: list[EpisodeResult], step, perturbation: str) -> list[dict]:
    """`summarize`'s rows (per task, then `all`) of one perturbation's episodes, each naming the perturbation."""
    return [{"step": r["step"], "perturbation": perturbation, **{k: v for k, v in r.items() if k != "step"}}
            for r in summarize(results, step)]


def write_results(out_dir: str | Path, rows: list[dict], episodes: list[dict],
                  robustness: list[dict] | None = None) -> None:
    """results.csv, episodes.csv, per_episode.csv and summary.json; with `robustness` rows (`robustness_rows`:
    the unperturbed `none` and each perturbation) also robustness.csv, a `robustness` list of the `all` rows in
    summary.json, and episodes whose dicts carry `perturbation` add that column to per_episode.csv."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("results.csv", rows), ("episodes.csv", episodes)):
        if data:
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=list(data[0]))
            w.writeheader()
            w.writerows(data)
            atomic_write_text(out / name, buf.getvalue())
    if episodes and "train_seed" in episodes[0]:  # the raw per-episode table, one row per episode
        perturbed = "perturbation" in episodes[0]
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(PER_EPISODE_COLUMNS + (("perturbation",) if perturbed else ()))
        w.writerows([e["train_seed"], e["task"], e["episode"], e["step"], int(e["success"])]
                    + ([e["perturbation"]] if perturbed else []) for e in episodes)
        atomic_write_text(out / "per_episode.csv", buf.getvalue())
    overall = [r for r in rows if r["task"] == "all"]
    summary = {"per_step": overall, "best": max(overall, key=lambda r: r["rate"]) if overall else None}
    if robustness:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(ROBUSTNESS_COLUMNS), lineterminator="\n")
        w.writeheader()
        w.writerows(robustness)
        atomic_write_text(out / "robustness.csv", buf.getvalue())
        summary["robustness"] = [r for r in robustness if r["task"] == "all"]
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))


FEWER_EPISODES_LABEL = "hollow: fewer episodes than the last point (the curve only)"


def fewer_episodes(overall: list[dict]) -> list[dict]:
    """The `all` rows evaluated on fewer episodes than the most any step had (a success curve's earlier
    checkpoints, evaluated on fewer init states than the reported one)."""
    most = max((int(r["episodes"]) for r in overall), default=0)
    return [r for r in overall if int(r["episodes"]) < most]


def plot_success(rows: list[dict], path: str | Path, title: str) -> Path | None:
    """Success rate vs checkpoint step (overall and per task), PNG; overall points with fewer episodes than the
    most any step had are drawn hollow. None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = sorted({r["step"] for r in rows})
    for task in sorted({r["task"] for r in rows if r["task"] != "all"}):
        pts = [(r["step"], r["rate"]) for r in rows if r["task"] == task]
        ax.plot(*zip(*sorted(pts)), marker=".", alpha=0.4, linewidth=1, label=f"task {task}")
    overall = sorted((r for r in rows if r["task"] == "all"), key=lambda r: r["step"])
    rates = [r["rate"] for r in overall]
    bounds = [wilson_interval(int(r["successes"]), int(r["episodes"])) for r in overall]
    # clamped at 0: at a rate of 0 or 1 the interval's end can differ from the rate by a rounding error
    ax.errorbar([r["step"] for r in overall], rates, yerr=[[max(0.0, p - lo) for p, (lo, _) in zip(rates, bounds)],
                                                           [max(0.0, hi - p) for p, (_, hi) in zip(rates, bounds)]],
                marker="o", color="black", linewidth=2.5, capsize=4, label="all tasks (95 % Wilson interval)")
    fewer = fewer_episodes(overall)
    if fewer:
        ax.plot([r["step"] for r in fewer], [r["rate"] for r in fewer], linestyle="none", marker="o", markersize=8,
                markerfacecolor="white", markeredgecolor="black", zorder=3, label=FEWER_EPISODES_LABEL)
    for r in overall:  # N beside each point: a rate from 1 episode and one from 500 do not look alike
        ax.annotate(f"n={r['episodes']}", (r["step"], r["rate"]), textcoords="offset points", xytext=(5, 5),
                    fontsize=7)
    ax.set_xlabel("training step")
    ax.set_ylabel("success rate (success_once)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(steps)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    from ..atomic import save_figure

    save_figure(fig, Path(path), dpi=120)
    plt.close(fig)
    return Path(path)


def evaluate_run(run_or_model: str | Path, cfg: EvalConfig, out_dir: str | Path, steps: list[int] | None = None,
                 device: str = "cpu", solver=None, progress: bool = True, embodiment: str | None = None,
                 compile: bool = False, weights: str = "raw") -> list[dict]:
    """Evaluate every saved step of a training run (or `steps`), converting each checkpoint as needed (with its
    `weights`: raw or ema), or one converted model directory. `embodiment`, if given, must be the one the
    checkpoint trained on.
    Writes results.csv, episodes.csv, per_episode.csv (seed,task,init_state,checkpoint_step,success), summary.json,
    success_vs_step.png, timing.json (wall, policy and env seconds per step; env workers started: one pool serves
    every step) and videos/ under out_dir. With `cfg.perturb`, each step also runs the same episodes under each
    perturbation: robustness.csv (step, perturbation, task, ..., rate, 95 % interval; `none` is the unperturbed
    run), `robustness` in summary.json, a `perturbation` column in per_episode.csv and episodes.csv; results.csv,
    the plot and the returned rows stay the unperturbed ones."""
    from .libero_env import check_libero, ensure_libero_config
    from ..policy.policy import PolicyLoadError, load_policy, read_train_config

    ensure_libero_config()
    root = check_libero()
    from .perturb_spec import parse_perturbations

    perturbations = parse_perturbations(cfg.perturb, "eval.perturb")
    for p in perturbations:
        if p.name == "distractor":  # every model it adds must be installed: a missing one would crash each env
            from .libero_perturb import check_distractor_assets

            check_distractor_assets(root / "assets", selected_tasks(cfg), int(p.value), cfg.seed)
    src, out = Path(run_or_model), Path(out_dir)
    models = _models_to_evaluate(src, out, steps, weights)
    rows, episodes, timings, robustness = [], [], [], []
    with _OnePool(cfg) as pools:
        for step, model_dir in models:
            policy = load_policy(model_dir, device=device, embodiment=embodiment, solver=solver, seed=cfg.seed)
            policy.policy.set_compile(compile)
            if "image" not in policy.embodiment.views or "wrist_image" not in policy.embodiment.views:
                raise PolicyLoadError(f"{model_dir}: embodiment {policy.embodiment.tag!r} has views "
                                      f"{sorted(policy.embodiment.views)}; LIBERO gives 'image' and 'wrist_image'")
            started, timing, before = time.perf_counter(), {}, pools.workers_started
            results = evaluate_policy(policy, cfg, out, progress=progress, tag=f"step{step}", timing=timing,
                                      pool_factory=pools)
            wall = time.perf_counter() - started
            graphs = policy.policy.graphs  # a capture costs a few forwards: many per step means the shapes thrash
            timing.update(graph_captures=graphs.captures, graph_replays=graphs.replays,
                          env_workers_started=pools.workers_started - before)
            timings.append({"step": step, "wall_s": round(wall, 1),
                            "episodes_per_min": round(len(results) * 60 / wall, 2), "batch_policy": cfg.batch_policy,
                            **{k: round(v, 2) if isinstance(v, float) else v for k, v in timing.items()}})
            rows += summarize(results, step)
            seed = read_train_config(model_dir)[0].seed
            episodes += [{"step": step, "train_seed": seed, **asdict(r),
                          **({"perturbation": "none"} if perturbations else {})} for r in results]
            if perturbations:
                robustness += robustness_rows(results, step, "none")
            write_results(out, rows, episodes, robustness)  # after every run: a long evaluation keeps what it has
            for p in perturbations:  # the same episodes again, under each perturbation
                perturbed = evaluate_policy(policy, cfg, out, progress=progress, tag=f"step{step}_{p.slug}",
                                            pool_factory=pools, perturbation=p)
                robustness += robustness_rows(perturbed, step, p.label)
                episodes += [{"step": step, "train_seed": seed, **asdict(r), "perturbation": p.label}
                             for r in perturbed]
                write_results(out, rows, episodes, robustness)
            atomic_write_text(out / "timing.json", json.dumps(timings, indent=1))
    plot_success(rows, out / "success_vs_step.png", f"LIBERO-{cfg.suite}: success vs training step")
    return rows


def _models_to_evaluate(src: Path, out: Path, steps: list[int] | None,
                        weights: str = "raw") -> list[tuple[int | None, Path]]:
    from ..train.checkpoint import list_checkpoints
    from ..train.convert import convert_checkpoint
    from ..policy.policy import PolicyLoadError, read_train_config

    saved = list_checkpoints(src)
    if weights != "raw" and not saved:
        raise PolicyLoadError(f"{src}: --weights {weights} picks weights while converting a run's checkpoints; this "
                              f"is already converted (convert it with `dz convert --weights {weights}`)")
    if (src / "config.json").is_file():  # already converted
        return [(read_train_config(src)[1], src)]
    converted = sorted(p for p in src.glob("step_*") if (p / "config.json").is_file())
    if converted and not saved:  # a `dz stage convert` directory: one converted model per step
        models = [(read_train_config(p)[1], p) for p in converted]
        if steps:
            missing = [s for s in steps if s not in {m for m, _ in models}]
            if missing:
                raise PolicyLoadError(f"{src}: no converted model for step(s) {missing}")
            models = [(s, p) for s, p in models if s in steps]
        return models
    if not saved:
        raise PolicyLoadError(f"{src}: neither a converted model (config.json) nor a run with complete checkpoints")
    if steps:
        have = {s for s, _ in saved}
        missing = [s for s in steps if s not in have]
        if missing:
            raise PolicyLoadError(f"{src}: no complete checkpoint for step(s) {missing} (saved: {sorted(have)})")
        saved = [(s, p) for s, p in saved if s in steps]
    models = []
    for step, ckpt in saved:
        dest = out / ("converted" if weights == "raw" else f"converted_{weights}") / f"step_{step:07d}"
        if not (dest / "config.json").is_file():
            try:
                convert_checkpoint(ckpt, dest, weights=weights)
            except Exception as exc:  # one clear message naming the checkpoint
                raise PolicyLoadError(f"{ckpt}: cannot convert this checkpoint: {exc}") from exc
        models.append((step, dest))
    return models
