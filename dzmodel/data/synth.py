"""A small synthetic LIBERO-like dataset in the genuine LeRobot v3.0 layout.

The scene is a coloured block on a plain table (textured under the wrist camera). Each step the block moves by the
commanded action, so the actions can be read back from the video:

* ``action[t, 0:2]`` (dx, dy) moves the block by ``PIXELS_PER_ACTION`` pixels per unit between
  frame ``t`` and frame ``t + 1`` (x = column, y = row, in the 64x64 main view at ``image_size=64``;
  the scale grows with ``image_size``);
* ``action[t, 2]`` (dz) grows / shrinks the block;
* ``action[t, 3:6]`` tint the block colour (integrated, like the position; hue only, luma kept);
* ``action[t, 6]`` is the gripper command (+1 open / -1 closed), drawn as a bar on the top edge.

``observation.state[t]`` (8 dims, LIBERO-like) is the scene *at* frame ``t``:
``[x, y, size, tint_r, tint_g, tint_b, gripper, -gripper]`` with x, y, size in [0, 1] units of
the image side and the gripper pair as ``±0.04`` (finger joints).

Two views: ``observation.images.image`` (whole table) and ``observation.images.wrist_image``
(a 2x zoom centred on the block: the block stays put, the table texture slides under it).

Actions are smooth random walks in [-1, 1] with a pull towards the table centre; where the block
would leave the table the position is clamped and the stored action is the displacement actually
made, so ``p[t + 1] = p[t] + scale * action[t]`` holds exactly for every step.

``motion="orbit"`` replaces the random walk by a predictable controller: the block circles the table
centre, size and tint rotate in their own planes, and the gripper is closed on the upper half of the table.
Each action is then a fixed function of the scene the frame shows (plus a little smooth noise), so a policy
that sees one frame can predict the next chunk; the random walk cannot be predicted from a frame (a linear
predictor from the state gets 0.87-0.97 of the mean predictor's error). The demo trains on orbits.

``embodiment="oxe_droid"`` writes the same scenes in DROID's layout instead: three views
(``observation.images.{wrist_left, exterior_1_left, exterior_2_left}``; the second exterior camera sees the
table mirrored), a 14-dim state (cartesian 0:6 = the scene state above, gripper position 6:7 in [0, 1],
7 joint positions 7:14, a fixed linear map of the scene into a Franka's joint ranges) and a 21-dim action
(cartesian velocity 0:6, gripper target 6:7, joint velocity 7:14, joint position target 14:21), the slices
the ``oxe_droid`` embodiment reads. It gives the DROID serving path (RoboArena's protocol) a dataset.

Everything is deterministic by ``seed``: parquet and json bytes and the rendered frames are identical
across runs; mp4 files come from single-threaded encoders (in practice identical bytes too, though one
loaded CI run decoded values a few levels apart; the test bounds that).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dzmodel.outputs import check_output_dir, publish_dir
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_writer import CODECS, LeRobotV3Writer, VectorFeature


MAIN_KEY = "observation.images.image"
WRIST_KEY = "observation.images.wrist_image"
VIDEO_KEYS = (MAIN_KEY, WRIST_KEY)
STATE_KEY = "observation.state"
ACTION_KEY = "action"
STATE_DIM = 8
ACTION_DIM = 7

TASKS = (
    "push the red block to the left",
    "move the blue block to the right",
    "slide the green block forward",
    "nudge the yellow block back",
)
# block colour per task (RGB, 0..255): saturated and dark, so it stands out from the light grey table
# in luma (full resolution in yuv420p) as well as in colour
TASK_COLOURS = np.array([[200, 50, 50], [50, 70, 210], [50, 150, 60], [150, 50, 170]], dtype=np.float64)
LUMA = np.array([0.299, 0.587, 0.114])
TABLE_RGB = np.array([200.0, 196.0, 190.0])

STATE_NAMES = ["x", "y", "size", "tint_r", "tint_g", "tint_b", "gripper", "gripper_mirror"]
ACTION_NAMES = ["dx", "dy", "dz", "d_tint_r", "d_tint_g", "d_tint_b", "gripper"]

# geometry in units of the main view at 64 px; scaled by image_size / 64
PIXELS_PER_ACTION = 3.0  # block displacement (px at 64x64) per unit action
BASE_BLOCK = 10.0  # block side (px at 64x64) at size 0.5 state
WRIST_ZOOM = 2.0
TINT_SCALE = 40.0  # colour change (0..255) per unit of integrated tint


def pixels_per_action(image_size: int) -> float:
    """Block displacement in pixels of the main view per unit of action[0:2]."""
    return PIXELS_PER_ACTION * image_size / 64.0


# ---------------------------------------------------------------------------------------------
# trajectories


def _smooth_walk(rng: np.random.Generator, length: int, dims: int, rho: float, sigma: float) -> np.ndarray:
    out = np.empty((length, dims))
    v = rng.uniform(-0.5, 0.5, size=dims)
    for t in range(length):
        v = rho * v + sigma * rng.standard_normal(dims)
        out[t] = v
    return out


def _episode_trajectory(rng: np.random.Generator, length: int, image_size: int) -> dict[str, np.ndarray]:
    """Actions [T, 7] and the scene they produce: positions [T, 2] (px), size [T], tint [T, 3], grip [T]."""
    s = image_size / 64.0
    scale = pixels_per_action(image_size)
    margin = 10.0 * s  # keeps the block (half side <= 6.5 px) clear of the gripper bar and edges
    lo, hi = margin, image_size - margin
    noise = _smooth_walk(rng, length, 6, rho=0.85, sigma=0.25)
    actions = np.zeros((length, ACTION_DIM))
    pos = np.zeros((length, 2))
    size = np.zeros(length)
    tint = np.zeros((length, 3))
    grip = np.zeros(length)
    p = rng.uniform(lo + 6 * s, hi - 6 * s, size=2)
    z = rng.uniform(0.35, 0.65)
    c = np.zeros(3)
    g = 1.0 if rng.random() < 0.5 else -1.0
    centre = image_size / 2.0
    for t in range(length):
        pos[t], size[t], tint[t], grip[t] = p, z, c, g
        a = np.zeros(ACTION_DIM)
        a[0:6] = noise[t]
        a[0:2] += -0.04 * (p - centre) / s  # pull back to the middle of the table
        a[2] += -1.5 * (z - 0.5)
        a[3:6] += -0.5 * c
        a[0:6] = np.clip(a[0:6], -1.0, 1.0)
        # integrate, clamp to the table, store the displacement actually made
        p_new = np.clip(p + scale * a[0:2], lo, hi)
        a[0:2] = (p_new - p) / scale
        z_new = float(np.clip(z + 0.05 * a[2], 0.2, 0.8))
        a[2] = (z_new - z) / 0.05
        c_new = np.clip(c + 0.15 * a[3:6], -1.0, 1.0)
        a[3:6] = (c_new - c) / 0.15
        if rng.random() < 0.06:
            g = -g
        a[6] = g  # the gripper command for the next frame
        actions[t] = a
        p, z, c = p_new, z_new, c_new
    return {"actions": actions, "pos": pos, "size": size, "tint": tint, "grip": grip}


MOTIONS = ("walk", "orbit")
ORBIT_PERIODS = (48.0, 40.0, -56.0)  # steps per turn: position, (size, tint_r), (tint_g, tint_b)
ORBIT_NOISE = 0.03  # smooth action noise (action units): small beside the orbit's own motion


def _rotate(v: np.ndarray, turns: float) -> np.ndarray:
    c, s = np.cos(2 * np.pi * turns), np.sin(2 * np.pi * turns)
    return np.array([c * v[0] - s * v[1], s * v[0] + c * v[1]])


def _orbit_trajectory(rng: np.random.Generator, length: int, image_size: int) -> dict[str, np.ndarray]:
    """Like `_episode_trajectory`, but each action is a rotation of the current scene about its centre."""
    s = image_size / 64.0
    scale = pixels_per_action(image_size)
    lo, hi = 10.0 * s, image_size - 10.0 * s
    centre = np.full(2, image_size / 2.0)
    w_pos, w_zr, w_gb = (1.0 / t for t in ORBIT_PERIODS)
    angle = rng.uniform(0, 2 * np.pi, size=3)
    radius = (rng.uniform(6.0, 20.0) * s, rng.uniform(0.1, 0.28), rng.uniform(0.2, 0.8))
    p = centre + radius[0] * np.array([np.cos(angle[0]), np.sin(angle[0])])
    z = 0.5 + radius[1] * np.cos(angle[1])
    c = np.array([radius[1] * np.sin(angle[1]) / 0.3, *(radius[2] * np.array([np.cos(angle[2]), np.sin(angle[2])]))])
    noise = np.zeros(6)
    actions = np.zeros((length, ACTION_DIM))
    pos, size, tint, grip = np.zeros((length, 2)), np.zeros(length), np.zeros((length, 3)), np.zeros(length)
    for t in range(length):
        g = 1.0 if p[1] >= centre[1] else -1.0
        pos[t], size[t], tint[t], grip[t] = p, z, c, g
        noise = 0.7 * noise + ORBIT_NOISE * rng.standard_normal(6)
        a = np.zeros(ACTION_DIM)
        a[0:2] = (_rotate(p - centre, w_pos) - (p - centre)) / scale
        u = _rotate(np.array([z - 0.5, 0.3 * c[0]]), w_zr)  # size and tint_r on one circle (0.3 evens the scales)
        a[2], a[3] = (u[0] + 0.5 - z) / 0.05, (u[1] / 0.3 - c[0]) / 0.15
        a[4:6] = (_rotate(c[1:], w_gb) - c[1:]) / 0.15
        a[0:6] = np.clip(a[0:6] + noise, -1.0, 1.0)
        # integrate and clamp as the random walk does: the stored action is the change actually made
        p_new = np.clip(p + scale * a[0:2], lo, hi)
        a[0:2] = (p_new - p) / scale
        z_new = float(np.clip(z + 0.05 * a[2], 0.2, 0.8))
        a[2] = (z_new - z) / 0.05
        c_new = np.clip(c + 0.15 * a[3:6], -1.0, 1.0)
        a[3:6] = (c_new - c) / 0.15
        a[6] = 1.0 if p_new[1] >= centre[1] else -1.0  # the gripper command for the next frame
        actions[t] = a
        p, z, c = p_new, z_new, c_new
    return {"actions": actions, "pos": pos, "size": size, "tint": tint, "grip": grip}


# ---------------------------------------------------------------------------------------------
# rendering


def _coverage(lo_edges: np.ndarray, step: float, n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Fraction of each of n pixels [lo + j*step, lo + (j+1)*step) covered by [a, b]; shapes [T] -> [T, n]."""
    j = np.arange(n)
    p0 = lo_edges[:, None] + j[None, :] * step
    p1 = p0 + step
    return np.clip(np.minimum(p1, b[:, None]) - np.maximum(p0, a[:, None]), 0.0, None) / step


