"""Writers of tiny LeRobot datasets for tests: v3.0, v2.1 (mp4) and image-in-parquet.

Every frame encodes where it came from: red = 30 + 10 * (frame_index % 23) (episode-relative),
green = 40 + 60 * (episode_index % 4), blue = 128 + 60 * camera number. ``frame_id(img)`` reads
(episode % 4, frame % 23) back from a decoded frame. States and actions are functions of (episode, frame)
too (``state_value``, ``action_value``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dzmodel.data.video import encode_image_bytes, encode_video

CAMERAS = ("observation.images.front", "observation.images.wrist")
STATE_DIM = 4
ACTION_DIM = 3
H, W = 48, 64
TASKS = ("pick up the red block", "open the drawer", "close the drawer")


def frame_rgb(episode: int, frame: int, camera: int = 0, size: tuple[int, int] = (H, W)) -> np.ndarray:
    img = np.empty((*size, 3), dtype=np.uint8)
    img[..., 0] = 30 + 10 * (frame % 23)
    img[..., 1] = 40 + 60 * (episode % 4)
    img[..., 2] = 128 + 60 * camera
    return img


def frame_id(img: np.ndarray) -> tuple[int, int]:
    """(episode % 4, frame % 23) encoded in a decoded frame (see ``frame_rgb``)."""
    r, g = float(img[..., 0].mean()), float(img[..., 1].mean())
    return round((g - 40) / 60), round((r - 30) / 10)


def state_value(episode: int, frame: int) -> np.ndarray:
    return np.array([episode * 100 + frame, frame * 0.5, -frame, 1.0], dtype=np.float32)


def action_value(episode: int, frame: int) -> np.ndarray:
    return np.array([frame * 0.25, episode, 2.0], dtype=np.float32)


def episode_task_indices(episode: int, length: int) -> list[int]:
    """Episode 0: task 0; episode 1: task 1 then task 2 for its second half; others: task e % 3."""
    if episode == 1:
        return [1 if i < length // 2 else 2 for i in range(length)]
    return [episode % len(TASKS)] * length


def _features(cameras: Sequence[str], dtype: str, fps: int, codec: str, size=(H, W)) -> dict:
    feats: dict = {
        "observation.state": {"dtype": "float32", "shape": [STATE_DIM], "names": [f"s{i}" for i in range(STATE_DIM)]},
        "action": {"dtype": "float32", "shape": [ACTION_DIM], "names": [f"a{i}" for i in range(ACTION_DIM)]},
    }
    for cam in cameras:
        ft = {"dtype": dtype, "shape": [size[0], size[1], 3], "names": ["height", "width", "channels"]}
        if dtype == "video":
            ft["info"] = {
                "video.height": size[0],
                "video.width": size[1],
                "video.codec": "av1" if "av1" in codec or "svt" in codec else "h264",
                "video.pix_fmt": "yuv420p",
                "video.is_depth_map": False,
                "video.fps": fps,
                "video.channels": 3,
                "has_audio": False,
            }
        feats[cam] = ft
    for k, dt in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"), ("index", "int64"), ("task_index", "int64")):
        feats[k] = {"dtype": dt, "shape": [1], "names": None}
    return feats


def _data_table(episodes: Sequence[int], lengths: Sequence[int], fps: int, start_index: int, fixed_size: bool, image_cols=None):
    import pyarrow as pa

    states, actions, ts, fi, ei, idx, ti = [], [], [], [], [], [], []
    g = start_index
    for ep, n in zip(episodes, lengths, strict=True):
        tis = episode_task_indices(ep, n)
        for i in range(n):
            states.append(state_value(ep, i))
            actions.append(action_value(ep, i))
            ts.append(i / fps)
            fi.append(i)
            ei.append(ep)
            idx.append(g)
            ti.append(tis[i])
            g += 1

    def vec(rows, d):
        flat = pa.array(np.concatenate(rows).astype(np.float32), type=pa.float32())
        if fixed_size:
            return pa.FixedSizeListArray.from_arrays(flat, d)
        return pa.ListArray.from_arrays(pa.array(np.arange(0, len(rows) * d + 1, d, dtype=np.int32)), flat)

    cols = {
        "observation.state": vec(states, STATE_DIM),
        "action": vec(actions, ACTION_DIM),
        "timestamp": pa.array(np.array(ts, dtype=np.float32)),
        "frame_index": pa.array(fi, type=pa.int64()),
        "episode_index": pa.array(ei, type=pa.int64()),
        "index": pa.array(idx, type=pa.int64()),
        "task_index": pa.array(ti, type=pa.int64()),
    }
    for name, arr in (image_cols or {}).items():
        cols[name] = arr
    return pa.table(cols)


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))


def write_v30(
    root: str | Path,
    lengths: Sequence[int] = (12, 9),
    fps: int = 10,
    codec: str = "libx264",
    cameras: Sequence[str] = CAMERAS[:1],
    file_of_episode: Sequence[int] | None = None,
) -> Path:
    """LeRobot v3.0: episodes sharing data parquet/mp4 files (``file_of_episode``, default all in
    file 0), each mp4 the concatenation of its episodes' frames."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    n_eps = len(lengths)
    file_of_episode = list(file_of_episode) if file_of_episode is not None else [0] * n_eps
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    data_path = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    video_path = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    ep_rows: dict[str, list] = {k: [] for k in ("episode_index", "tasks", "length", "data/chunk_index", "data/file_index", "dataset_from_index", "dataset_to_index")}
    for cam in cameras:
        for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
            ep_rows[f"videos/{cam}/{c}"] = []
    ep_rows["meta/episodes/chunk_index"] = []
    ep_rows["meta/episodes/file_index"] = []
    ep_rows["stats/observation.state/mean"] = []
    for fidx in sorted(set(file_of_episode)):
        eps = [e for e in range(n_eps) if file_of_episode[e] == fidx]
        table = _data_table(eps, [lengths[e] for e in eps], fps, int(starts[eps[0]]), fixed_size=True)
        p = root / data_path.format(chunk_index=0, file_index=fidx)
        p.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, p)
        for ci, cam in enumerate(cameras):
            frames = np.stack([frame_rgb(e, i, ci) for e in eps for i in range(lengths[e])])
            encode_video(root / video_path.format(video_key=cam, chunk_index=0, file_index=fidx), frames, fps, codec=codec)
        offset = 0
        for e in eps:
            ep_rows["episode_index"].append(e)
            ep_rows["tasks"].append([TASKS[t] for t in dict.fromkeys(episode_task_indices(e, lengths[e]))])
            ep_rows["length"].append(lengths[e])
            ep_rows["data/chunk_index"].append(0)
            ep_rows["data/file_index"].append(fidx)
            ep_rows["dataset_from_index"].append(int(starts[e]))
            ep_rows["dataset_to_index"].append(int(starts[e + 1]))
            for cam in cameras:
                ep_rows[f"videos/{cam}/chunk_index"].append(0)
                ep_rows[f"videos/{cam}/file_index"].append(fidx)
                ep_rows[f"videos/{cam}/from_timestamp"].append(offset / fps)
                ep_rows[f"videos/{cam}/to_timestamp"].append((offset + lengths[e]) / fps)
            ep_rows["meta/episodes/chunk_index"].append(0)
            ep_rows["meta/episodes/file_index"].append(0)
            ep_rows["stats/observation.state/mean"].append(np.mean([state_value(e, i) for i in range(lengths[e])], 0).tolist())
            offset += lengths[e]
    order = np.argsort(ep_rows["episode_index"])
    ep_rows = {k: [v[i] for i in order] for k, v in ep_rows.items()}
    p = root / "meta/episodes/chunk-000/file-000.parquet"
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(ep_rows), p)
    # as pandas writes lerobot's tasks DataFrame (index = task text, unnamed)
    import pandas as pd

    pd.DataFrame({"task_index": list(range(len(TASKS)))}, index=list(TASKS)).to_parquet(root / "meta/tasks.parquet")
    _write_json(
        root / "meta/info.json",
        {
            "codebase_version": "v3.0",
            "robot_type": "test_arm",
            "total_episodes": n_eps,
            "total_frames": int(sum(lengths)),
            "total_tasks": len(TASKS),
            "chunks_size": 1000,
            "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200,
            "fps": fps,
            "splits": {"train": f"0:{n_eps}"},
            "data_path": data_path,
            "video_path": video_path if cameras else None,
            "features": _features(cameras, "video", fps, codec),
        },
    )
    return root


