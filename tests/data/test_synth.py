"""The synthetic LIBERO-like dataset: genuine LeRobot v3.0 layout, deterministic, learnable actions."""

import json
from pathlib import Path

import numpy as np
import pytest

from dzmodel.data.errors import DataError
from dzmodel.data.synth import (
    ACTION_KEY,
    MAIN_KEY,
    STATE_KEY,
    TASKS,
    VIDEO_KEYS,
    WRIST_KEY,
    make_synthetic_dataset,
    pixels_per_action,
    summarize,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
av = pytest.importorskip("av")

N_EP, T, SIZE, FPS = 4, 40, 64, 10


@pytest.fixture(scope="module", params=["libx264", "libsvtav1"])
def ds(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / "synth"
    return make_synthetic_dataset(out, num_episodes=N_EP, episode_length=T, image_size=SIZE, fps=FPS, codec=request.param)


def _decode_all(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def _block_centroid(frames: np.ndarray) -> np.ndarray:
    """Coverage-weighted centroid (x, y) of the dark block on the light table, per frame, in pixels.

    Coverage is estimated from luma (full resolution in yuv420p): 0 at the table's median luma,
    1 at the block's darkest pixel; small values (texture, coding noise) are ignored.
    """
    f = frames.astype(np.float64)
    y = f @ np.array([0.299, 0.587, 0.114])
    y[:, :3, :] = np.median(y, axis=(1, 2))[:, None, None]  # ignore the gripper bar
    med = np.median(y, axis=(1, 2))[:, None, None]
    lo = y.min(axis=(1, 2))[:, None, None]
    w = np.clip((med - y) / (med - lo), 0, 1)
    w[w < 0.2] = 0
    ys, xs = np.mgrid[0 : f.shape[1], 0 : f.shape[2]] + 0.5
    tot = w.sum(axis=(1, 2))
    return np.stack([(w * xs).sum(axis=(1, 2)) / tot, (w * ys).sum(axis=(1, 2)) / tot], axis=1)


def test_layout_and_info(ds):
    info = json.loads((ds / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0"
    assert info["fps"] == FPS
    assert info["total_episodes"] == N_EP and info["total_frames"] == N_EP * T
    assert info["total_tasks"] == min(N_EP, len(TASKS))
    assert info["splits"] == {"train": f"0:{N_EP}"}
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    for k in ("chunks_size", "data_files_size_in_mb", "video_files_size_in_mb"):
        assert isinstance(info[k], int)
    feats = info["features"]
    for k in VIDEO_KEYS:
        assert feats[k]["dtype"] == "video" and feats[k]["shape"] == [SIZE, SIZE, 3]
        assert feats[k]["names"] == ["height", "width", "channels"]
        vi = feats[k]["info"]
        assert vi["video.codec"] in ("av1", "h264") and vi["video.pix_fmt"] == "yuv420p" and vi["video.fps"] == FPS
    assert feats[STATE_KEY]["shape"] == [8] and feats[STATE_KEY]["dtype"] == "float32"
    assert feats[ACTION_KEY]["shape"] == [7] and feats[ACTION_KEY]["dtype"] == "float32"
    for k in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        assert feats[k]["shape"] == [1]

    data = pq.read_table(ds / "data/chunk-000/file-000.parquet")
    assert data.num_rows == N_EP * T
    assert data.schema.field(STATE_KEY).type == pa.list_(pa.float32(), 8)
    assert data.schema.field(ACTION_KEY).type == pa.list_(pa.float32(), 7)
    ep = data.column("episode_index").to_numpy()
    fi = data.column("frame_index").to_numpy()
    assert (np.bincount(ep) == T).all()
    assert (fi == np.tile(np.arange(T), N_EP)).all()
    assert (data.column("index").to_numpy() == np.arange(N_EP * T)).all()
    np.testing.assert_allclose(data.column("timestamp").to_numpy(), fi / FPS, rtol=1e-6)
    act = np.stack(data.column(ACTION_KEY).to_numpy(zero_copy_only=False))
    assert np.abs(act).max() <= 1.0 + 1e-6
    assert set(np.unique(act[:, 6])) <= {-1.0, 1.0}

    tasks = pq.read_table(ds / "meta/tasks.parquet")
    assert tasks.column("task_index").to_pylist() == list(range(info["total_tasks"]))
    assert set(tasks.column("__index_level_0__").to_pylist()) <= set(TASKS)
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["__index_level_0__"]

    eps = pq.read_table(ds / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["episode_index"] for e in eps] == list(range(N_EP))
    for i, e in enumerate(eps):
        assert e["length"] == T and e["dataset_from_index"] == i * T and e["dataset_to_index"] == (i + 1) * T
        assert e["data/chunk_index"] == 0 and e["data/file_index"] == 0
        assert e["meta/episodes/chunk_index"] == 0 and e["meta/episodes/file_index"] == 0
        assert len(e["tasks"]) == 1 and e["tasks"][0] in TASKS
        for k in VIDEO_KEYS:
            assert e[f"videos/{k}/from_timestamp"] == pytest.approx(i * T / FPS)
            assert e[f"videos/{k}/to_timestamp"] == pytest.approx((i + 1) * T / FPS)
    stats = json.loads((ds / "meta/stats.json").read_text())
    assert len(stats[STATE_KEY]["mean"]) == 8 and len(stats[ACTION_KEY]["q99"]) == 7
    assert np.array(stats[MAIN_KEY]["mean"]).shape == (3, 1, 1)
    assert not list(ds.parent.glob(".synth.tmp-*"))  # no temp leftovers
    assert "4 episodes" in summarize(ds)


def test_video_frame_counts(ds):
    for k in VIDEO_KEYS:
        path = ds / f"videos/{k}/chunk-000/file-000.mp4"
        with av.open(str(path)) as c:
            st = c.streams.video[0]
            assert (st.width, st.height) == (SIZE, SIZE)
            n = sum(1 for _ in c.decode(video=0))
        assert n == N_EP * T


def test_actions_learnable_from_video(ds):
    """The block displacement measured in the decoded frames tracks action[:, :2] closely."""
    data = pq.read_table(ds / "data/chunk-000/file-000.parquet")
    act = np.stack(data.column(ACTION_KEY).to_numpy(zero_copy_only=False)).astype(np.float64)
    state = np.stack(data.column(STATE_KEY).to_numpy(zero_copy_only=False)).astype(np.float64)
    ep = data.column("episode_index").to_numpy()
    cen = _block_centroid(_decode_all(ds / f"videos/{MAIN_KEY}/chunk-000/file-000.mp4"))
    # the decoded block sits where the state says (within a pixel)
    assert np.abs(cen - state[:, :2] * SIZE).max() < 1.0
    same_ep = ep[1:] == ep[:-1]
    disp = (cen[1:] - cen[:-1])[same_ep] / pixels_per_action(SIZE)
    a = act[:-1][same_ep, :2]
    for d in range(2):
        r = np.corrcoef(disp[:, d], a[:, d])[0, 1]
        assert r > 0.97, f"dim {d}: corr {r:.3f}"
    # predicting the mean action explains nothing; the frame difference explains most of the variance
    resid = ((disp - a) ** 2).mean()
    assert resid < 0.1 * ((a - a.mean(0)) ** 2).mean()
    # the wrist view also moves with the block's surroundings (not a static image)
    wrist = _decode_all(ds / f"videos/{WRIST_KEY}/chunk-000/file-000.mp4").astype(np.float64)
    assert np.abs(np.diff(wrist[:T], axis=0)).mean() > 1.0


def test_deterministic_by_seed(tmp_path):
    kw = dict(num_episodes=2, episode_length=16, image_size=32, codec="libx264")
    a = make_synthetic_dataset(tmp_path / "a", seed=3, **kw)
    b = make_synthetic_dataset(tmp_path / "b", seed=3, **kw)
    c = make_synthetic_dataset(tmp_path / "c", seed=4, **kw)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        if rel.suffix in (".parquet", ".json"):
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    vid = Path(f"videos/{MAIN_KEY}/chunk-000/file-000.mp4")
    fa, fb, fc = (_decode_all(d / vid).astype(np.int64) for d in (a, b, c))
    # Identical in practice. One CI run under load decoded small differences (6 % of values, at most 6 levels,
    # mean 0.1) that did not reproduce in 60 encodes under load, so the same seed is bounded, not equal; another
    # seed differs by ~10 levels on average.
    same_seed = np.abs(fa - fb)
    assert same_seed.mean() < 0.5 and same_seed.max() <= 16, (same_seed.mean(), same_seed.max())
    assert np.abs(fa - fc).mean() > 5.0
    data = Path("data/chunk-000/file-000.parquet")
    assert (a / data).read_bytes() != (c / data).read_bytes()


def test_rendering_does_not_depend_on_memory_alignment():
    """Frames are a pure function of the trajectory: the same values at other memory offsets render the same
    bytes (a 1-ulp difference at a .5 boundary would change a pixel, and the encoder would amplify it)."""
    from dzmodel.data.synth import _episode_trajectory, render_episode

    traj = _episode_trajectory(np.random.default_rng(3), 16, 32)

    def shifted(a: np.ndarray, offset: int) -> np.ndarray:
        buf = np.empty(a.size + offset, dtype=a.dtype)
        out = buf[offset:].reshape(a.shape)
        out[...] = a
        return out

    ref = render_episode(traj, 0, 32)
    for offset in (1, 3, 7):
        other = render_episode({k: shifted(v, offset) for k, v in traj.items()}, 0, 32)
        for key in ref:
            assert np.array_equal(ref[key], other[key]), (key, offset)


def test_refuses_existing_and_bad_args(tmp_path):
    out = make_synthetic_dataset(tmp_path / "d", num_episodes=1, episode_length=4, image_size=32, codec="libx264")
    with pytest.raises(DataError, match="already exists"):
        make_synthetic_dataset(out, num_episodes=1, episode_length=4, image_size=32, codec="libx264")
    make_synthetic_dataset(out, num_episodes=2, episode_length=4, image_size=32, codec="libx264", overwrite=True)
    assert json.loads((out / "meta/info.json").read_text())["total_episodes"] == 2
    with pytest.raises(DataError, match="codec"):
        make_synthetic_dataset(tmp_path / "e", codec="mpeg2")
    assert not (tmp_path / "e").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # nothing half-written


def test_loads_with_lerobot(tmp_path):
    """lerobot 0.4.4's own reader opens the embedded dataset (installed by `make setup`), and its frames
    equal ours."""
    from dzmodel.data.lerobot_compat import import_lerobot_dataset
    from dzmodel.data.lerobot_format import open_dataset

    LeRobotDatasetMetadata, LeRobotDataset = import_lerobot_dataset()
    root = make_synthetic_dataset(tmp_path / "lr", num_episodes=2, episode_length=12, image_size=32, codec="libx264")
    meta = LeRobotDatasetMetadata("dzmodel/synthetic", root=root)
    assert meta.total_episodes == 2 and meta.total_frames == 24 and meta.fps == 10
    assert set(meta.video_keys) == set(VIDEO_KEYS)
    dset = LeRobotDataset("dzmodel/synthetic", root=root, video_backend="torchcodec")
    item = dset[13]
    assert tuple(item[MAIN_KEY].shape) == (3, 32, 32)
    assert tuple(item[ACTION_KEY].shape) == (7,)
    assert item["task"] in TASKS
    ours = open_dataset(root).read_frames(1, MAIN_KEY, [1])[0]  # global index 13 = episode 1, frame 1
    theirs = (item[MAIN_KEY].permute(1, 2, 0).numpy() * 255).round()
    assert abs(ours.astype(float) - theirs).max() <= 1


def test_droid_layout_reads_as_oxe_droid(tmp_path):
    """`--embodiment oxe_droid`: DROID's three views and column layout, which the oxe_droid embodiment's slices
    read (joint targets = the next state's joints; exterior 2 = exterior 1 mirrored); lerobot reads it too."""
    from dzmodel.data.dataset import embodiment_metadata
    from dzmodel.data.embodiments import get_embodiment
    from dzmodel.data.lerobot_compat import import_lerobot_dataset
    from dzmodel.data.lerobot_format import open_dataset

    root = make_synthetic_dataset(tmp_path / "droid", num_episodes=2, episode_length=30, image_size=32,
                                  codec="libx264", embodiment="oxe_droid")
    info = json.loads((root / "meta/info.json").read_text())
    assert info["features"][STATE_KEY]["shape"] == [14] and info["features"][ACTION_KEY]["shape"] == [21]
    views = {"observation.images.wrist_left", "observation.images.exterior_1_left", "observation.images.exterior_2_left"}
    assert {k for k, f in info["features"].items() if f["dtype"] == "video"} == views
    ds = open_dataset(root)
    ext1 = ds.read_frames(0, "observation.images.exterior_1_left", [5])[0].astype(int)
    ext2 = ds.read_frames(0, "observation.images.exterior_2_left", [5])[0].astype(int)
    assert np.abs(ext1[:, ::-1] - ext2).mean() < 0.7 * np.abs(ext1 - ext2).mean()  # codec noise aside
    import pyarrow.parquet as pq

    table = pq.read_table(next((root / "data").rglob("*.parquet")))
    state, action = np.stack(table[STATE_KEY].to_numpy()), np.stack(table[ACTION_KEY].to_numpy())
    np.testing.assert_allclose(action[:29, 14:21], state[1:30, 7:14], atol=1e-6)  # joint targets, episode 0
    assert set(np.unique(state[:, 6]).round(6)) <= {0.0, 1.0}  # DROID's gripper position: 0 open, 1 closed
    embodiment_metadata(root, get_embodiment("oxe_droid"), tmp_path / "meta.json")
    stats = json.loads((tmp_path / "meta.json").read_text())["oxe_droid"]["statistics"]
    assert len(stats["state"]["joint_position"]["q01"]) == 7 and len(stats["action"]["gripper_position"]["q99"]) == 1
    LeRobotDatasetMetadata, _ = import_lerobot_dataset()
    assert set(LeRobotDatasetMetadata("dzmodel/droid", root=root).video_keys) == views


def test_summary_counts_views_in_words(tmp_path):
    import json

    from dzmodel.data.synth import summarize

    root = tmp_path / "one_camera"
    (root / "meta").mkdir(parents=True)
    info = {"codebase_version": "v3.0", "total_episodes": 1, "total_frames": 2, "fps": 10, "total_tasks": 1,
            "features": {"observation.images.front": {"dtype": "video", "info": {"video.codec": "av1"}}}}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    assert "1 view (observation.images.front; av1)" in summarize(root)
    info["features"]["observation.images.wrist"] = info["features"]["observation.images.front"]
    (root / "meta" / "info.json").write_text(json.dumps(info))
    assert "2 views (" in summarize(root)