def _texture(u: np.ndarray, v: np.ndarray, period: float) -> np.ndarray:
    """A soft table texture (0..1) at world coordinates u (cols) [T, W] and v (rows) [T, H] -> [T, H, W]."""
    cu = np.cos(2 * np.pi * u / period)[:, None, :]
    cv = np.cos(2 * np.pi * v / (period * 1.3))[:, :, None]
    return 0.5 + 0.25 * cu + 0.25 * cv


def _render_view(traj: dict, colour: np.ndarray, image_size: int, wrist: bool, bg: np.ndarray) -> np.ndarray:
    n = image_size
    s = image_size / 64.0
    T = len(traj["pos"])
    side = BASE_BLOCK * s * (0.5 + traj["size"])  # [T]
    x, y = traj["pos"][:, 0], traj["pos"][:, 1]
    if wrist:
        zoom = WRIST_ZOOM
        x0 = x - n / (2 * zoom)
        y0 = y - n / (2 * zoom)
    else:
        zoom = 1.0
        x0 = np.zeros(T)
        y0 = np.zeros(T)
    step = 1.0 / zoom
    cov = _coverage(y0, step, n, y - side / 2, y + side / 2)[:, :, None] * _coverage(
        x0, step, n, x - side / 2, x + side / 2
    )[:, None, :]  # [T, H, W]
    u = x0[:, None] + (np.arange(n)[None, :] + 0.5) * step
    v = y0[:, None] + (np.arange(n)[None, :] + 0.5) * step
    tex = _texture(u, v, period=16.0 * s)  # [T, H, W]
    # plain table in the main view (the block is the only thing that moves); a textured one under the
    # wrist camera, so its view shows the motion as the table sliding under the block
    amp = 0.24 if wrist else 0.04
    table = bg[None, None, None, :] * (1.0 - amp / 2 + amp * tex[..., None])  # [T, H, W, 3]
    # the tint changes the hue only: its luma component is removed, so the block stays dark
    delta = TINT_SCALE * traj["tint"]
    # written out, not `delta @ LUMA`: BLAS kernels may sum in an order that depends on memory alignment, and
    # a 1-ulp change at a .5 boundary flips a pixel and then the encoded bitstream
    luma = delta[:, 0] * LUMA[0] + delta[:, 1] * LUMA[1] + delta[:, 2] * LUMA[2]
    delta = delta - luma[:, None]
    block_rgb = np.clip(colour[None, :] + delta, 0, 255)  # [T, 3]
    img = table * (1 - cov[..., None]) + block_rgb[:, None, None, :] * cov[..., None]
    # gripper bar on the top edge: white when closed, dark when open
    bar = max(1, int(round(2 * s)))
    img[:, :bar, :, :] = np.where(traj["grip"][:, None, None, None] < 0, 235.0, 25.0)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def render_episode(traj: dict, task_index: int, image_size: int) -> dict[str, np.ndarray]:
    """Frames uint8 [T, H, W, 3] for both views."""
    colour = TASK_COLOURS[task_index % len(TASK_COLOURS)]
    bg = TABLE_RGB
    return {
        MAIN_KEY: _render_view(traj, colour, image_size, wrist=False, bg=bg),
        WRIST_KEY: _render_view(traj, colour, image_size, wrist=True, bg=bg),
    }


