"""A LeRobot dataset's metadata files and tables under hostile contents.

Every metadata file (meta/info.json, the episode and task tables, meta/stats.json) is read only when it is a regular
file inside the dataset after symlinks; a FIFO among the data files is passed over, never opened; episode tables,
task lists, task texts and the columns read from a data file are bounded from the parquet footer (or the line count)
before anything is read into memory; malformed rows, deeply nested JSON and absurd numbers are one DataError naming
the file (and line), with quoted values cut short."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dzmodel.data import lerobot_format
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import open_dataset
from tests.data.lerobot_writers import CAMERAS, write_test_arm_yaml, write_v21, write_v30
from tests.hostile.guarded import run_guarded
from tests.hostile.test_dataset_paths import _dz, _one_error

MARKER = "OUTSIDE-THE-DATASET-77e0b2"
EPISODES_V3 = "meta/episodes/chunk-000/file-000.parquet"
DATA_V3 = "data/chunk-000/file-000.parquet"


@pytest.fixture()
def v30(tmp_path) -> Path:
    return write_v30(tmp_path / "ds", lengths=(12, 10), cameras=())


@pytest.fixture()
def v21(tmp_path) -> Path:
    return write_v21(tmp_path / "ds", lengths=(12, 10), cameras=())


def _move_outside(root: Path, rel: str, tmp_path: Path) -> Path:
    """Move the dataset's file `rel` out of the dataset and leave a symlink to it in its place."""
    outside = tmp_path / "outside" / rel.replace("/", "_")
    outside.parent.mkdir(exist_ok=True)
    shutil.move(root / rel, outside)
    (root / rel).symlink_to(outside)
    return outside


# ---------------------------------------------------------------- metadata files outside the dataset

@pytest.mark.parametrize("version, rel", [
    ("v2.1", "meta/tasks.jsonl"), ("v2.1", "meta/episodes.jsonl"), ("v2.1", "meta/info.json"),
    ("v3.0", "meta/tasks.parquet"), ("v3.0", EPISODES_V3), ("v3.0", "meta/info.json"),
])
def test_a_metadata_file_linked_from_outside_is_refused_unless_allowed(version, rel, tmp_path):
    root = (write_v21 if version == "v2.1" else write_v30)(tmp_path / "ds", lengths=(12, 10), cameras=())
    outside = _move_outside(root, rel, tmp_path)
    with pytest.raises(DataError) as e:
        open_dataset(root)
    assert str(root / rel) in str(e.value) and str(outside) in str(e.value) and "outside" in str(e.value)
    assert len(open_dataset(root, allow_outside=True).episodes) == 2


def test_data_check_never_prints_a_linked_tasks_file(v21, tmp_path, capsys):
    outside = _move_outside(v21, "meta/tasks.jsonl", tmp_path)
    outside.write_text(json.dumps({"task_index": 0, "task": MARKER}) + "\n" + json.dumps({"task": MARKER}) + "\n")
    code, out, err = _dz(["data", "check", v21], capsys)
    line = _one_error(err)
    assert code != 0 and "outside" in line and MARKER not in out + err


def test_a_metadata_fifo_is_refused(v21):
    (v21 / "meta/tasks.jsonl").unlink()
    os.mkfifo(v21 / "meta/tasks.jsonl")
    with pytest.raises(DataError, match="not a regular file"):
        open_dataset(v21)


def test_lerobot_never_reads_a_stats_file_linked_from_outside(v30, tmp_path):
    pytest.importorskip("lerobot")
    secret = tmp_path / "outside" / "stats.json"
    secret.parent.mkdir()
    secret.write_text(json.dumps({"observation.state": {"mean": [0.0] * 4, "note": MARKER}}))
    (v30 / "meta/stats.json").symlink_to(secret)
    reader = open_dataset(v30)
    with pytest.raises(DataError) as e:
        lerobot_format.crosscheck_with_lerobot(reader)
    assert "outside" in str(e.value) and MARKER not in str(e.value)


