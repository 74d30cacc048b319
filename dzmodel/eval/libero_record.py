"""`dz data record libero`: LIBERO demonstrations from the scripted expert, as a LeRobot v3.0 dataset.

Episodes run in the evaluation's own env worker processes (`EnvWorkerPool`: the same env, cameras, init state
and settle steps as `dz eval libero`), with the expert (`libero_expert.ScriptedExpert`) acting beside each env on
privileged simulator state through the standard 7-dim OSC action. LIBERO's own goal predicate (`done`) decides
success; an episode that does not succeed within the suite's standard step limit is a failure. Only successful
episodes are kept.

The dataset matches the public LIBERO LeRobot datasets (HuggingFaceVLA/libero, converted from the OpenVLA/openpi
regenerated data) so that the `libero_sim` and `libero_sim_tiny` embodiments read it unchanged:
`observation.images.image` and `observation.images.wrist_image` (both cameras rotated by 180 degrees, as
`libero_env.to_policy_obs` gives them to the policy), `observation.state` (8: eef position, eef axis-angle,
gripper qpos), `action` (7: delta eef position and rotation, gripper -1 open / +1 close), the task's language
instruction as the task, robot_type "panda", fps 10, one row per environment step: the observation before the
step and the action taken from it.

`meta/dz_recording.json` holds what a replay needs and what the expert achieved: the suite, per task the
attempts, successes and mean length, and per kept episode its task, init-state index, the exact MuJoCo state it
started from (a seeded perturbation of the standard one, or the standard one itself) and its env seed.

Deterministic per seed: episodes are written in (task, attempt) order whatever the worker that ran them. Atomic:
everything is written into a temporary sibling and renamed into place; an interrupted recording leaves nothing
(a run killed outright leaves a `.NAME.rec-PID-*` folder that the next run removes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..atomic import replace_dir
from ..data.errors import DataError
from ..data.lerobot_writer import LeRobotV3Writer, VectorFeature
from ..progress import Progress

RECORDING_FILE = "meta/dz_recording.json"
FPS = 10                 # the public LIBERO LeRobot datasets' fps (one row per 20 Hz control step, as theirs)
ROBOT_TYPE = "panda"
IMAGE_KEY, WRIST_KEY = "observation.images.image", "observation.images.wrist_image"
STATE_KEY, ACTION_KEY = "observation.state", "action"
STATE_NAMES = {"motors": ["x", "y", "z", "roll", "pitch", "yaw", "gripper", "gripper"]}
ACTION_NAMES = {"motors": ["x", "y", "z", "roll", "pitch", "yaw", "gripper"]}
INIT_MODES = ("standard", "perturbed")
SUPPORTED_PREDICATES = ("in", "on")  # the pick-and-place goals the scripted expert solves


@dataclass
class RecordConfig:
    suite: str = "object"
    tasks: list[int] | None = None     # task indices; None = every task of the suite
    episodes: int = 10                 # attempts per task (only successes are kept)
    init: str = "standard"             # standard: init states 0..N-1 (cycled past 50); perturbed: seeded shifts of them
    max_shift_m: float = 0.02          # perturbed: objects' x/y moved by up to this much
    image_size: int = 256
    seed: int = 0
    workers: int = 2
    codec: str = "libsvtav1"
    gop: int = 2                       # keyframe interval: 2 as lerobot's writer; longer = smaller files
    worker_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        from .libero_env import get_suite

        try:
            get_suite(self.suite)
        except ValueError as exc:
            raise DataError(f"--suite: {exc}") from None
        if self.init not in INIT_MODES:
            raise DataError(f"--init: must be one of {', '.join(INIT_MODES)}, got {self.init!r}")
        for name in ("episodes", "workers"):
            if getattr(self, name) < 1:
                raise DataError(f"--{name}: must be >= 1, got {getattr(self, name)}")
        if self.image_size < 32 or self.image_size % 2:
            raise DataError(f"--image-size: must be an even number >= 32, got {self.image_size}")
        if self.gop < 1:
            raise DataError(f"--gop: must be >= 1, got {self.gop}")
        if not 0 <= self.max_shift_m <= 0.1:
            raise DataError(f"--max-shift: must be in [0, 0.1] m, got {self.max_shift_m}")


@dataclass
class _Attempt:
    task: object                       # TaskSpec
    number: int                        # attempt index within the task
    init_index: int
    env_seed: int
    expert_seed: int
    perturb_seed: int | None
    images: list = field(default_factory=list)
    wrists: list = field(default_factory=list)
    states: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    init_state: np.ndarray | None = None
    obs: dict | None = None
    success: bool = False
    note: str = ""


def _attempts(cfg: RecordConfig, tasks) -> list[_Attempt]:
    out = []
    for t in tasks:
        for k in range(cfg.episodes):
            seq = np.random.SeedSequence([cfg.seed, t.index, k])
            env_seed, expert_seed, perturb_seed = (int(x) for x in seq.generate_state(3) % (2**31 - 1))
            out.append(_Attempt(t, k, k % t.num_init_states, env_seed, expert_seed,
                                perturb_seed if cfg.init == "perturbed" else None))
    return out


def _select_tasks(cfg: RecordConfig):
    from .libero_env import list_tasks

    tasks = list_tasks(cfg.suite)
    if cfg.tasks is None:
        return tasks
    bad = [t for t in cfg.tasks if not 0 <= t < len(tasks)]
    if bad:
        raise DataError(f"--tasks: suite {cfg.suite!r} has tasks 0..{len(tasks) - 1}; got {bad}")
    if len(set(cfg.tasks)) != len(cfg.tasks):
        raise DataError(f"--tasks: a task is listed twice: {cfg.tasks}")
    return [tasks[t] for t in cfg.tasks]


def goal_predicates(bddl_file: str | Path) -> list[tuple[str, ...]]:
    """The goal of a LIBERO task as (predicate, *arguments) tuples, lower-cased, read from its BDDL file
    (`(:goal (And (In alphabet_soup_1 basket_1_contain_region)))` -> [("in", "alphabet_soup_1", ...)])."""
    text = Path(bddl_file).read_text()
    start = text.find("(:goal")
    if start < 0:
        raise DataError(f"{bddl_file}: no (:goal ...) block")
    depth, end = 0, start
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
    atoms = re.findall(r"\(([^()]+)\)", text[start:end + 1])
    return [tuple(a.lower().split()) for a in atoms]


def _unsupported(bddl_file: str) -> str | None:
    """Why the expert cannot solve a task (None if it can): one pick-and-place goal, In(obj, region) or On(obj, target)."""
    goal = goal_predicates(bddl_file)
    if len(goal) != 1 or goal[0][0] not in SUPPORTED_PREDICATES or len(goal[0]) != 3:
        return (f"goal {' and '.join('(' + ' '.join(g) + ')' for g in goal)} is not a single pick-and-place "
                f"predicate ({' or '.join(SUPPORTED_PREDICATES)})")
    return None


def _check_supported(cfg: RecordConfig, tasks) -> None:
    """Refuse, before any env starts, tasks whose goal the expert cannot solve (one message for all)."""
    problems = [f"task {t.index} ({t.language!r}): {why}" for t in tasks if (why := _unsupported(t.bddl_file))]
    if problems:
        raise DataError(f"--tasks: the scripted expert cannot solve {len(problems)} of the requested tasks of "
                        f"{cfg.suite!r}: " + "; ".join(problems))


def _clear_stale(out: Path) -> None:
    """Remove temporaries of earlier recordings into `out` whose process is gone."""
    for tmp in out.parent.glob(f".{out.name}.rec-*"):
        try:
            pid = int(tmp.name.split(".rec-")[1].split("-")[0])
            os.kill(pid, 0)
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            continue


def record_libero(cfg: RecordConfig, out: str | Path, overwrite: bool = False, progress: bool = True,
                  log=print, pool_factory=None) -> dict:
    """Record `cfg.episodes` expert attempts per task into a LeRobot v3.0 dataset at `out` (module docstring).
    Returns the recording summary (also in meta/dz_recording.json). DataError for bad arguments or when no
    attempt succeeded (nothing is written then)."""
    from .libero_env import EnvWorkerPool, EpisodeInit, WorkerCrashed, check_libero, ensure_libero_config, get_suite

    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise DataError(f"--out: {out} already exists (pass --overwrite to replace it)")
    ensure_libero_config()
    check_libero()
    tasks = _select_tasks(cfg)
    _check_supported(cfg, tasks)
    max_steps = get_suite(cfg.suite).max_steps
    todo = _attempts(cfg, tasks)
    total = len(todo)
    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.rec-{os.getpid()}-", dir=out.parent))
    os.chmod(tmp, 0o755)
    started = time.perf_counter()
    bar = Progress(total, enabled=progress, desc=f"record LIBERO-{cfg.suite}", unit="episode")
    try:
        writer = LeRobotV3Writer(tmp, FPS, ROBOT_TYPE, {IMAGE_KEY: (cfg.image_size,) * 2, WRIST_KEY: (cfg.image_size,) * 2},
                                 {STATE_KEY: VectorFeature(8, STATE_NAMES), ACTION_KEY: VectorFeature(7, ACTION_NAMES)},
                                 codec=cfg.codec, episodes_per_video_file=1, image_names=("height", "width", "rgb"),
                                 gop=cfg.gop)
        finished: dict[int, _Attempt] = {}
        kept: list[dict] = []
        next_to_write = 0

        def flush():
            """Write finished attempts in (task, attempt) order: the dataset does not depend on timing."""
            nonlocal next_to_write
            while next_to_write in finished:
                a = finished.pop(next_to_write)
                next_to_write += 1
                if not a.success:
                    continue
                ep = writer.add_episode(a.task.language, {IMAGE_KEY: np.stack(a.images), WRIST_KEY: np.stack(a.wrists)},
                                        {STATE_KEY: np.stack(a.states), ACTION_KEY: np.stack(a.actions)})
                kept.append({"episode_index": ep, "task": a.task.index, "task_name": a.task.name,
                             "attempt": a.number, "init_index": a.init_index, "perturbed": a.perturb_seed is not None,
                             "env_seed": a.env_seed, "expert_seed": a.expert_seed, "steps": len(a.actions),
                             "init_state": [float(x) for x in a.init_state]})

        results: list[_Attempt] = []
        pool_factory = pool_factory or (lambda n: EnvWorkerPool(n, camera_size=cfg.image_size,
                                                                timeout_s=cfg.worker_timeout_s, seed=cfg.seed))
        order = {id(a): i for i, a in enumerate(todo)}
        queue = list(todo)
        with pool_factory(min(cfg.workers, total)) as pool:
            running: dict[int, _Attempt] = {}
            free = list(range(pool.num_workers))

            def done(w, a: _Attempt, note=""):
                a.note = note
                running.pop(w, None)
                free.append(w)
                results.append(a)
                finished[order[id(a)]] = a
                if not a.success:  # free the frames now; a failure is never written
                    a.images, a.wrists, a.states, a.actions = [], [], [], []
                flush()
                ok = sum(r.success for r in results)
                if bar.bar is not None:
                    bar.bar.set_postfix(success=f"{ok}/{len(results)}", refresh=False)
                bar.update()

            while queue or running:
                if queue and free:
                    assign = {}
                    while queue and free:
                        assign[free.pop(0)] = queue.pop(0)
                    inits = {w: EpisodeInit(env_seed=a.env_seed, perturb_seed=a.perturb_seed,
                                            max_shift_m=cfg.max_shift_m) for w, a in assign.items()}
                    replies = pool.reset([(w, a.task, a.init_index) for w, a in assign.items()], inits)
                    for w, a in assign.items():
                        r = replies.get(w)
                        if isinstance(r, WorkerCrashed) or r is None:
                            free.append(w)
                            done(w, a, f"reset failed: {getattr(r, 'reason', 'no reply')}".splitlines()[0])
                            continue
                        a.obs, a.init_state = r, np.asarray(r["init_state"], dtype=np.float64)
                        running[w] = a
                    continue
                replies = pool.expert_step({w: a.expert_seed for w, a in running.items()})
                for w, a in list(running.items()):
                    r = replies.get(w)
                    if isinstance(r, WorkerCrashed) or r is None:
                        reason = getattr(r, "reason", "no reply").strip().splitlines()
                        done(w, a, f"env worker crashed: {reason[-1] if reason else ''}")
                        continue
                    obs, success, action = r
                    a.images.append(a.obs["image"])
                    a.wrists.append(a.obs["wrist_image"])
                    a.states.append(a.obs["state"])
                    a.actions.append(np.asarray(action, dtype=np.float32))
                    a.obs = obs
                    if success:
                        a.success = True
                        done(w, a)
                    elif len(a.actions) >= max_steps:
                        done(w, a, f"no success within the suite's {max_steps} steps")
        bar.close()
        per_task = _per_task(tasks, results)
        summary = {
            "generator": "dz data record libero",
            "expert": "dzmodel.eval.libero_expert.ScriptedExpert",
            "suite": cfg.suite,
            "max_steps": max_steps,
            "config": asdict(cfg),
            "per_task": per_task,
            "attempts": total,
            "successes": len(kept),
            "failures": [{"task": a.task.index, "attempt": a.number, "init_index": a.init_index, "note": a.note}
                         for a in sorted(results, key=lambda a: order[id(a)]) if not a.success],
            "episodes": kept,
            "seconds": round(time.perf_counter() - started, 1),
        }
        if not kept:
            raise DataError(f"no attempt succeeded ({total} tried on {cfg.suite!r} tasks "
                            f"{[t.index for t in tasks]}); nothing was written")
        writer.finish()
        (tmp / RECORDING_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        _publish(tmp, out)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(summary_line(summary, out))
    return summary


def _per_task(tasks, results: list[_Attempt]) -> list[dict]:
    rows = []
    for t in tasks:
        rs = [a for a in results if a.task.index == t.index]
        ok = [a for a in rs if a.success]
        rows.append({"task": t.index, "name": t.name, "language": t.language, "attempts": len(rs),
                     "successes": len(ok), "success_rate": round(len(ok) / len(rs), 4) if rs else 0.0,
                     "mean_steps": round(float(np.mean([len(a.actions) for a in ok])), 1) if ok else None})
    return rows


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished dataset into place (replacing an old one only now that the new one is whole);
    directories group-readable, as the rest of the pipeline's outputs."""
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        os.chmod(d, 0o755)
    for f in (p for p in tmp.rglob("*") if p.is_file()):
        os.chmod(f, 0o644)
    replace_dir(tmp, out)


def summary_line(summary: dict, out: Path | str) -> str:
    tasks = ", ".join(f"task {r['task']} {r['successes']}/{r['attempts']}" for r in summary["per_task"])
    frames = sum(e["steps"] for e in summary["episodes"])
    return (f"record: LIBERO-{summary['suite']} expert {summary['successes']}/{summary['attempts']} successes "
            f"({tasks}); kept {len(summary['episodes'])} episodes, {frames} frames -> {out} "
            f"({summary['seconds']:.0f} s)")


def read_recording(dataset: str | Path) -> dict:
    """meta/dz_recording.json of a recorded dataset; DataError naming the file if absent or malformed."""
    path = Path(dataset) / RECORDING_FILE
    if not path.is_file():
        raise DataError(f"{path}: not found; the oracle replays datasets recorded by `dz data record libero`")
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON: {exc}") from exc
    for key in ("suite", "episodes", "max_steps"):
        if key not in rec:
            raise DataError(f"{path}: missing {key!r}")
    return rec
