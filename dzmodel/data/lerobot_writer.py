"""Write a LeRobot v3.0 dataset episode by episode: the layout lerobot 0.4.4's own writer produces.

Used by the embedded synthetic dataset (`synth.py`) and by the LIBERO recorder (`dz data record libero`).

* one data parquet for all episodes, one row group per episode, with the `huggingface` schema metadata;
* videos: either one mp4 per camera for all episodes (`episodes_per_video_file=None`: frames are kept until
  `finish`, fine for small datasets) or one mp4 per camera and episode (`1`: encoded as each episode arrives,
  so memory stays flat however many episodes are recorded); both are valid v3.0 (`from_timestamp`/`to_timestamp`
  in the episodes table locate an episode in its file);
* meta/tasks.parquet (pandas-style index), meta/episodes/…parquet, meta/stats.json (lerobot's format: images per
  channel in [0, 1] shaped [3, 1, 1]) and meta/info.json.

The writer writes into the directory it is given; callers make the result atomic by writing into a temporary
sibling and renaming it (`synth.make_synthetic_dataset`, `eval.libero_record.record_libero`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
CODECS = {"libsvtav1": "av1", "libx264": "h264"}
STATS_FRAME_STRIDE = 8  # image statistics from every 8th frame (lerobot samples frames too)
STATS_PIXELS = 64       # ... and at most this many pixels per side


@dataclass(frozen=True)
class VectorFeature:
    """A float32 vector column: its width and lerobot's `names` entry (a list, or {"motors": [...]})."""

    dim: int
    names: list | dict | None = None


def feature_stats(x: np.ndarray) -> dict:
    """lerobot-style stats over axis 0 (min, max, mean, std, count, q01..q99)."""
    x = np.asarray(x, dtype=np.float64)
    out = {"min": x.min(axis=0), "max": x.max(axis=0), "mean": x.mean(axis=0), "std": x.std(axis=0),
           "count": np.array([x.shape[0]])}
    for q in (0.01, 0.10, 0.50, 0.90, 0.99):
        out[f"q{int(round(q * 100)):02d}"] = np.quantile(x, q, axis=0)
    return {k: v.tolist() for k, v in out.items()}


def image_stats(frames: list[np.ndarray]) -> dict:
    """Per-channel stats in [0, 1], shaped [3, 1, 1] as lerobot stores them for images/videos."""
    pix = np.concatenate([f.reshape(-1, 3) for f in frames], axis=0).astype(np.float64) / 255.0
    st = feature_stats(pix)
    return {k: (v if k == "count" else [[[c]] for c in v]) for k, v in st.items()}


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


def _write_parquet(table, path: Path, row_group_size: int | None = None) -> None:
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="snappy", row_group_size=row_group_size)


def _dump_json(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=4) + "\n")


def encode_mp4(path: Path, frames: np.ndarray, fps: int, codec: str, crf: int, gop: int = 2) -> None:
    """GOP 2 by default, as lerobot's writer (cheap random access; a longer GOP makes much smaller files);
    the fastest presets; one encoder thread (deterministic)."""
    from .video import encode_video

    if codec not in CODECS:
        raise DataError(f"codec: {codec!r} is not supported; use one of {sorted(CODECS)}")
    if codec == "libsvtav1":
        encode_video(path, frames, fps, codec, crf=crf, gop=gop, preset=12, options={"svtav1-params": "lp=1"})
    else:
        encode_video(path, frames, fps, codec, crf=crf, gop=gop, preset="veryfast", options={"threads": "1"})


def _video_info(path: Path, fps: int) -> dict:
    try:
        import av
    except ImportError:  # OpenCV only (the GPU image): the header facts it reads
        from .video import video_info

        info = video_info(path)
        return {"video.height": info["height"], "video.width": info["width"], "video.codec": info["codec"],
                "video.pix_fmt": info["pix_fmt"], "video.is_depth_map": False, "video.fps": int(fps),
                "video.channels": 3, "has_audio": False}

    with av.open(str(path)) as container:
        st = container.streams.video[0]
        return {"video.height": st.height, "video.width": st.width, "video.codec": st.codec.canonical_name,
                "video.pix_fmt": st.pix_fmt, "video.is_depth_map": False, "video.fps": int(fps),
                "video.channels": 3, "has_audio": False}


