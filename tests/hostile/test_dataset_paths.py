"""A LeRobot dataset is a folder: hostile meta/info.json templates and episode tables.

A path template (`data_path`, `video_path`) that climbs out of the dataset, is absolute, or reaches outside through a
symlink is refused before any file is read, in one line naming meta/info.json, the field and the resolved path. A
template's format specs are checked before anything is formatted (known fields, widths up to 32, nothing else). A
declared episode length is bounded and checked against the data parquet's rows before anything is sized by it, and a
state or action column holding fewer values per row than info.json declares is refused by name."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dzmodel.cli import main
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import open_dataset
from tests.data.lerobot_writers import CAMERAS, STATE_DIM, write_test_arm_yaml, write_v21, write_v30

MARKER = b"OUTSIDE-THE-DATASET-4f1c9a"
REPO = Path(__file__).resolve().parents[2]


def _write(version: str, root: Path) -> Path:
    if version == "v2.1":
        return write_v21(root, lengths=(12, 10), cameras=CAMERAS, codec="libx264")
    return write_v30(root, lengths=(12, 10), cameras=CAMERAS)


@pytest.fixture(params=["v2.1", "v3.0"])
def dataset(request, tmp_path) -> Path:
    return _write(request.param, tmp_path / "ds")


@pytest.fixture()
def v30(tmp_path) -> Path:
    return _write("v3.0", tmp_path / "ds")


@pytest.fixture()
def v21(tmp_path) -> Path:
    return _write("v2.1", tmp_path / "ds")


@pytest.fixture()
def arm_yaml(tmp_path) -> Path:
    return write_test_arm_yaml(tmp_path / "arm.yaml")


@pytest.fixture()
def secret(tmp_path) -> Path:
    """A file outside the dataset whose bytes must never reach the output."""
    path = tmp_path / "outside" / "secret.mp4"
    path.parent.mkdir()
    path.write_bytes(MARKER + b"\0" * 64)
    return path


def _edit_info(root: Path, **fields) -> None:
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    info.update(fields)
    path.write_text(json.dumps(info))


def _set_length(root: Path, episode: int, length: int) -> Path:
    """Declare `length` for `episode` in the episode table; the table's file."""
    if (root / "meta/episodes.jsonl").is_file():
        path = root / "meta/episodes.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[episode]["length"] = length
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    lengths = table["length"].to_numpy().copy()
    lengths[episode] = length
    pq.write_table(table.set_column(table.column_names.index("length"), "length", pa.array(lengths)), path)
    return path


class _Opens:
    """Every path Python opens while active (an audit hook: builtins.open, io.open, pathlib, os.open)."""

    active: "list[str] | None" = None
    installed = False

    def __enter__(self):
        if not _Opens.installed:
            sys.addaudithook(_Opens._hook)
            _Opens.installed = True
        _Opens.active = self.paths = []
        return self

    def __exit__(self, *exc):
        _Opens.active = None

    @staticmethod
    def _hook(event, args):
        if event == "open" and _Opens.active is not None and args and isinstance(args[0], (str, bytes, os.PathLike)):
            _Opens.active.append(os.fsdecode(args[0]))


