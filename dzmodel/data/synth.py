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

Everything is deterministic by ``seed``: parquet and json bytes and the rendered frames are identical
across runs; mp4 files come from single-threaded encoders (in practice identical bytes too, though one
loaded CI run decoded values a few levels apart; the test bounds that).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from dzmodel.data.errors import DataError

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"

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

CODECS = {"libsvtav1": "av1", "libx264": "h264"}

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
# encoding and files


def _encode_mp4(path: Path, frames: np.ndarray, fps: int, codec: str, crf: int) -> None:
    """GOP 2 as lerobot's writer (cheap random access); the fastest presets; one encoder thread."""
    from .video import encode_video

    if codec not in CODECS:
        raise DataError(f"codec: {codec!r} is not supported; use one of {sorted(CODECS)}")
    if codec == "libsvtav1":
        encode_video(path, frames, fps, codec, crf=crf, gop=2, preset=12, options={"svtav1-params": "lp=1"})
    else:
        encode_video(path, frames, fps, codec, crf=crf, gop=2, preset="veryfast", options={"threads": "1"})


def _video_info(path: Path, fps: int) -> dict:
    import av

    with av.open(str(path)) as container:
        st = container.streams.video[0]
        return {
            "video.height": st.height,
            "video.width": st.width,
            "video.codec": st.codec.canonical_name,
            "video.pix_fmt": st.pix_fmt,
            "video.is_depth_map": False,
            "video.fps": int(fps),
            "video.channels": 3,
            "has_audio": False,
        }


def _write_parquet(table, path: Path, row_group_size: int | None = None) -> None:
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="snappy", row_group_size=row_group_size)


def _hf_schema_metadata(features: dict) -> bytes:
    """The `huggingface` schema metadata `datasets` writes, so HF readers get the exact features."""
    hf = {}
    for key, ft in features.items():
        if ft["dtype"] == "video":
            continue
        if tuple(ft["shape"]) == (1,):
            hf[key] = {"dtype": ft["dtype"], "_type": "Value"}
        else:
            hf[key] = {"feature": {"dtype": ft["dtype"], "_type": "Value"}, "length": ft["shape"][0], "_type": "Sequence"}
    return json.dumps({"info": {"features": hf}}).encode()


def _feature_stats(x: np.ndarray) -> dict:
    """lerobot-style stats over axis 0 (min, max, mean, std, count, q01..q99)."""
    x = np.asarray(x, dtype=np.float64)
    out = {
        "min": x.min(axis=0),
        "max": x.max(axis=0),
        "mean": x.mean(axis=0),
        "std": x.std(axis=0),
        "count": np.array([x.shape[0]]),
    }
    for q in (0.01, 0.10, 0.50, 0.90, 0.99):
        out[f"q{int(round(q * 100)):02d}"] = np.quantile(x, q, axis=0)
    return {k: v.tolist() for k, v in out.items()}


def _image_stats(frames: list[np.ndarray]) -> dict:
    """Per-channel stats in [0, 1], shaped [3, 1, 1] as lerobot stores them for images/videos."""
    pix = np.concatenate([f.reshape(-1, 3) for f in frames], axis=0).astype(np.float64) / 255.0
    st = _feature_stats(pix)
    return {k: (v if k == "count" else [[[c]] for c in v]) for k, v in st.items()}


def _build_features(image_size: int, fps: int) -> dict:
    video_ft = {"dtype": "video", "shape": [image_size, image_size, 3], "names": ["height", "width", "channels"]}
    return {
        MAIN_KEY: dict(video_ft),
        WRIST_KEY: dict(video_ft),
        STATE_KEY: {"dtype": "float32", "shape": [STATE_DIM], "names": list(STATE_NAMES)},
        ACTION_KEY: {"dtype": "float32", "shape": [ACTION_DIM], "names": list(ACTION_NAMES)},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }


