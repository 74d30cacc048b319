"""Hostile numbers and bytes in a LeRobot dataset: NaN or infinity in a state or action, statistics that overflow,
an episode index outside the episode table, a video corrupted in the middle of its stream. Each is one clear error
that names the file (and episode, column or frame); nothing already written is lost, and no JSON holds NaN."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dzmodel.cli import main
from dzmodel.data.check import deep_check
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import open_dataset
from dzmodel.data.metadata import compute_metadata
from tests.data.lerobot_writers import CAMERAS, write_test_arm_yaml, write_v21, write_v30


def _set_value(parquet: Path, column: str, episode: int, frame: int, dim: int, value: float) -> None:
    """Write `value` into one cell of a vector column (the row of `episode`, `frame`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(parquet)
    rows = np.flatnonzero((table["episode_index"].to_numpy() == episode) & (table["frame_index"].to_numpy() == frame))
    col = table[column].combine_chunks()
    width = len(col[0].as_py())
    values = np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.float32).copy()
    values[int(rows[0]) * width + dim] = value
    new = (pa.FixedSizeListArray.from_arrays(pa.array(values), width) if pa.types.is_fixed_size_list(col.type)
           else pa.ListArray.from_arrays(pa.array(np.arange(0, len(values) + 1, width, dtype=np.int32)), pa.array(values)))
    pq.write_table(table.set_column(table.column_names.index(column), column, new), parquet)


@pytest.fixture()
def v30(tmp_path):
    return write_v30(tmp_path / "v30", lengths=(12, 10), cameras=CAMERAS)


@pytest.fixture()
def arm_yaml(tmp_path):
    return write_test_arm_yaml(tmp_path / "arm.yaml")


@pytest.mark.parametrize("column, value, shown", [
    ("observation.state", math.inf, "inf"), ("action", -math.inf, "-inf"), ("observation.state", math.nan, "nan")])
def test_data_check_refuses_a_non_finite_state_or_action(v30, column, value, shown, capsys):
    parquet = v30 / "data/chunk-000/file-000.parquet"
    _set_value(parquet, column, episode=1, frame=3, dim=2, value=value)
    assert main(["data", "check", str(v30)]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if column in line)
    assert str(parquet) in line and "episode 1" in line and f"column {column!r}" in line, err
    assert f"{shown} at frame 3 (dim 2)" in line, err
    assert "Traceback" not in err


def test_metadata_refuses_infinity_and_keeps_what_was_written(v30, arm_yaml, tmp_path, capsys):
    out = tmp_path / "metadata.json"
    assert main(["data", "metadata", str(v30), "--embodiment", "test_arm", "--embodiments", str(arm_yaml),
                 "--out", str(out)]) == 0
    before = out.read_bytes()
    parquet = v30 / "data/chunk-000/file-000.parquet"
    _set_value(parquet, "observation.state", episode=0, frame=5, dim=1, value=math.inf)
    assert main(["data", "metadata", str(v30), "--embodiment", "test_arm", "--embodiments", str(arm_yaml),
                 "--out", str(out), "--merge"]) == 2
    err = capsys.readouterr().err
    assert str(parquet) in err and "episode 0" in err and "column 'observation.state'" in err, err
    errors = [line for line in err.splitlines() if line.startswith("dz: ")]
    assert len(errors) == 1 and "inf at frame 5 (dim 1)" in errors[0], err
    assert out.read_bytes() == before  # the earlier metadata.json is untouched