def _write_v2_meta(root: Path, lengths: Sequence[int], fps: int, features: dict, video_path: str | None, chunks_size: int, version: str) -> None:
    n_eps = len(lengths)
    (root / "meta").mkdir(parents=True, exist_ok=True)
    with open(root / "meta/episodes.jsonl", "w") as f:
        for e, n in enumerate(lengths):
            tasks = [TASKS[t] for t in dict.fromkeys(episode_task_indices(e, n))]
            f.write(json.dumps({"episode_index": e, "tasks": tasks, "length": n}) + "\n")
    with open(root / "meta/tasks.jsonl", "w") as f:
        for i, t in enumerate(TASKS):
            f.write(json.dumps({"task_index": i, "task": t}) + "\n")
    n_videos = sum(1 for ft in features.values() if ft["dtype"] == "video") * n_eps
    _write_json(
        root / "meta/info.json",
        {
            "codebase_version": version,
            "robot_type": "test_arm",
            "total_episodes": n_eps,
            "total_frames": int(sum(lengths)),
            "total_tasks": len(TASKS),
            "total_videos": n_videos,
            "total_chunks": (n_eps - 1) // chunks_size + 1,
            "chunks_size": chunks_size,
            "fps": fps,
            "splits": {"train": f"0:{n_eps}"},
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": video_path,
            "features": features,
        },
    )