class LeRobotV3Writer:
    """Episodes in, a LeRobot v3.0 dataset out (module docstring).

    video_keys: {key: (height, width)}; vectors: {key: VectorFeature}, e.g. observation.state and action.
    `add_episode` takes the episode's task string, its frames per video key (uint8 [T, H, W, 3]) and its vector
    columns ([T, dim]); `finish` writes the tables and metadata and returns the root."""

    def __init__(self, root: str | Path, fps: int, robot_type: str, video_keys: dict[str, tuple[int, int]],
                 vectors: dict[str, VectorFeature], codec: str = "libsvtav1", crf: int = 30,
                 chunks_size: int = 1000, episodes_per_video_file: int | None = None,
                 image_names: tuple[str, ...] = ("height", "width", "channels"), gop: int = 2):
        if codec not in CODECS:
            raise DataError(f"codec: {codec!r} is not supported; use one of {sorted(CODECS)}")
        if fps < 1:
            raise DataError(f"fps: must be >= 1, got {fps}")
        if episodes_per_video_file not in (None, 1):
            raise DataError("episodes_per_video_file: must be None (one file) or 1 (a file per episode)")
        self.root, self.fps, self.robot_type = Path(root), int(fps), robot_type
        self.video_keys, self.vectors = dict(video_keys), dict(vectors)
        if gop < 1:
            raise DataError(f"gop: must be >= 1, got {gop}")
        self.codec, self.crf, self.chunks_size, self.gop = codec, crf, int(chunks_size), int(gop)
        self.per_episode_files = episodes_per_video_file == 1
        self.features: dict = {}
        for key, (h, w) in self.video_keys.items():
            if h % 2 or w % 2:
                raise DataError(f"{key}: video frames need an even height and width, got {h}x{w}")
            self.features[key] = {"dtype": "video", "shape": [h, w, 3], "names": list(image_names)}
        for key, ft in self.vectors.items():
            self.features[key] = {"dtype": "float32", "shape": [ft.dim], "names": ft.names}
        for key in ("timestamp",):
            self.features[key] = {"dtype": "float32", "shape": [1], "names": None}
        for key in ("frame_index", "episode_index", "index", "task_index"):
            self.features[key] = {"dtype": "int64", "shape": [1], "names": None}
        self._columns: dict[str, list[np.ndarray]] = {k: [] for k in self.vectors}
        self._lengths: list[int] = []
        self._tasks: list[str] = []          # per episode
        self._task_order: list[str] = []     # distinct tasks in first-seen order
        self._pending_frames: dict[str, list[np.ndarray]] = {k: [] for k in self.video_keys}
        self._stats_frames: dict[str, list[np.ndarray]] = {k: [] for k in self.video_keys}

    @property
    def num_episodes(self) -> int:
        return len(self._lengths)

    def add_episode(self, task: str, frames: dict[str, np.ndarray], columns: dict[str, np.ndarray]) -> int:
        """Append one episode; returns its index."""
        ep = self.num_episodes
        lengths = {len(np.asarray(v)) for v in list(frames.values()) + list(columns.values())}
        if len(lengths) != 1 or 0 in lengths:
            raise DataError(f"episode {ep}: every video and column needs the same number (> 0) of frames, "
                            f"got lengths {sorted(lengths)}")
        if set(frames) != set(self.video_keys) or set(columns) != set(self.vectors):
            raise DataError(f"episode {ep}: expected videos {sorted(self.video_keys)} and columns "
                            f"{sorted(self.vectors)}, got {sorted(frames)} and {sorted(columns)}")
        (T,) = lengths
        for key, x in columns.items():
            x = np.asarray(x, dtype=np.float32)
            if x.shape != (T, self.vectors[key].dim):
                raise DataError(f"episode {ep}: {key} must be [{T}, {self.vectors[key].dim}], got {list(x.shape)}")
            self._columns[key].append(x)
        for key, x in frames.items():
            x = np.asarray(x)
            if x.dtype != np.uint8 or x.shape[1:] != (*self.video_keys[key], 3):
                raise DataError(f"episode {ep}: {key} frames must be uint8 [T, {self.video_keys[key][0]}, "
                                f"{self.video_keys[key][1]}, 3], got {x.dtype} {list(x.shape)}")
            sample = x[::STATS_FRAME_STRIDE]
            step = max(1, max(x.shape[1:3]) // STATS_PIXELS)
            self._stats_frames[key].append(np.ascontiguousarray(sample[:, ::step, ::step]))
            if self.per_episode_files:
                path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=ep // self.chunks_size,
                                                     file_index=ep % self.chunks_size)
                encode_mp4(path, x, self.fps, self.codec, self.crf, self.gop)
                if "info" not in self.features[key]:
                    self.features[key]["info"] = _video_info(path, self.fps)
            else:
                self._pending_frames[key].append(x)
        self._lengths.append(T)
        self._tasks.append(task)
        if task not in self._task_order:
            self._task_order.append(task)
        return ep

    def finish(self, extra_info: dict | None = None) -> Path:
        """Write the data parquet, the (single-file) videos and the metadata; returns the root."""
        import pyarrow as pa

        if not self._lengths:
            raise DataError(f"{self.root}: no episodes to write")
        root, fps, n_eps = self.root, self.fps, self.num_episodes
        lengths = np.array(self._lengths, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        n_frames = int(lengths.sum())
        task_index = {t: i for i, t in enumerate(self._task_order)}
        frame_index = np.concatenate([np.arange(T, dtype=np.int64) for T in lengths])
        episode_index = np.repeat(np.arange(n_eps, dtype=np.int64), lengths)
        vectors = {k: np.concatenate(v) for k, v in self._columns.items()}
        columns = {k: pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1), pa.float32()), v.shape[1])
                   for k, v in vectors.items()}
        columns.update({
            "timestamp": pa.array((frame_index / fps).astype(np.float32), pa.float32()),
            "frame_index": pa.array(frame_index, pa.int64()),
            "episode_index": pa.array(episode_index, pa.int64()),
            "index": pa.array(np.arange(n_frames, dtype=np.int64), pa.int64()),
            "task_index": pa.array(np.repeat([task_index[t] for t in self._tasks], lengths).astype(np.int64), pa.int64()),
        })
        table = pa.table(columns).replace_schema_metadata({b"huggingface": _hf_schema_metadata(self.features)})
        # one row group per episode, as lerobot's writer produces (equal lengths: the row group size says it)
        row_group = int(lengths[0]) if len(set(self._lengths)) == 1 else None
        _write_parquet(table, root / DATA_PATH.format(chunk_index=0, file_index=0), row_group_size=row_group)

        if not self.per_episode_files:
            for key in self.video_keys:
                path = root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0)
                encode_mp4(path, np.concatenate(self._pending_frames[key]), fps, self.codec, self.crf, self.gop)
                self.features[key]["info"] = _video_info(path, fps)
                self._pending_frames[key] = []

        self._write_tasks(pa)
        self._write_episodes(pa, lengths, starts)
        stats = {k: feature_stats(v) for k, v in vectors.items()}
        stats.update({
            "timestamp": feature_stats(columns["timestamp"].to_numpy()[:, None]),
            "frame_index": feature_stats(frame_index[:, None]),
            "episode_index": feature_stats(episode_index[:, None]),
            "index": feature_stats(np.arange(n_frames)[:, None]),
            "task_index": feature_stats(columns["task_index"].to_numpy()[:, None]),
        })
        for key in self.video_keys:
            stats[key] = image_stats(self._stats_frames[key])
        _dump_json(stats, root / "meta" / "stats.json")
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": n_eps,
            "total_frames": n_frames,
            "total_tasks": len(self._task_order),
            "chunks_size": self.chunks_size,
            "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200,
            "fps": fps,
            "splits": {"train": f"0:{n_eps}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self.video_keys else None,
            "features": self.features,
        }
        info.update(extra_info or {})
        _dump_json(info, root / "meta" / "info.json")
        return root

    def _write_tasks(self, pa) -> None:
        """pandas-style parquet: index = task string, column task_index (what lerobot reads)."""
        tasks = self._task_order
        table = pa.table({"task_index": pa.array(list(range(len(tasks))), pa.int64()),
                          "__index_level_0__": pa.array(tasks, pa.string())})
        pandas_meta = {
            "index_columns": ["__index_level_0__"],
            "column_indexes": [],
            "columns": [
                {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
                 "metadata": None},
                {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode", "numpy_type": "object",
                 "metadata": None},
            ],
            "creator": {"library": "pyarrow", "version": pa.__version__},
            "pandas_version": "2.2.3",
        }
        _write_parquet(table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()}),
                       self.root / "meta" / "tasks.parquet")

    def _write_episodes(self, pa, lengths: np.ndarray, starts: np.ndarray) -> None:
        n_eps, fps = len(lengths), self.fps
        ep_idx = np.arange(n_eps, dtype=np.int64)
        zeros = np.zeros(n_eps, np.int64)
        cols = {
            "episode_index": pa.array(ep_idx, pa.int64()),
            "tasks": pa.array([[t] for t in self._tasks], pa.list_(pa.string())),
            "length": pa.array(lengths, pa.int64()),
            "data/chunk_index": pa.array(zeros, pa.int64()),
            "data/file_index": pa.array(zeros, pa.int64()),
            "dataset_from_index": pa.array(starts, pa.int64()),
            "dataset_to_index": pa.array(starts + lengths, pa.int64()),
        }
        if self.per_episode_files:
            chunk, file, t0 = ep_idx // self.chunks_size, ep_idx % self.chunks_size, np.zeros(n_eps)
        else:
            chunk, file, t0 = zeros, zeros, starts / fps
        for key in self.video_keys:
            cols[f"videos/{key}/chunk_index"] = pa.array(chunk, pa.int64())
            cols[f"videos/{key}/file_index"] = pa.array(file, pa.int64())
            cols[f"videos/{key}/from_timestamp"] = pa.array(t0.astype(np.float64), pa.float64())
            cols[f"videos/{key}/to_timestamp"] = pa.array((t0 + lengths / fps).astype(np.float64), pa.float64())
        cols["meta/episodes/chunk_index"] = pa.array(zeros, pa.int64())
        cols["meta/episodes/file_index"] = pa.array(zeros, pa.int64())
        _write_parquet(pa.table(cols), self.root / EPISODES_PATH.format(chunk_index=0, file_index=0))
