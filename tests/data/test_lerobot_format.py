"""LeRobotReader over v3.0, v2.1 and image-in-parquet datasets written by tests/data/lerobot_writers.py."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("av")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from dzmodel.data import lerobot_format as lf  # noqa: E402
from dzmodel.data.errors import DataError  # noqa: E402
from dzmodel.data.lerobot_format import Episode, open_dataset  # noqa: E402
from dzmodel.data.video import torchcodec_available  # noqa: E402
from tests.data.lerobot_writers import (  # noqa: E402
    CAMERAS,
    TASKS,
    action_value,
    episode_task_indices,
    frame_id,
    state_value,
    write_image_parquet,
    write_v21,
    write_v30,
)

BACKENDS = ["pyav"] + (["torchcodec"] if torchcodec_available() else [])
LENGTHS = {"v30": (12, 9), "v21": (8, 7), "img": (6, 5)}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("lerobot")
    return {
        # two episodes concatenated in one H.264 mp4 per camera
        "v30": write_v30(base / "v30", LENGTHS["v30"], codec="libx264", cameras=CAMERAS),
        # per-episode AV1 mp4s
        "v21": write_v21(base / "v21", LENGTHS["v21"], codec="libsvtav1", cameras=CAMERAS),
        "img": write_image_parquet(base / "img", LENGTHS["img"]),
    }


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("layout", ["v30", "v21", "img"])
def test_metadata(datasets, layout):
    r = open_dataset(datasets[layout])
    assert r.version == {"v30": "v3.0", "v21": "v2.1", "img": "v2.0"}[layout]
    assert r.fps == 10.0
    n0, n1 = LENGTHS[layout]
    assert r.episodes == [Episode(0, n0, (TASKS[0],)), Episode(1, n1, (TASKS[1], TASKS[2]))]
    assert r.tasks == dict(enumerate(TASKS))
    assert r.video_keys == (["image", "wrist_image"] if layout == "img" else list(CAMERAS))
    assert r.features["observation.state"].shape == (4,)
    assert r.features["action"].dtype == "float32"
    r.check()


@pytest.mark.parametrize("layout", ["v30", "v21", "img"])
@pytest.mark.parametrize("ep", [0, 1])
def test_read_columns(datasets, layout, ep):
    r = open_dataset(datasets[layout])
    n = LENGTHS[layout][ep]
    cols = r.read_columns(ep, ["observation.state", "action", "frame_index", "timestamp", "task_index"])
    assert cols["observation.state"].dtype == np.float32 and cols["observation.state"].shape == (n, 4)
    np.testing.assert_array_equal(cols["observation.state"], np.stack([state_value(ep, i) for i in range(n)]))
    np.testing.assert_array_equal(cols["action"], np.stack([action_value(ep, i) for i in range(n)]))
    assert cols["frame_index"].dtype == np.int64
    np.testing.assert_array_equal(cols["frame_index"], np.arange(n))
    np.testing.assert_allclose(cols["timestamp"], np.arange(n) / 10, atol=1e-6)
    np.testing.assert_array_equal(cols["task_index"], episode_task_indices(ep, n))
    assert r.task_per_frame(ep) == [TASKS[t] for t in episode_task_indices(ep, n)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["v30", "v21", "img"])
@pytest.mark.parametrize("ep", [0, 1])
def test_read_frames_by_content(datasets, layout, ep, backend):
    r = open_dataset(datasets[layout])
    n = LENGTHS[layout][ep]
    want = [3, 0, 3, n - 1, 1, n - 1]  # unsorted, with duplicates
    for cam_no, key in enumerate(r.video_keys):
        frames = r.read_frames(ep, key, want, backend=backend)
        assert frames.dtype == np.uint8 and frames.shape == (len(want), 48, 64, 3)
        assert [frame_id(f) for f in frames] == [(ep, i) for i in want]
        assert abs(float(frames[..., 2].mean()) - (128 + 60 * cam_no)) < 6  # the right camera
        np.testing.assert_array_equal(frames[0], frames[2])


def test_read_frames_errors(datasets):
    r = open_dataset(datasets["v30"])
    with pytest.raises(DataError, match="out of range"):
        r.read_frames(1, CAMERAS[0], [0, 9])
    with pytest.raises(DataError, match="not a video"):
        r.read_frames(0, "observation.state", [0])
    with pytest.raises(DataError, match="no episode 7"):
        r.read_frames(7, CAMERAS[0], [0])
    with pytest.raises(DataError, match="use read_frames"):
        r.read_columns(0, [CAMERAS[0]])
    with pytest.raises(DataError, match="no column"):
        r.read_columns(0, ["observation.velocity"])


def test_v30_from_timestamp_and_paths(datasets):
    r = open_dataset(datasets["v30"])
    assert r.from_timestamp(0, CAMERAS[0]) == 0.0
    assert r.from_timestamp(1, CAMERAS[0]) == pytest.approx(1.2)
    assert r.video_file(0, CAMERAS[1]) == r.video_file(1, CAMERAS[1])
    assert r.video_file(1, CAMERAS[1]).relative_to(r.root).as_posix() == f"videos/{CAMERAS[1]}/chunk-000/file-000.mp4"
    assert [p.relative_to(r.root).as_posix() for p in r.iter_data_files()] == ["data/chunk-000/file-000.parquet"]


def test_v21_paths(datasets):
    r = open_dataset(datasets["v21"])
    assert r.video_file(1, CAMERAS[0]).relative_to(r.root).as_posix() == f"videos/chunk-000/{CAMERAS[0]}/episode_000001.mp4"
    assert [p.name for p in r.iter_data_files()] == ["episode_000000.parquet", "episode_000001.parquet"]


def test_v30_episodes_across_files(tmp_path):
    root = write_v30(tmp_path / "multi", (5, 4, 6), codec="libx264", file_of_episode=(0, 0, 1))
    r = open_dataset(root)
    r.check()
    assert [e.length for e in r.episodes] == [5, 4, 6]
    assert len(list(r.iter_data_files())) == 2
    assert r.from_timestamp(2, CAMERAS[0]) == 0.0  # first episode of file-001
    np.testing.assert_array_equal(r.read_columns(2, ["observation.state"])["observation.state"][:, 0], 200 + np.arange(6))
    frames = r.read_frames(2, CAMERAS[0], [5, 0])
    assert [frame_id(f) for f in frames] == [(2, 5), (2, 0)]
    frames = r.read_frames(1, CAMERAS[0], [3])
    assert frame_id(frames[0]) == (1, 3)


def test_images_read_by_row_group(tmp_path):
    root = write_image_parquet(tmp_path / "img", (7, 5), cameras=("image",), fmt="jpeg", row_group_size=2)
    r = open_dataset(root)
    frames = r.read_frames(0, "image", [6, 1, 6, 0])
    assert [frame_id(f) for f in frames] == [(0, 6), (0, 1), (0, 6), (0, 0)]
    assert sorted(k[2] for k in r._rg_cache) == [0, 3]  # only the row groups holding rows 0, 1 and 6
    assert [frame_id(f) for f in r.read_frames(1, "image", [4, 2])] == [(1, 4), (1, 2)]


def test_column_cache_reads_each_file_once(datasets, monkeypatch):
    r = open_dataset(datasets["v30"])
    calls = []
    real = lf.read_parquet
    monkeypatch.setattr(lf, "read_parquet", lambda p, columns=None: calls.append((p, columns)) or real(p, columns))
    for _ in range(3):
        r.read_columns(0, ["observation.state"])
        r.read_columns(1, ["observation.state", "action"])
    data_reads = [c for c in calls if "data" in str(c[0])]
    # the row map (episode_index + frame_index), state, action: each column loaded once
    assert sorted(sum((list(c[1]) for c in data_reads), [])) == ["action", "episode_index", "frame_index", "observation.state"]
    assert len(data_reads) == 3


def test_pickles_for_loader_workers(datasets):
    r = open_dataset(datasets["v30"])
    r.read_columns(0, ["action"])
    r2 = pickle.loads(pickle.dumps(r))
    np.testing.assert_array_equal(r2.read_columns(1, ["action"])["action"], r.read_columns(1, ["action"])["action"])


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("layout", ["v30", "v21"])
def test_check_lists_missing_files(datasets, layout, tmp_path):
    root = _copy(datasets[layout], tmp_path)
    r = open_dataset(root)
    gone = [r.video_file(1, CAMERAS[1]), r.data_file(1)]
    for p in gone:
        p.unlink()
    with pytest.raises(DataError) as ei:
        open_dataset(root).check()
    msg = str(ei.value)
    assert "missing file(s)" in msg
    for p in gone:
        assert p.relative_to(root).as_posix() in msg


def test_check_names_every_missing_file_or_writes_the_list(tmp_path, monkeypatch):
    """Up to MISSING_SHOWN missing files are all named; beyond, the error names the first ones and a file that
    lists all of them. Data files cannot be skipped, so there is no --skip-missing hint."""
    import dzmodel.data.lerobot_format as fmt

    root = write_image_parquet(tmp_path / "img", (2,) * 8, cameras=("image",))
    gone = sorted(p.relative_to(root).as_posix() for p in (root / "data/chunk-000").glob("*.parquet"))
    for p in gone:
        (root / p).unlink()
    with pytest.raises(DataError, match=r"8 missing file\(s\)") as ei:
        open_dataset(root).check()
    assert all(p in str(ei.value) for p in gone) and "--skip-missing" not in str(ei.value)
    monkeypatch.setattr(fmt, "MISSING_SHOWN", 3)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(DataError, match=r"and 5 more \(all 8 listed in (\S+)\)") as ei:
        open_dataset(root).check()
    listing = re.search(r"listed in (\S+)\)", str(ei.value)).group(1)
    assert Path(listing).parent == tmp_path and sorted(Path(listing).read_text().split()) == gone


def test_check_missing_videos_only_suggests_skip_missing(datasets, tmp_path):
    root = _copy(datasets["v30"], tmp_path)
    open_dataset(root).video_file(1, CAMERAS[1]).unlink()
    with pytest.raises(DataError, match="only video files are missing: `--skip-missing`"):
        open_dataset(root).check()


def test_check_total_episodes_promise(datasets, tmp_path):
    root = _copy(datasets["v21"], tmp_path)
    info = json.loads((root / "meta/info.json").read_text())
    info["total_episodes"] = 5
    (root / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="total_episodes=5"):
        open_dataset(root).check()


def test_missing_info_json(tmp_path):
    with pytest.raises(DataError, match=r"meta/info.json: missing"):
        open_dataset(tmp_path)


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"codebase_version": "v1.6", "fps": 10, "features": {}, "data_path": "x"}), "'v1.6' is not supported"),
        (json.dumps({"codebase_version": "v2.1", "features": {}, "data_path": "x"}), "'fps' is missing"),
    ],
)
def test_invalid_info_json(tmp_path, content, match):
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta/info.json").write_text(content)
    with pytest.raises(DataError, match=match) as ei:
        open_dataset(tmp_path)
    assert "info.json" in str(ei.value)


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def test_truncated_data_parquet(datasets, tmp_path):
    root = _copy(datasets["v21"], tmp_path)
    r = open_dataset(root)
    bad = r.data_file(1)
    _truncate(bad)
    r.read_columns(0, ["action"])  # other episode unaffected
    with pytest.raises(DataError, match="truncated or corrupt") as ei:
        r.read_columns(1, ["action"])
    assert str(bad) in str(ei.value)


def test_truncated_episodes_parquet(datasets, tmp_path):
    root = _copy(datasets["v30"], tmp_path)
    bad = root / "meta/episodes/chunk-000/file-000.parquet"
    _truncate(bad)
    with pytest.raises(DataError, match="truncated or corrupt") as ei:
        open_dataset(root)
    assert str(bad) in str(ei.value)


def test_corrupt_mp4(datasets, tmp_path):
    root = _copy(datasets["v21"], tmp_path)
    r = open_dataset(root)
    bad = r.video_file(0, CAMERAS[0])
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    for backend in BACKENDS:
        with pytest.raises(DataError) as ei:
            r.read_frames(0, CAMERAS[0], [0], backend=backend)
        assert str(bad) in str(ei.value)


def test_missing_mp4(datasets, tmp_path):
    root = _copy(datasets["v21"], tmp_path)
    r = open_dataset(root)
    bad = r.video_file(1, CAMERAS[0])
    bad.unlink()
    with pytest.raises(DataError, match="missing") as ei:
        r.read_frames(1, CAMERAS[0], [0])
    assert str(bad) in str(ei.value)


def test_nan_names_file_key_episode(datasets, tmp_path):
    root = _copy(datasets["v21"], tmp_path)
    p = root / "data/chunk-000/episode_000001.parquet"
    t = pq.read_table(p)
    states = np.stack(t.column("observation.state").to_numpy(zero_copy_only=False)).astype(np.float32)
    states[2, 1] = np.nan
    col = pa.ListArray.from_arrays(pa.array(np.arange(0, states.size + 1, 4, dtype=np.int32)), pa.array(states.reshape(-1)))
    t = t.set_column(t.column_names.index("observation.state"), "observation.state", col)
    pq.write_table(t, p)
    r = open_dataset(root)
    r.read_columns(1, ["action"])
    with pytest.raises(DataError, match="NaN") as ei:
        r.read_columns(1, ["observation.state"])
    msg = str(ei.value)
    assert str(p) in msg and "observation.state" in msg and "episode 1" in msg


def test_length_mismatch(datasets, tmp_path):
    root = _copy(datasets["v21"], tmp_path)
    lines = (root / "meta/episodes.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    row["length"] += 1
    lines[0] = json.dumps(row)
    (root / "meta/episodes.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="episode 0 has 8 rows but the episode table says length 9"):
        open_dataset(root).read_columns(0, ["action"])


def test_lerobot_metadata_agrees(datasets):
    """lerobot 0.4.4's own LeRobotDatasetMetadata reads our v3.0 fixture the same way."""
    from dzmodel.data.lerobot_compat import import_lerobot_dataset

    LeRobotDatasetMetadata, _ = import_lerobot_dataset()
    root = datasets["v30"]
    meta = LeRobotDatasetMetadata("local/test", root=root)
    r = open_dataset(root)
    assert meta.total_episodes == len(r.episodes)
    assert meta.fps == r.fps
    for ep in r.episodes:
        row = meta.episodes[ep.index]
        assert row["length"] == ep.length and tuple(row["tasks"]) == ep.tasks
        for key in r.video_keys:
            assert str(meta.get_video_file_path(ep.index, key)) == r.video_file(ep.index, key).relative_to(root).as_posix()
    assert {int(i): t for t, i in zip(meta.tasks.index, meta.tasks["task_index"], strict=True)} == r.tasks