def _dz(args: list[str], capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dz: error: "), err
    assert "Traceback" not in err and "dz --debug" not in err, err
    return lines[0]


def _window_dataset(root: Path, arm_yaml: Path):
    """The dataset class training reads through (`train.windows.training_windows` builds it the same way)."""
    from dzmodel.data.dataset import WindowDataset
    from dzmodel.data.embodiments import get_embodiment, load_embodiments
    from dzmodel.data.sampling import WindowSpec

    emb = get_embodiment("test_arm", load_embodiments([arm_yaml]))
    return WindowDataset(open_dataset(root), emb, WindowSpec(2, 4, 8), statistics=None)


# ---------------------------------------------------------------- paths outside the dataset


def test_a_video_path_climbing_out_of_the_dataset_is_refused_before_any_read(dataset, secret, arm_yaml, tmp_path,
                                                                              capsys):
    _edit_info(dataset, video_path=os.path.relpath(secret, dataset))  # ../outside/secret.mp4
    with _Opens() as opens:
        code, out, err = _dz(["data", "check", dataset], capsys)
        code_m, out_m, err_m = _dz(["data", "metadata", dataset, "--embodiment", "test_arm", "--embodiments",
                                    arm_yaml, "--out", tmp_path / "m.json"], capsys)
        with pytest.raises(DataError) as exc:
            _window_dataset(dataset, arm_yaml)
    assert code == 2 and code_m == 2
    for line in (_one_error(err), _one_error(err_m), str(exc.value)):
        assert "meta/info.json" in line and "video_path" in line and str(secret.resolve()) in line, line
        assert len(line.splitlines()) == 1, line
    assert MARKER.decode() not in out + err + out_m + err_m
    assert str(secret) not in opens.paths and str(secret.resolve()) not in opens.paths
    assert not (tmp_path / "m.json").exists()


def test_an_absolute_data_path_is_refused(v21, tmp_path, arm_yaml, capsys):
    import shutil

    other = tmp_path / "other" / "episode.parquet"  # a real parquet elsewhere: it would train
    other.parent.mkdir()
    shutil.copy(v21 / "data/chunk-000/episode_000000.parquet", other)
    _edit_info(v21, data_path=str(other))
    with _Opens() as opens:
        code, _, err = _dz(["data", "check", v21], capsys)
        with pytest.raises(DataError) as exc:
            _window_dataset(v21, arm_yaml)
    line = _one_error(err)
    for text in (line, str(exc.value)):
        assert "meta/info.json" in text and "data_path" in text and "absolute" in text and str(other) in text, text
    assert str(other) not in opens.paths


def test_an_absolute_video_path_is_refused(v30, secret, capsys):
    _edit_info(v30, video_path=str(secret.parent) + "/{video_key}.mp4")
    line = _one_error(_dz(["data", "check", v30], capsys)[2])
    assert "meta/info.json" in line and "video_path" in line and "absolute" in line, line


def test_a_video_key_that_climbs_out_is_refused(v21, tmp_path):
    """The feature names go into video_path too."""
    info = json.loads((v21 / "meta/info.json").read_text())
    info["features"]["../../../outside"] = info["features"].pop(CAMERAS[1])
    (v21 / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="video_path") as exc:
        open_dataset(v21)
    assert "meta/info.json" in str(exc.value) and "outside the dataset" in str(exc.value)


def test_a_symlinked_directory_reaching_outside_is_refused_unless_allowed(v30, tmp_path, capsys):
    store = tmp_path / "store"
    (v30 / "data").rename(store)
    (v30 / "data").symlink_to(store)
    with pytest.raises(DataError) as exc:
        open_dataset(v30)
    text = str(exc.value)
    assert "meta/info.json" in text and "data_path" in text and str(store / "chunk-000/file-000.parquet") in text
    reader = open_dataset(v30, allow_outside=True)  # a deliberate setting: a dataset whose files live elsewhere
    assert reader.data_file(0).resolve() == store / "chunk-000/file-000.parquet"
    assert _dz(["data", "check", v30, "--allow-outside-root"], capsys)[0] == 0
    arm = write_test_arm_yaml(tmp_path / "arm.yaml")
    assert _dz(["data", "metadata", v30, "--embodiment", "test_arm", "--embodiments", arm, "--out",
                tmp_path / "m.json", "--allow-outside-root"], capsys)[0] == 0


def test_metadata_refuses_a_data_file_linked_from_outside(v30, arm_yaml, tmp_path, capsys):
    """The statistics read every parquet under data/, not only those the episode table names."""
    import shutil

    other = tmp_path / "elsewhere" / "file-001.parquet"
    other.parent.mkdir()
    shutil.copy(v30 / "data/chunk-000/file-000.parquet", other)
    (v30 / "data/chunk-000/file-001.parquet").symlink_to(other)
    line = _one_error(_dz(["data", "metadata", v30, "--embodiment", "test_arm", "--embodiments", arm_yaml,
                           "--out", tmp_path / "m.json"], capsys)[2])
    assert str(v30 / "data/chunk-000/file-001.parquet") in line and str(other) in line and "outside" in line, line
    assert not (tmp_path / "m.json").exists()


# ---------------------------------------------------------------- format specs


def test_a_format_width_of_a_hundred_million_is_a_short_error(dataset, capsys):
    field = "episode_index" if (dataset / "meta/episodes.jsonl").is_file() else "file_index"
    info = json.loads((dataset / "meta/info.json").read_text())
    _edit_info(dataset, data_path=info["data_path"].replace(f"{{{field}:", f"{{{field}:0100000000d}}{{{field}:"))
    start = time.monotonic()
    code, out, err = _dz(["data", "check", dataset], capsys)
    assert code == 2 and time.monotonic() - start < 10
    line = _one_error(err)
    assert len(err.encode()) < 1024, len(err)
    assert "meta/info.json" in line and "data_path" in line and "width" in line, line


@pytest.mark.parametrize("template, problem", [
    ("data/{episode_index!r}.parquet", "conversion"),
    ("data/{episode_index.real}.parquet", "field"),
    ("data/{episode_index[0]}.parquet", "field"),
    ("data/{secret}.parquet", "field"),
    ("data/{}.parquet", "field"),
    ("data/{episode_index:>10}.parquet", "format"),
    ("data/{episode_index:{episode_chunk}}.parquet", "format"),
    ("data/{episode_index:33d}.parquet", "width"),
    ("data/{episode_index.parquet", "template"),
])
def test_a_template_with_other_format_features_is_refused(v21, template, problem):
    _edit_info(v21, data_path=template)
    with pytest.raises(DataError) as exc:
        open_dataset(v21)
    text = str(exc.value)
    assert "meta/info.json" in text and "data_path" in text and problem in text, text
    assert len(text) < 1024


# ---------------------------------------------------------------- declared episode lengths


def test_a_length_that_disagrees_with_the_parquet_is_one_error_everywhere(dataset, arm_yaml, tmp_path, capsys):
    table = _set_length(dataset, 1, 11)  # the parquet holds 10 rows of episode 1
    data_file = open_dataset(dataset).data_file(1)
    code, _, err = _dz(["data", "check", dataset], capsys)
    assert code == 2 and "episode 1" in err and str(data_file) in err and "11" in err and "10 rows" in err, err
    line = _one_error(_dz(["data", "metadata", dataset, "--embodiment", "test_arm", "--embodiments", arm_yaml,
                           "--out", tmp_path / "m.json"], capsys)[2])
    assert "episode 1" in line and str(data_file) in line and "11" in line, line
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(DataError, match="episode 1") as exc:
        _window_dataset(dataset, arm_yaml)
    assert str(data_file) in str(exc.value) and table.name in str(exc.value) or "episode table" in str(exc.value)


_BILLION = """
import resource, sys, json
sys.path.insert(0, {repo!r})
resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))  # the 7.45 GiB allocation fails instead of swapping
from dzmodel.cli import main
code = {{}}
for name, args in {commands!r}:
    code[name] = main(args)
from dzmodel.data.errors import DataError
try:
    from tests.hostile.test_dataset_paths import _window_dataset
    from pathlib import Path
    ds = _window_dataset(Path({root!r}), Path({arm!r}))
    from dzmodel.data.sampling import SampleStream
    SampleStream([len(ds.index)], seed=0).peek(0)
    code["dataset"] = "built"
except DataError as exc:
    code["dataset"] = str(exc)
# VmHWM is this process's own peak; ru_maxrss would also count the parent's size at fork (kept across exec)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"codes": code, "maxrss_kib": peak}}))
"""


def test_a_declared_length_of_a_billion_is_refused_before_anything_is_sized_by_it(dataset, arm_yaml, tmp_path):
    _set_length(dataset, 0, 10**9)
    commands = [("check", ["data", "check", str(dataset)]),
                ("metadata", ["data", "metadata", str(dataset), "--embodiment", "test_arm", "--embodiments",
                              str(arm_yaml), "--out", str(tmp_path / "m.json")])]
    script = _BILLION.format(repo=str(REPO), commands=commands, root=str(dataset), arm=str(arm_yaml))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["codes"]["check"] == 2 and result["codes"]["metadata"] == 2, proc.stderr
    assert "episode 0" in result["codes"]["dataset"] and "1000000000" in result["codes"]["dataset"], result
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dz: error: ")]
    assert len(errors) == 2 and all("episode 0" in e and "1000000000" in e for e in errors), proc.stderr
    assert "Traceback" not in proc.stderr
    assert result["maxrss_kib"] < 3 * 2**20, result  # far below the 7.45 GiB a length of 1e9 would allocate
    assert elapsed < 60
    assert not (tmp_path / "m.json").exists()


def test_a_negative_or_non_integer_length_is_one_error(v21):
    path = v21 / "meta/episodes.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for bad in (-5, "twelve", 1.5):
        rows[0]["length"] = bad
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(DataError, match="episodes.jsonl") as exc:
            open_dataset(v21)
        assert "episode 0" in str(exc.value) and "length" in str(exc.value)


# ---------------------------------------------------------------- declared widths


def _declare_state_width(root: Path, width: int) -> None:
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    info["features"]["observation.state"]["shape"] = [width]
    path.write_text(json.dumps(info))


def test_a_state_column_narrower_than_declared_is_refused_by_data_check(dataset, arm_yaml, capsys):
    _declare_state_width(dataset, STATE_DIM + 2)
    data_file = open_dataset(dataset).data_file(0)
    code, _, err = _dz(["data", "check", dataset], capsys)
    assert code == 2, err
    line = next(line for line in err.splitlines() if "observation.state" in line)
    assert str(data_file) in line and f"{STATE_DIM} values" in line and f"[{STATE_DIM + 2}]" in line, err
    code, _, err = _dz(["data", "check", dataset, "--embodiment", "test_arm", "--embodiments", arm_yaml], capsys)
    assert code == 2 and "observation.state" in err, err


def test_the_training_dataset_names_a_state_column_narrower_than_declared(dataset, arm_yaml):
    _declare_state_width(dataset, STATE_DIM + 2)
    data_file = open_dataset(dataset).data_file(0)
    with pytest.raises(DataError) as exc:
        _window_dataset(dataset, arm_yaml)
    text = str(exc.value)
    assert str(data_file) in text and "'observation.state'" in text, text
    assert f"{STATE_DIM} values" in text and f"[{STATE_DIM + 2}]" in text, text


def test_reading_columns_checks_every_episode_against_the_declared_width(v21):
    """The check runs on every episode read, not only the first (a v2 dataset has a file per episode)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = v21 / "data/chunk-000/episode_000001.parquet"
    table = pq.read_table(path)
    narrow = pa.array([row[:-1] for row in table["observation.state"].to_pylist()], type=pa.list_(pa.float32()))
    pq.write_table(table.set_column(table.column_names.index("observation.state"), "observation.state", narrow), path)
    reader = open_dataset(v21)
    assert reader.read_columns(0, ["observation.state"])["observation.state"].shape == (12, STATE_DIM)
    with pytest.raises(DataError, match=rf"{path}: column 'observation.state' holds {STATE_DIM - 1} values"):
        reader.read_columns(1, ["observation.state"])


def test_a_clean_dataset_still_passes(dataset, arm_yaml, tmp_path, capsys):
    assert _dz(["data", "check", dataset, "--embodiment", "test_arm", "--embodiments", arm_yaml, "--chunks", "2"],
               capsys)[0] == 0
    assert _dz(["data", "metadata", dataset, "--embodiment", "test_arm", "--embodiments", arm_yaml,
                "--out", tmp_path / "m.json"], capsys)[0] == 0
    ds = _window_dataset(dataset, arm_yaml)
    assert ds.sample(0)["state"].shape == (2, STATE_DIM)
    assert np.isfinite(ds.sample(0)["action"].numpy()).all()