def _state_from_traj(traj: dict, image_size: int) -> np.ndarray:
    g = traj["grip"]
    return np.stack(
        [
            traj["pos"][:, 0] / image_size,
            traj["pos"][:, 1] / image_size,
            traj["size"],
            traj["tint"][:, 0],
            traj["tint"][:, 1],
            traj["tint"][:, 2],
            0.04 * g,
            -0.04 * g,
        ],
        axis=1,
    )


# ---------------------------------------------------------------------------------------------
# files


def _vector_features() -> dict[str, VectorFeature]:
    return {STATE_KEY: VectorFeature(STATE_DIM, list(STATE_NAMES)),
            ACTION_KEY: VectorFeature(ACTION_DIM, list(ACTION_NAMES))}


# --- the DROID layout (embodiment="oxe_droid") ---

DROID_VIEWS = {"observation.images.wrist_left": WRIST_KEY, "observation.images.exterior_1_left": MAIN_KEY,
               "observation.images.exterior_2_left": None}     # None: the main view, mirrored
DROID_HOME = np.array([0.0, -0.78, 0.0, -2.36, 0.0, 1.57, 0.78])   # a Franka's ready pose (rad)
# scene state (x, y, size, tint_r, tint_g, tint_b, gripper) -> joint offsets from home, in radians
DROID_JOINT_MAP = np.random.default_rng(1234).uniform(-0.6, 0.6, size=(7, 7))