def _many_episodes(root: Path, n: int) -> Path:
    """The v3.0 dataset's episode table grown to n episodes (rows of episode 0 and 1 repeated, new indices, one
    more per-episode stats column as LeRobot writes them); only the index is read, no data file."""
    path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    t = pq.read_table(path)
    rows = t.take(pa.array(np.arange(n) % t.num_rows))
    rows = rows.set_column(rows.schema.get_field_index("episode_index"), "episode_index",
                           pa.array(np.arange(n)[::-1].copy(), type=t.schema.field("episode_index").type))
    rows = rows.append_column("stats/state/mean", pa.array([[0.0] * 8] * n))
    pq.write_table(rows, path)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["total_episodes"] = n
    (root / "meta" / "info.json").write_text(json.dumps(info))
    return root


def test_the_episode_index_is_columns_of_a_few_dozen_bytes_per_episode(datasets, tmp_path):
    """The reader keeps its episode table as numpy columns: <= 64 bytes an episode in arrays and, after opening,
    no Python objects per episode (tracemalloc), whatever the dataset's size."""
    import gc
    import tracemalloc

    root = _many_episodes(_copy(datasets["v30"], tmp_path), 4000)
    open_dataset(root)  # imports and first-use caches out of the count
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    r = open_dataset(root)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    n = len(r.episodes)
    assert n == 4000
    assert held / n < 200, f"{held / n:.0f} bytes of Python objects per episode"
    assert r.episodes.nbytes() / n <= 64
    # the columns read as the episodes: sorted by index, each episode's own length, tasks and files
    assert [e.index for e in r.episodes[:3]] == [0, 1, 2] and r.episodes[-1].index == n - 1
    first = open_dataset(datasets["v30"]).episodes
    src = (n - 1 - np.arange(n)) % 2  # episode i came from row (n - 1 - i) % 2
    assert [r.episode(i) for i in (0, 1, 2)] == [Episode(i, first[src[i]].length, first[src[i]].tasks)
                                                  for i in (0, 1, 2)]
    assert r.from_timestamp(n - 1, CAMERAS[0]) == 0.0 and r.from_timestamp(n - 2, CAMERAS[0]) == pytest.approx(1.2)
    with pytest.raises(DataError, match="no episode 4000"):
        r.episode(n)


def test_an_episode_listed_twice_keeps_its_last_row(datasets, tmp_path):
    root = _copy(datasets["v30"], tmp_path)
    path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    t = pq.read_table(path)
    twice = pa.concat_tables([t, t.slice(0, 1).set_column(t.schema.get_field_index("length"), "length",
                                                          pa.array([3], type=t.schema.field("length").type))])
    pq.write_table(twice, path)
    r = open_dataset(root)
    assert [(e.index, e.length) for e in r.episodes] == [(0, 3), (1, LENGTHS["v30"][1])]