def write_v21(
    root: str | Path,
    lengths: Sequence[int] = (8, 7),
    fps: int = 10,
    codec: str = "libsvtav1",
    cameras: Sequence[str] = CAMERAS,
    chunks_size: int = 1000,
) -> Path:
    """LeRobot v2.1: one parquet (list<float> vectors) and one mp4 per camera per episode."""
    import pyarrow.parquet as pq

    root = Path(root)
    video_path = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
    start = 0
    for e, n in enumerate(lengths):
        chunk = e // chunks_size
        p = root / f"data/chunk-{chunk:03d}/episode_{e:06d}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_data_table([e], [n], fps, start, fixed_size=False), p)
        for ci, cam in enumerate(cameras):
            frames = np.stack([frame_rgb(e, i, ci) for i in range(n)])
            encode_video(root / video_path.format(episode_chunk=chunk, video_key=cam, episode_index=e), frames, fps, codec=codec)
        start += n
    _write_v2_meta(root, lengths, fps, _features(cameras, "video", fps, codec), video_path, chunks_size, "v2.1")
    return root


def write_image_parquet(
    root: str | Path,
    lengths: Sequence[int] = (6, 5),
    fps: int = 10,
    cameras: Sequence[str] = ("image", "wrist_image"),
    fmt: str = "png",
    version: str = "v2.0",
    row_group_size: int | None = None,
) -> Path:
    """Image-in-parquet (like physical-intelligence/libero): struct{bytes, path} image columns, no mp4."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    img_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    start = 0
    for e, n in enumerate(lengths):
        cols = {
            cam: pa.array([{"bytes": encode_image_bytes(frame_rgb(e, i, ci), fmt), "path": None} for i in range(n)], type=img_type)
            for ci, cam in enumerate(cameras)
        }
        p = root / f"data/chunk-000/episode_{e:06d}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_data_table([e], [n], fps, start, fixed_size=False, image_cols=cols), p, row_group_size=row_group_size)
        start += n
    _write_v2_meta(root, lengths, fps, _features(cameras, "image", fps, ""), None, 1000, version)
    return root


def write_test_arm_yaml(path: str | Path, sampling: str | None = None) -> Path:
    """The `test_arm` embodiment over the writers' cameras (32 px views side by side, action horizon 4)."""
    views = ", ".join(f"c{i}: {k}" for i, k in enumerate(CAMERAS))
    text = f"""
test_arm:
  views: {{{views}}}
  view_size: [32, 32]
  layout: [[{", ".join(f"c{i}" for i in range(len(CAMERAS)))}]]
  state: {{state: {{column: observation.state}}}}
  action: {{action: {{column: action}}}}
  action_horizon: 4
"""
    path = Path(path)
    path.write_text(text + (f"  sampling: {sampling}\n" if sampling else ""))
    return path