def _droid_vectors(traj: dict, image_size: int) -> dict[str, np.ndarray]:
    scene = _state_from_traj(traj, image_size)[:, :7]
    cartesian, gripper = scene[:, :6], (1.0 - traj["grip"][:, None]) / 2   # DROID: 0 open .. 1 closed
    centred = np.concatenate([cartesian - [0.5, 0.5, 0.5, 0, 0, 0], gripper], axis=1)
    joints = DROID_HOME + centred @ DROID_JOINT_MAP.T
    next_joints = np.concatenate([joints[1:], joints[-1:]])
    acts = traj["actions"]
    action = np.concatenate([acts[:, :6], (1.0 - acts[:, 6:7]) / 2, next_joints - joints, next_joints], axis=1)
    return {STATE_KEY: np.concatenate([cartesian, gripper, joints], axis=1), ACTION_KEY: action}


def _droid_features() -> dict[str, VectorFeature]:
    cart = ["x", "y", "z", "roll", "pitch", "yaw"]
    joints = [f"joint_{i}" for i in range(7)]
    return {STATE_KEY: VectorFeature(14, [*cart, "gripper_position", *joints]),
            ACTION_KEY: VectorFeature(21, [*(f"{c}_velocity" for c in cart), "gripper_position",
                                           *(f"{j}_velocity" for j in joints), *(f"{j}_position" for j in joints)])}