def test_a_deeply_nested_stats_file_is_one_error(v30):
    pytest.importorskip("lerobot")
    (v30 / "meta/stats.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="stats.json: invalid JSON"):
        lerobot_format.crosscheck_with_lerobot(open_dataset(v30))


# ---------------------------------------------------------------- FIFOs among the data files

def test_a_fifo_among_the_data_files_is_passed_over_by_the_statistics(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: `dz data metadata` once waited forever."""
    root = write_v30(tmp_path / "ds", lengths=(12, 10), cameras=CAMERAS)
    arm = write_test_arm_yaml(tmp_path / "arm.yaml")
    os.mkfifo(root / "data/chunk-000/zz.parquet")
    outcome = run_guarded(
        "from dzmodel.cli import main\n",
        f"print('EXIT', main(['data', 'metadata', {str(root)!r}, '--embodiment', 'test_arm', '--embodiments', "
        f"{str(arm)!r}, '--out', {str(tmp_path / 'm.json')!r}]))\n",
        timeout_s=60)
    assert not outcome.killed and "EXIT 0" in outcome.out, outcome.out[-2000:]
    assert json.loads((tmp_path / "m.json").read_text())


# ---------------------------------------------------------------- task lists and texts

def _replace_tasks(root: Path, column) -> None:
    path = root / EPISODES_V3
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.column_names.index("tasks"), "tasks", column), path, compression="zstd")


def _repeated_tasks(counts: list[int], text: str = "pick up the red block"):
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    values = pa.DictionaryArray.from_arrays(pa.array(np.zeros(int(offsets[-1]), dtype=np.int32)),
                                            pa.array([text])).dictionary_decode()
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def test_a_task_list_of_millions_of_copies_is_refused_from_the_footer(v30):
    _replace_tasks(v30, _repeated_tasks([2_000_000, 1]))
    outcome = run_guarded(f"from dzmodel.data.lerobot_format import open_dataset\nroot = {str(v30)!r}\n",
                          "try:\n    open_dataset(root)\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    assert "DataError" in outcome.out and EPISODES_V3 in outcome.out and "task texts" in outcome.out, outcome.out
    assert outcome.growth_mb < 150, outcome.growth_mb


def test_an_episode_listing_too_many_tasks_is_refused(v30):
    _replace_tasks(v30, _repeated_tasks([lerobot_format.MAX_TASKS_PER_EPISODE + 1, 1]))
    with pytest.raises(DataError, match=f"{EPISODES_V3}: tasks: an episode lists at most"):
        open_dataset(v30)


def test_a_task_text_of_a_megabyte_is_refused(v30):
    _replace_tasks(v30, _repeated_tasks([1, 1], "x" * 2**20))
    with pytest.raises(DataError, match="a task text of 1048576 bytes"):
        open_dataset(v30)


# ---------------------------------------------------------------- episode counts

def test_an_episode_table_of_a_million_and_one_episodes_is_refused_from_the_footer(v30):
    n = lerobot_format.MAX_EPISODES + 1
    idx = np.arange(n, dtype=np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    pq.write_table(pa.table({"episode_index": idx, "length": zeros, "data/chunk_index": zeros,
                             "data/file_index": zeros}), v30 / EPISODES_V3, compression="zstd")
    outcome = run_guarded(f"from dzmodel.data.lerobot_format import open_dataset\nroot = {str(v30)!r}\n",
                          "try:\n    open_dataset(root)\nexcept Exception as e:\n    print(type(e).__name__, e)\n",
                          timeout_s=60)
    assert "DataError" in outcome.out and "more than 1000000 episodes" in outcome.out, outcome.out[-2000:]
    assert outcome.elapsed < 5 and outcome.growth_mb < 150, (outcome.elapsed, outcome.growth_mb)


def test_an_episodes_jsonl_of_a_million_and_one_lines_is_refused_before_parsing(v21):
    n = lerobot_format.MAX_EPISODES + 1
    (v21 / "meta/episodes.jsonl").write_text("".join(f'{{"episode_index": {i}, "length": 0}}\n' for i in range(n)))
    outcome = run_guarded(f"from dzmodel.data.lerobot_format import open_dataset\nroot = {str(v21)!r}\n",
                          "try:\n    open_dataset(root)\nexcept Exception as e:\n    print(type(e).__name__, e)\n",
                          timeout_s=60)
    assert "DataError" in outcome.out and "episodes.jsonl: 1000001 lines" in outcome.out, outcome.out[-2000:]
    assert outcome.elapsed < 5, outcome.elapsed


# ---------------------------------------------------------------- columns that unpack to gigabytes

def _add_wide_column(root: Path, name: str, width: int = 10**7) -> None:
    """A list column of `width` zeros per row, one row group per row: a few kilobytes on disk."""
    path = root / DATA_V3
    table = pq.read_table(path)
    zeros = pa.array(np.zeros(width, dtype=np.float32))
    one_row = pa.ListArray.from_arrays(pa.array([0, width], pa.int32()), zeros)
    table = table.append_column(name, pa.chunked_array([one_row] * table.num_rows))
    pq.write_table(table, path, compression="zstd", row_group_size=1)


def test_an_undeclared_column_of_gigabytes_is_not_read_by_data_check(v30):
    _add_wide_column(v30, "junk")
    assert (v30 / DATA_V3).stat().st_size < 1_000_000
    outcome = run_guarded(f"from dzmodel.data.lerobot_format import open_dataset\n"
                          f"from dzmodel.data.check import dataset_problems\nreader = open_dataset({str(v30)!r})\n",
                          "print('PROBLEMS', dataset_problems(reader))\n", timeout_s=60)
    assert "PROBLEMS []" in outcome.out, outcome.out[-2000:]
    assert outcome.growth_mb < 300, outcome.growth_mb


def test_a_declared_column_of_gigabytes_is_refused_by_name_before_reading(v30):
    _add_wide_column(v30, "junk")
    info = json.loads((v30 / "meta/info.json").read_text())
    info["features"]["junk"] = {"dtype": "float32", "shape": [10**7]}
    (v30 / "meta/info.json").write_text(json.dumps(info))
    body = """
for name, run in (("check", lambda: dataset_problems(reader)),
                  ("scan", lambda: list(iter_batches([reader.root / 'data/chunk-000/file-000.parquet'], ['junk'],
                                                     1024, None)))):
    try:
        run()
        print(name, 'READ')
    except Exception as e:
        print(name, type(e).__name__, e)
"""
    outcome = run_guarded(f"from dzmodel.data.lerobot_format import open_dataset\n"
                          f"from dzmodel.data.check import dataset_problems\n"
                          f"from dzmodel.data.metadata_scan import iter_batches\nreader = open_dataset({str(v30)!r})\n",
                          body, timeout_s=60)
    lines = outcome.lines()
    for name in ("check", "scan"):
        line = next((x for x in lines if x.startswith(name + " ")), f"{outcome.killed} {outcome.out[-2000:]}")
        assert "DataError" in line and DATA_V3 in line and "'junk'" in line and "MiB once read" in line, line
    assert outcome.growth_mb < 300, outcome.growth_mb


# ---------------------------------------------------------------- malformed rows: one line naming the file

def _v21_edit(root: Path, rel: str, text: str) -> None:
    (root / rel).write_text(text)


@pytest.mark.parametrize("rel, text, where", [
    ("meta/info.json", "[" * 100_000, "meta/info.json: invalid JSON"),
    ("meta/info.json", '{"fps": ' + "9" * 5000 + "}", "meta/info.json: invalid JSON"),
    ("meta/episodes.jsonl", json.dumps({"episode_index": 2**70, "length": 1}), "meta/episodes.jsonl:1: episode_index"),
    ("meta/episodes.jsonl", json.dumps({"episode_index": 0, "length": 12, "tasks": 5}), "meta/episodes.jsonl:1: tasks"),
    ("meta/episodes.jsonl", json.dumps({"episode_index": 0, "length": 12, "tasks": [1]}),
     "meta/episodes.jsonl:1: tasks"),
    ("meta/tasks.jsonl", json.dumps({"task_index": None, "task": "a"}), "meta/tasks.jsonl:1: task_index"),
    ("meta/tasks.jsonl", json.dumps({"task_index": [0], "task": "a"}), "meta/tasks.jsonl:1: task_index"),
    ("meta/tasks.jsonl", json.dumps({"task_index": "x", "task": "a"}), "meta/tasks.jsonl:1: task_index"),
    ("meta/tasks.jsonl", json.dumps("task_index and task"), "meta/tasks.jsonl:1: each line needs"),
    ("meta/tasks.jsonl", json.dumps({"task_index": 0, "task": {"a": 1}}), "meta/tasks.jsonl:1: task must be"),
])
def test_a_malformed_metadata_row_is_one_error_naming_the_file_and_line(v21, rel, text, where):
    _v21_edit(v21, rel, text + "\n")
    with pytest.raises(DataError) as e:
        open_dataset(v21)
    assert str(v21 / where.split(":")[0]) in str(e.value) and where in str(e.value), str(e.value)[:500]
    assert len(str(e.value)) < 600


def test_a_malformed_row_through_data_check_is_one_line(v21, capsys):
    _v21_edit(v21, "meta/episodes.jsonl", json.dumps({"episode_index": 2**70, "length": 1}) + "\n")
    code, _, err = _dz(["data", "check", v21], capsys)
    assert code != 0 and "episodes.jsonl:1" in _one_error(err)


# ---------------------------------------------------------------- error lines stay short

def test_a_megabyte_row_is_quoted_short(v21):
    _v21_edit(v21, "meta/tasks.jsonl", json.dumps({"task_index": 0, "text": "y" * 2**20}) + "\n")
    with pytest.raises(DataError, match="each line needs") as e:
        open_dataset(v21)
    assert len(str(e.value)) < 600


def test_a_megabyte_feature_name_is_quoted_short(v21):
    info = json.loads((v21 / "meta/info.json").read_text())
    info["features"]["K" * 2**20] = {"dtype": 5}
    (v21 / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="features.KKK") as e:
        open_dataset(v21)
    assert len(str(e.value)) < 600


def test_a_total_of_thousands_of_digits_is_quoted_short(v21):
    info = json.loads((v21 / "meta/info.json").read_text())
    info["total_frames"] = int("7" * 4000)
    (v21 / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="total_frames=777") as e:
        open_dataset(v21).check()
    assert len(str(e.value)) < 600


# ---------------------------------------------------------------- fps

@pytest.mark.parametrize("fps", [1e-300, 0.01])
def test_an_absurd_fps_is_refused(v21, fps):
    info = json.loads((v21 / "meta/info.json").read_text())
    info["fps"] = fps
    (v21 / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="fps: must be a number in"):
        open_dataset(v21)


# ---------------------------------------------------------------- out of memory, as a last resort

def test_running_out_of_memory_in_data_check_is_one_line(v30, capsys, monkeypatch):
    import pyarrow as pa

    from dzmodel.data import check

    def exhausted(reader):
        raise pa.ArrowMemoryError("malloc of size 40000064 failed")

    monkeypatch.setattr(check, "dataset_problems", exhausted)
    code, _, err = _dz(["data", "check", v30], capsys)
    line = _one_error(err)
    assert code != 0 and str(v30) in line and "ran out of memory" in line
