"""`dz data record libero`: LIBERO demonstrations from the scripted expert, as a LeRobot v3.0 dataset.

Episodes run in the evaluation's own env worker processes (`EnvWorkerPool`: the same env, cameras, init state
and settle steps as `dz eval libero`), with the expert (`libero_scripted.ScriptedExpert`) acting beside each env on
privileged simulator state through the standard 7-dim OSC action. LIBERO's own goal predicate (`done`) decides
success; an episode that does not succeed within the suite's standard step limit is a failure. Only successful
episodes are kept (`keep: all` keeps failures too).

Starts (`init`): `standard` is the evaluation's own init states 0..N-1; `perturbed` shifts every movable object's
x/y by [min_shift_m, max_shift_m] from a standard state; `sampled` draws a fresh state from the task's own init
distribution (LIBERO's placement samplers, as `env.reset()` does without a fixed state). Perturbed and sampled
starts are redrawn until every standard init state of the task is at least `min_shift_m` away (some object's x/y),
so a recorded episode never starts where an evaluation episode does. LIBERO-Object's init regions are small, so
sampled starts stay within millimetres of standard ones (default distance 2 mm): in-distribution, near-duplicate
starts; perturbed ones (default min shift max_shift_m / 2) move every object by centimetres.

Label and executed action can differ:

* DART (`dart_noise` σ > 0): the env executes the expert's action plus N(0, σ²) on the 6 arm dims (clipped to
  [-1, 1], gripper untouched); the dataset's `action` is the clean expert action. The expert is closed-loop (it acts
  from the simulator state at every step), so it corrects the perturbation; with noise it also holds the hand's
  orientation (the noise rotates it).
* DAgger (`dagger` = a converted model directory): per chunk of `actions_per_chunk` steps the expert acts with
  probability `dagger_beta`, else the learned policy's chunk is executed (batched over the env workers, one session
  per episode, as `dz eval libero`). Every row's `action` is the expert's action at that state (`recover` mode: the
  expert re-plans when the policy moved things). Failed episodes are kept by default (`keep: all`): their states
  are the point. Rows stop at the first step whose expert label is not valid (`ScriptedExpert.label_valid`).
  Both write the executed actions as `executed_action` (7).

Every row also holds `observation.objects` (6, privileged, for diagnostics only: no embodiment reads it): the world
xyz of the goal's (first In/On term's) object and of its target (the region site, or the target body); for a goal
without an In/On term, of the part it moves (a drawer's handle, a knob) and of that fixture's root.

The expert solves the tasks whose every goal term it has a skill for (`libero_scripted.ScriptedExpert`): In/On (pick
and place; a plate is pushed onto a table region; a mug into the microwave), Open/Close of a drawer, Close of the
microwave's door, TurnOn/TurnOff of the stove; a goal of several terms is worked on as a sequence. That covers every
task of the four suites; a task with a term it has no skill for (e.g. opening a hinged door) is refused by name
before any env starts.

The dataset matches the public LIBERO LeRobot datasets (HuggingFaceVLA/libero, converted from the OpenVLA/openpi
regenerated data) so that the `libero_sim` and `libero_sim_tiny` embodiments read it unchanged:
`observation.images.image` and `observation.images.wrist_image` (both cameras rotated by 180 degrees, as
`libero_env.to_policy_obs` gives them to the policy), `observation.state` (8: eef position, eef axis-angle,
gripper qpos), `action` (7: delta eef position and rotation, gripper -1 open / +1 close), the task's language
instruction as the task, robot_type "panda", fps 10, one row per environment step: the observation before the
step and the action taken from it.

`meta/dz_recording.json` holds what a replay needs and what the expert achieved: the suite, per task the
attempts, successes and mean length, and per kept episode its task, init-state index, the exact MuJoCo state it
started from (a seeded perturbation of the standard one, a sampled one, or the standard one itself), how it was
made (`init`: base index, per-object shift, distance to the nearest standard state), its env seed and whether it
succeeded. `meta/info.json` carries the same recording options under `dz_recording` (DART σ, DAgger model and β).

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
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import replace_dir
from ..outputs import check_output_dir, mark
from ..data.errors import DataError
from ..progress import Progress
from ..schema import SEED
from .libero_recording import Recording, attempts
from .record_params import RecordParams, option

RECORDING_FILE = "meta/dz_recording.json"
KEEP_MODES = ("successes", "all")
# the recorder's own fields that `dz data record libero` names otherwise (as `dz eval libero` names the policy's)
RECORDER_OPTIONS = {"dagger_device": "--device", "dagger_solver_steps": "--solver-steps",
                    "dagger_cfg_scale": "--cfg-scale"}
# the goal predicates the scripted expert has skills for (`libero_expert.unsupported_term` says which of their
# arguments it handles: In/On any object and target, Open/Close a drawer's region, TurnOn/TurnOff a stove)
SUPPORTED_PREDICATES = ("in", "on", "open", "close", "turnon", "turnoff")


@dataclass
class RecordConfig(RecordParams):
    """The recording (`RecordParams`: params.yaml's fetch.record and `dz data record libero`'s options, by the same
    names) plus what only the recorder sets. Its problems are one DataError naming the command-line options."""
    dagger: str | None = None          # DAgger: a converted model directory whose policy acts with prob. 1 - beta
    dagger_beta: float = field(default=0.5, metadata={"min": 0, "max": 1})  # per chunk, the expert's probability
    dagger_device: str = "cpu"
    dagger_solver_steps: int = field(default=16, metadata={"min": 1})
    dagger_cfg_scale: float = 5.0
    # DAgger: steps per chunk (policy chunk executed); None = its horizon
    actions_per_chunk: int | None = field(default=None, metadata={"min": 1})
    keep: str | None = field(default=None, metadata={"choices": KEEP_MODES})  # None = successes, all with dagger
    seed: int = field(default=0, metadata=SEED)
    worker_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        problems = self.problems(lambda name: RECORDER_OPTIONS.get(name) or option(name))
        if problems:
            raise DataError("; ".join(problems))
        from .libero_env import auto_env_workers

        self.workers = auto_env_workers(self.workers)

    @property
    def keep_mode(self) -> str:
        return self.keep or ("all" if self.dagger else "successes")


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
    """Why the expert cannot solve a task (None if it can): every term of its goal needs a skill of the expert
    (`libero_expert.unsupported_term`)."""
    from .libero_expert import unsupported_term

    goal = goal_predicates(bddl_file)
    whys = [why for term in goal if (why := unsupported_term(term))]
    if not goal:
        return "the goal has no terms"
    if whys:
        return f"goal {' and '.join('(' + ' '.join(g) + ')' for g in goal)}: " + "; ".join(whys)
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


def _load_dagger_policy(cfg: RecordConfig):
    from ..model.sampler import SolverConfig
    from ..policy.policy import PolicyLoadError, load_policy

    try:
        policy = load_policy(cfg.dagger, device=cfg.dagger_device, seed=cfg.seed,
                             solver=SolverConfig(num_steps=cfg.dagger_solver_steps, cfg_scale=cfg.dagger_cfg_scale))
    except PolicyLoadError as exc:
        raise DataError(f"--dagger: {exc}") from None
    if "image" not in policy.embodiment.views or "wrist_image" not in policy.embodiment.views:
        raise DataError(f"--dagger: {cfg.dagger}: embodiment {policy.embodiment.tag!r} has views "
                        f"{sorted(policy.embodiment.views)}; LIBERO gives 'image' and 'wrist_image'")
    return policy


def record_into(record_kwargs: dict, out: str | Path) -> None:
    """`fetch_dataset`'s recorder for source 'libero': `RecordConfig(**record_kwargs)` recorded into `out`."""
    record_libero(RecordConfig(**record_kwargs), out)