# --- a humanoid's layout (embodiment="unitree_g1"): one head camera, 26 joint positions as state and action ---

G1_JOINTS = 26
G1_VIEWS = {"observation.images.head": MAIN_KEY}
# scene state (x, y, size, tint_r, tint_g, tint_b, gripper) -> joint offsets from a standing pose, in radians
G1_JOINT_MAP = np.random.default_rng(4321).uniform(-0.4, 0.4, size=(G1_JOINTS, 7))


def _g1_vectors(traj: dict, image_size: int) -> dict[str, np.ndarray]:
    scene = _state_from_traj(traj, image_size)[:, :7]
    joints = (scene - [0.5, 0.5, 0.5, 0, 0, 0, 0]) @ G1_JOINT_MAP.T
    target = np.concatenate([joints[1:], joints[-1:]])  # absolute joint-position targets, the next state
    return {STATE_KEY: joints, ACTION_KEY: target}


def _g1_features() -> dict[str, VectorFeature]:
    names = [f"joint_{i}" for i in range(G1_JOINTS)]
    return {STATE_KEY: VectorFeature(G1_JOINTS, names), ACTION_KEY: VectorFeature(G1_JOINTS, names)}


def _libero_vectors(traj: dict, image_size: int) -> dict[str, np.ndarray]:
    return {STATE_KEY: _state_from_traj(traj, image_size), ACTION_KEY: traj["actions"]}


@dataclass(frozen=True)
class _Layout:
    """One embodiment's dataset: its robot name, its views (dataset key -> the rendered view it shows; None: the
    main view mirrored) and its state and action columns."""

    robot: str
    views: dict
    features: Callable[[], dict[str, VectorFeature]]
    vectors: Callable[[dict, int], dict[str, np.ndarray]]

    def frames(self, rendered: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: rendered[src] if src else np.ascontiguousarray(rendered[MAIN_KEY][:, :, ::-1])
                for k, src in self.views.items()}


LAYOUTS = {
    "libero_sim": _Layout("synthetic_block", {k: k for k in VIDEO_KEYS}, _vector_features, _libero_vectors),
    "oxe_droid": _Layout("synthetic_droid", DROID_VIEWS, _droid_features, _droid_vectors),
    "unitree_g1": _Layout("synthetic_g1", G1_VIEWS, _g1_features, _g1_vectors),
}
EMBODIMENTS = tuple(LAYOUTS)