def test_statistics_that_overflow_are_refused_not_written_as_infinity(v30, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = v30 / "data/chunk-000/file-000.parquet"
    table = pq.read_table(parquet)
    huge = np.full((table.num_rows, 3), 1.5e308)  # finite float64 values whose sum is not
    column = pa.FixedSizeListArray.from_arrays(pa.array(huge.ravel()), 3)
    pq.write_table(table.set_column(table.column_names.index("action"), "action", column), parquet)
    out = tmp_path / "meta.json"
    with pytest.raises(DataError, match=r"action.action: the statistics overflow float64 \(mean, std\)"):
        compute_metadata(v30, "test_arm", {"state": "observation.state"}, {"action": "action"}, out, progress=False)
    assert not out.exists()


def test_merging_into_a_metadata_file_that_holds_nan_is_one_error(v30, tmp_path):
    out = tmp_path / "meta.json"
    out.write_text('{"other_arm": {"statistics": {"state": {"x": {"mean": [NaN]}}}}}')
    before = out.read_bytes()
    with pytest.raises(DataError, match=r"meta.json: other_arm.statistics.state.x.mean\[0\] is nan"):
        compute_metadata(v30, "test_arm", {"state": "observation.state"}, {"action": "action"}, out, merge=True,
                         progress=False)
    assert out.read_bytes() == before


@pytest.mark.parametrize("edit, field", [
    (lambda info: info["features"]["observation.images.front"]["info"].update({"video.fps": float("inf")}), "fps"),
    (lambda info: info["features"]["observation.images.front"].update(shape=[48, "wide", 3]), "shape"),
    (lambda info: info["features"]["observation.images.front"].update(shape=None), "shape"),
    (lambda info: info["features"].update({"observation.images.front": "video"}), "observation.images.front"),
    (lambda info: info.update(features=[1, 2]), "features"),
    (lambda info: info["features"]["observation.state"].update(shape=["x"]), "shape"),
])
def test_metadata_names_a_hostile_info_json_field(v30, edit, field, tmp_path):
    info_path = v30 / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    edit(info)
    info_path.write_text(json.dumps(info))
    with pytest.raises(DataError) as exc:
        compute_metadata(v30, "test_arm", {"state": "observation.state"}, {"action": "action"}, tmp_path / "m.json",
                         progress=False)
    assert "info.json" in str(exc.value) and field in str(exc.value), str(exc.value)
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("edit, field", [
    (lambda info: info.update(fps=float("inf")), "fps"),
    (lambda info: info.update(chunks_size="many"), "chunks_size"),
    (lambda info: info["features"]["observation.state"].update(shape=["x"]), "shape"),
    (lambda info: info.update(features=[1, 2]), "features"),
])
def test_every_reader_names_a_hostile_info_json_field(v30, edit, field):
    """Training, eval and `dz data check` open datasets through the same reader: one DataError, not a TypeError."""
    from dzmodel.data.lerobot_format import open_dataset

    info_path = v30 / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    edit(info)
    info_path.write_text(json.dumps(info))
    with pytest.raises(DataError) as exc:
        open_dataset(v30)
    assert "info.json" in str(exc.value) and field in str(exc.value), str(exc.value)


def test_an_episode_index_outside_the_table_is_one_error_naming_the_range(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = write_v30(tmp_path / "v30", lengths=(12, 9))
    for path in (root / "meta/episodes/chunk-000/file-000.parquet", root / "data/chunk-000/file-000.parquet"):
        table = pq.read_table(path)
        episodes = table["episode_index"].to_numpy().copy()
        episodes[episodes == 1] = 7
        pq.write_table(table.set_column(table.column_names.index("episode_index"), "episode_index",
                                        pa.array(episodes)), path)
    assert main(["data", "check", str(root)]) == 2
    err = capsys.readouterr().err
    assert f"{root}: episode index 7 is outside 0..1" in err and "Traceback" not in err, err
    assert "IndexError" not in err


def _corrupt_keyframe(path: Path, frame: int) -> None:
    """Overwrite the second half of the packet that holds `frame` (a keyframe at or before it) with fixed noise."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        target = None
        for packet in container.demux(stream):
            if packet.pts is not None and packet.is_keyframe and float(packet.pts * stream.time_base) * 10 <= frame + 0.5:
                target = (packet.pos, packet.size)
    pos, size = target
    data = bytearray(path.read_bytes())
    data[pos + size // 2:pos + size] = np.random.default_rng(0).integers(0, 256, size - size // 2, np.uint8).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("codec", ["libx264", "libsvtav1"])
def test_deep_check_finds_a_corruption_in_the_middle_of_a_stream(tmp_path, codec, capsys):
    root = write_v30(tmp_path / "v30", lengths=(20, 20), cameras=CAMERAS[:1], codec=codec)
    video = open_dataset(root).video_file(0, CAMERAS[0])
    _corrupt_keyframe(video, frame=26)
    assert main(["data", "check", str(root)]) == 0  # the container and its header are intact
    capsys.readouterr()
    assert main(["data", "check", str(root), "--deep"]) == 2
    err = capsys.readouterr().err
    line = next((line for line in err.splitlines() if str(video) in line), err)
    assert "frame 26 (episode 1, frame 6) does not decode (frames 0..25 do)" in line, err


@pytest.mark.parametrize("codec, gop", [("libx264", 2), ("libx264", 16), ("libsvtav1", 2), ("libsvtav1", 16)])
def test_deep_check_passes_clean_videos(tmp_path, codec, gop):
    from dzmodel.data.video import encode_video
    from tests.data.lerobot_writers import frame_rgb

    root = write_v21(tmp_path / "v21", lengths=(30,), cameras=CAMERAS[:1], codec=codec)
    video = open_dataset(root).video_file(0, CAMERAS[0])
    rng = np.random.default_rng(1)  # textured frames: more bits per frame than the flat test colours
    frames = np.stack([np.clip(frame_rgb(0, i).astype(int) + rng.integers(0, 60, (48, 64, 3)), 0, 255).astype(np.uint8)
                       for i in range(30)])
    encode_video(video, frames, 10, codec=codec, gop=gop)
    assert deep_check(open_dataset(root)) == []