def record_libero(cfg: RecordConfig, out: str | Path, overwrite: bool = False, progress: bool = True,
                  log=print, pool_factory=None, policy=None) -> dict:
    """Record `cfg.episodes` expert attempts per task into a LeRobot v3.0 dataset at `out` (module docstring).
    Returns the recording summary (also in meta/dz_recording.json). DataError for bad arguments or when no
    episode is kept (nothing is written then). `policy` (an `EmbodiedPolicy`-like object with `predict_batch`,
    `end_session` and `action_horizon`) replaces loading `cfg.dagger`."""
    from .libero_env import check_libero, ensure_libero_config, get_suite
    from .libero_workers import EnvWorkerPool

    out = check_output_dir(Path(out).expanduser(), overwrite=overwrite, command="data record")  # a file, or not ours
    if out.exists() and not overwrite:
        raise DataError(f"--out: {out} already exists (pass --overwrite to replace it)")
    ensure_libero_config()
    check_libero()
    tasks = _select_tasks(cfg)
    _check_supported(cfg, tasks)
    max_steps = cfg.max_steps or get_suite(cfg.suite).max_steps
    if cfg.dagger and policy is None:
        policy = _load_dagger_policy(cfg)
    todo = attempts(cfg, tasks)
    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.rec-{os.getpid()}-", dir=out.parent))
    os.chmod(tmp, 0o755)
    began = time.perf_counter()
    bar = Progress(len(todo), enabled=progress, desc=f"record LIBERO-{cfg.suite}", unit="episode")
    recording = None
    try:
        recording = Recording(cfg, tmp, todo, max_steps, policy, bar)
        pool_factory = pool_factory or (lambda n: EnvWorkerPool(n, camera_size=cfg.image_size, privileged=True,
                                                                timeout_s=cfg.worker_timeout_s, seed=cfg.seed))
        with pool_factory(min(cfg.workers, len(todo))) as pool:
            recording.run(pool)
        bar.close()
        recording.finish_writes()
        summary = recording.summary(tasks, round(time.perf_counter() - began, 1))
        if not recording.kept:
            what = "no attempt succeeded" if not recording.keep_all else "no attempt recorded a step"
            raise DataError(f"{what} ({len(todo)} tried on {cfg.suite!r} tasks "
                            f"{[t.index for t in tasks]}); nothing was written")
        recording.writer.finish(extra_info={"dz_recording": summary["options"]})
        (tmp / RECORDING_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        _publish(tmp, out, overwrite)
    except BaseException:
        bar.close()
        if recording is not None:
            recording.writes.shutdown(wait=True, cancel_futures=True)  # before its files are removed
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(summary_line(summary, out))
    return summary


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished dataset into place (replacing an old one only now that the new one is whole);
    directories group-readable, as the rest of the pipeline's outputs."""
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        os.chmod(d, 0o755)
    for f in (p for p in tmp.rglob("*") if p.is_file()):
        os.chmod(f, 0o644)
    mark(tmp, "data record")
    check_output_dir(out, overwrite=overwrite, command="data record")  # a user's files that appeared meanwhile
    replace_dir(tmp, out)


def summary_line(summary: dict, out: Path | str) -> str:
    tasks = ", ".join(f"task {r['task']} {r['successes']}/{r['attempts']}" for r in summary["per_task"])
    frames = sum(e["steps"] for e in summary["episodes"])
    opts = summary.get("options", {})
    who = "expert" if not opts.get("dagger_model") else f"DAgger (beta {opts['dagger_beta']:g})"
    if opts.get("dart_noise"):
        who += f" with DART noise {opts['dart_noise']:g}"
    if opts.get("retries"):
        who += f" ({opts['retries']} retries a start, σ x{opts['retry_noise_scale']:g} each)"
        tasks = ", ".join(f"task {r['task']} {r['successes']}/{r['starts']} starts in {r['attempts']} attempts"
                          for r in summary["per_task"])
    return (f"record: LIBERO-{summary['suite']} {who} {summary['successes']}/{summary['attempts']} successes "
            f"({tasks}); kept {len(summary['episodes'])} episodes, {frames} frames -> {out} "
            f"({summary['seconds']:.0f} s" + (f", {summary['env_steps'] / max(summary['seconds'], 1e-9):.0f} env steps/s)"
                                               if summary.get("env_steps") else ")"))


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