def make_synthetic_dataset(
    out_dir: str | os.PathLike,
    num_episodes: int = 8,
    episode_length: int = 96,
    image_size: int = 64,
    fps: int = 10,
    codec: str = "libsvtav1",
    seed: int = 0,
    chunks_size: int = 1000,
    crf: int = 30,
    overwrite: bool = False,
    motion: str = "walk",
    embodiment: str = "libero_sim",
) -> Path:
    """Write a synthetic LIBERO-like LeRobot v3.0 dataset to ``out_dir`` and return its path.

    ``num_episodes`` episodes of ``episode_length`` frames (all episodes concatenated into one data
    parquet and one mp4 per camera), ``image_size`` x ``image_size`` RGB views at ``fps``, encoded
    with ``codec`` ("libsvtav1" = AV1 as lerobot's default, or "libx264" = H.264) at ``crf``.
    ``motion`` is "walk" (smooth random walks) or "orbit" (a predictable controller; module docstring).
    Deterministic by ``seed``. Written into a temporary sibling directory and renamed into place,
    so ``out_dir`` is either absent or complete. An existing ``out_dir`` is a DataError unless
    ``overwrite`` (then it is replaced, also atomically from a reader's point of view of the new tree).
    """
    out_dir = Path(out_dir)
    if codec not in CODECS:
        raise DataError(f"codec: {codec!r} is not supported; use one of {sorted(CODECS)}")
    if num_episodes < 1:
        raise DataError(f"num_episodes: must be >= 1, got {num_episodes}")
    if episode_length < 2:
        raise DataError(f"episode_length: must be >= 2, got {episode_length}")
    if image_size < 32 or image_size % 2:
        raise DataError(f"image_size: must be an even number >= 32, got {image_size}")
    if fps < 1:
        raise DataError(f"fps: must be >= 1, got {fps}")
    if motion not in MOTIONS:
        raise DataError(f"motion: must be one of {list(MOTIONS)}, got {motion!r}")
    if embodiment not in EMBODIMENTS:
        raise DataError(f"embodiment: must be one of {list(EMBODIMENTS)}, got {embodiment!r}")
    check_output_dir(out_dir, flag="out_dir", overwrite=overwrite, command="data synth")  # a file, or not ours
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise DataError(f"{out_dir}: already exists (pass overwrite=True to replace it)")

    with publish_dir(out_dir, "data synth", flag="out_dir", overwrite=overwrite) as tmp:  # checked again at the end
        _write_dataset(tmp, num_episodes, episode_length, image_size, fps, codec, seed, chunks_size, crf, motion,
                       embodiment)
    return out_dir


def _write_dataset(root: Path, num_episodes, episode_length, image_size, fps, codec, seed, chunks_size, crf,
                   motion="walk", embodiment="libero_sim"):
    rng = np.random.default_rng(seed)
    layout = LAYOUTS[embodiment]
    writer = LeRobotV3Writer(root, fps, layout.robot, {k: (image_size, image_size) for k in layout.views},
                             layout.features(), codec=codec, crf=crf, chunks_size=chunks_size)
    for ep in range(num_episodes):
        ti = int(rng.integers(len(TASKS))) if ep >= len(TASKS) else ep  # every task appears when possible
        traj = (_orbit_trajectory if motion == "orbit" else _episode_trajectory)(rng, episode_length, image_size)
        writer.add_episode(TASKS[ti], layout.frames(render_episode(traj, ti, image_size)),
                           layout.vectors(traj, image_size))
    writer.finish()


def summarize(root: str | os.PathLike) -> str:
    """A short human summary of a synthetic (or any v3.0) dataset, for ``dz data synth``."""
    root = Path(root)
    info = json.loads((root / "meta" / "info.json").read_text())
    vids = [k for k, f in info["features"].items() if f["dtype"] == "video"]
    codecs = {f["info"]["video.codec"] for k, f in info["features"].items() if f["dtype"] == "video" and "info" in f}
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return (
        f"{root}: LeRobot {info['codebase_version']}, {info['total_episodes']} episodes, "
        f"{info['total_frames']} frames @ {info['fps']} fps, {info['total_tasks']} tasks, "
        f"{len(vids)} view{'s' if len(vids) != 1 else ''} ({', '.join(vids)}; {'/'.join(sorted(codecs))}), {size / 1e6:.2f} MB"
    )