def _dump_json(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=4) + "\n")


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
) -> Path:
    """Write a synthetic LIBERO-like LeRobot v3.0 dataset to ``out_dir`` and return its path.

    ``num_episodes`` episodes of ``episode_length`` frames (all episodes concatenated into one data
    parquet and one mp4 per camera), ``image_size`` x ``image_size`` RGB views at ``fps``, encoded
    with ``codec`` ("libsvtav1" = AV1 as lerobot's default, or "libx264" = H.264) at ``crf``.
    Deterministic by ``seed``. Written into a temporary sibling directory and renamed into place,
    so ``out_dir`` is either absent or complete. An existing ``out_dir`` is a DataError unless
    ``overwrite`` (then it is replaced, also atomically from a reader's point of view of the new tree).
    """
    import pyarrow as pa  # lazy

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
    if out_dir.exists() and not overwrite:
        raise DataError(f"{out_dir}: already exists (pass overwrite=True to replace it)")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_dataset(tmp, num_episodes, episode_length, image_size, fps, codec, seed, chunks_size, crf, pa)
        if out_dir.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, trash / "old")
            os.replace(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_dataset(root: Path, num_episodes, episode_length, image_size, fps, codec, seed, chunks_size, crf, pa):
    rng = np.random.default_rng(seed)
    features = _build_features(image_size, fps)
    T = episode_length
    n_frames = num_episodes * T

    states, actions, task_idx, frames = [], [], [], {k: [] for k in VIDEO_KEYS}
    episode_tasks = []
    for ep in range(num_episodes):
        ti = int(rng.integers(len(TASKS))) if ep >= len(TASKS) else ep  # every task appears when possible
        traj = _episode_trajectory(rng, T, image_size)
        views = render_episode(traj, ti, image_size)
        for k in VIDEO_KEYS:
            frames[k].append(views[k])
        states.append(_state_from_traj(traj, image_size).astype(np.float32))
        actions.append(traj["actions"].astype(np.float32))
        task_idx.append(np.full(T, ti, dtype=np.int64))
        episode_tasks.append(ti)

    used_tasks = sorted(set(episode_tasks))
    # task_index is the position in TASKS of the used tasks, renumbered densely
    remap = {t: i for i, t in enumerate(used_tasks)}
    task_strings = [TASKS[t] for t in used_tasks]

    # data parquet: one row group per episode, as lerobot's writer produces
    state = np.concatenate(states)
    action = np.concatenate(actions)
    frame_index = np.tile(np.arange(T, dtype=np.int64), num_episodes)
    columns = {
        STATE_KEY: pa.FixedSizeListArray.from_arrays(pa.array(state.reshape(-1), pa.float32()), STATE_DIM),
        ACTION_KEY: pa.FixedSizeListArray.from_arrays(pa.array(action.reshape(-1), pa.float32()), ACTION_DIM),
        "timestamp": pa.array((frame_index / fps).astype(np.float32), pa.float32()),
        "frame_index": pa.array(frame_index, pa.int64()),
        "episode_index": pa.array(np.repeat(np.arange(num_episodes, dtype=np.int64), T), pa.int64()),
        "index": pa.array(np.arange(n_frames, dtype=np.int64), pa.int64()),
        "task_index": pa.array(np.array([remap[t] for t in np.concatenate(task_idx)], dtype=np.int64), pa.int64()),
    }
    table = pa.table(columns).replace_schema_metadata({b"huggingface": _hf_schema_metadata(features)})
    _write_parquet(table, root / DATA_PATH.format(chunk_index=0, file_index=0), row_group_size=T)

    # videos: all episodes concatenated, one file per camera
    for k in VIDEO_KEYS:
        path = root / VIDEO_PATH.format(video_key=k, chunk_index=0, file_index=0)
        _encode_mp4(path, np.concatenate(frames[k]), fps, codec, crf)
        features[k]["info"] = _video_info(path, fps)

    # tasks: pandas-style parquet, index = task string, column task_index
    tasks_table = pa.table(
        {"task_index": pa.array(list(range(len(task_strings))), pa.int64()), "__index_level_0__": pa.array(task_strings, pa.string())}
    )
    pandas_meta = {
        "index_columns": ["__index_level_0__"],
        "column_indexes": [],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64", "metadata": None},
            {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode", "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    tasks_table = tasks_table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})
    _write_parquet(tasks_table, root / "meta" / "tasks.parquet")

    # episodes metadata
    ep_idx = np.arange(num_episodes, dtype=np.int64)
    ep_cols = {
        "episode_index": pa.array(ep_idx, pa.int64()),
        "tasks": pa.array([[TASKS[t]] for t in episode_tasks], pa.list_(pa.string())),
        "length": pa.array(np.full(num_episodes, T, dtype=np.int64), pa.int64()),
        "data/chunk_index": pa.array(np.zeros(num_episodes, np.int64), pa.int64()),
        "data/file_index": pa.array(np.zeros(num_episodes, np.int64), pa.int64()),
        "dataset_from_index": pa.array(ep_idx * T, pa.int64()),
        "dataset_to_index": pa.array((ep_idx + 1) * T, pa.int64()),
    }
    for k in VIDEO_KEYS:
        ep_cols[f"videos/{k}/chunk_index"] = pa.array(np.zeros(num_episodes, np.int64), pa.int64())
        ep_cols[f"videos/{k}/file_index"] = pa.array(np.zeros(num_episodes, np.int64), pa.int64())
        ep_cols[f"videos/{k}/from_timestamp"] = pa.array((ep_idx * T / fps).astype(np.float64), pa.float64())
        ep_cols[f"videos/{k}/to_timestamp"] = pa.array(((ep_idx + 1) * T / fps).astype(np.float64), pa.float64())
    ep_cols["meta/episodes/chunk_index"] = pa.array(np.zeros(num_episodes, np.int64), pa.int64())
    ep_cols["meta/episodes/file_index"] = pa.array(np.zeros(num_episodes, np.int64), pa.int64())
    _write_parquet(pa.table(ep_cols), root / EPISODES_PATH.format(chunk_index=0, file_index=0))

    # stats.json (lerobot format; images per channel in [0, 1] shaped [3, 1, 1])
    stats = {
        STATE_KEY: _feature_stats(state),
        ACTION_KEY: _feature_stats(action),
        "timestamp": _feature_stats(columns["timestamp"].to_numpy()[:, None]),
        "frame_index": _feature_stats(frame_index[:, None]),
        "episode_index": _feature_stats(columns["episode_index"].to_numpy()[:, None]),
        "index": _feature_stats(np.arange(n_frames)[:, None]),
        "task_index": _feature_stats(columns["task_index"].to_numpy()[:, None]),
    }
    for k in VIDEO_KEYS:
        stats[k] = _image_stats([f[::8] for f in frames[k]])
    _dump_json(stats, root / "meta" / "stats.json")

    info = {
        "codebase_version": CODEBASE_VERSION,
        "robot_type": "synthetic_block",
        "total_episodes": num_episodes,
        "total_frames": n_frames,
        "total_tasks": len(task_strings),
        "chunks_size": int(chunks_size),
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "fps": int(fps),
        "splits": {"train": f"0:{num_episodes}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH,
        "features": features,
    }
    _dump_json(info, root / "meta" / "info.json")


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
        f"{len(vids)} views ({', '.join(vids)}; {'/'.join(sorted(codecs))}), {size / 1e6:.2f} MB"
    )
