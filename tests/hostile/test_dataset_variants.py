"""More hostile datasets: what the reader, `dz data check`, `dz data fetch` and an s3:// dataset's cache do with them.

A video start time (v3.0 `from_timestamp`) that is not a finite number of seconds is refused when the dataset opens,
not mid-training; the declared lengths are checked against a data file's rows without reading its episode column
whole; metadata JSON files are bounded in bytes before they are parsed, and a JSON-lines file line by line; a local
fetch copies regular files only (never a device or a FIFO); an s3:// listing whose keys climb out of the dataset is
refused before anything is downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dzmodel.cli import main
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import open_dataset
from tests.data.lerobot_writers import CAMERAS, write_v21, write_v30
from tests.hostile.guarded import run_guarded


@pytest.fixture()
def v30(tmp_path) -> Path:
    return write_v30(tmp_path / "ds", lengths=(12, 10), cameras=CAMERAS)


@pytest.fixture()
def v21(tmp_path) -> Path:
    return write_v21(tmp_path / "ds", lengths=(12, 10), cameras=CAMERAS, codec="libx264")


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dz: error: "), err
    assert "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- video start times


def _set_from_timestamp(root: Path, episode: int, value: float) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    name = f"videos/{CAMERAS[0]}/from_timestamp"
    column = table[name].to_numpy().copy()
    column[episode] = value
    pq.write_table(table.set_column(table.column_names.index(name), name, pa.array(column)), path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -5.0, 1e300])
def test_a_video_start_time_that_is_not_a_time_is_refused_on_open(v30, value, capsys):
    _set_from_timestamp(v30, 1, value)
    with pytest.raises(DataError, match=r"file-000\.parquet: videos/observation\.images\.front/from_timestamp: "
                                        r"episode 1"):
        open_dataset(v30)
    assert main(["data", "check", str(v30)]) == 2
    assert "from_timestamp" in _one_error(capsys)


# ---------------------------------------------------------------- declared lengths against a file's rows


def _grow_data_file(root: Path, rows: int) -> Path:
    """Append `rows` rows of one more episode (a constant column: a few hundred KB on disk) to the data file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    block_rows = 1_000_000
    block = {}
    for field in table.schema:
        first = table.slice(0, 1)[field.name]
        block[field.name] = pa.concat_arrays([first.combine_chunks()] * 1).take(np.zeros(block_rows, dtype=np.int64))
    block["episode_index"] = pa.array(np.full(block_rows, 7, dtype=np.int64))
    block = pa.table(block).cast(table.schema)
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, table.schema) as writer:
        writer.write_table(table)
        for _ in range(rows // block_rows):
            writer.write_table(block)
    tmp.replace(path)
    return path


def test_the_length_check_reads_a_huge_episode_column_in_batches(v30):
    """20 million rows of an episode the table does not list: checking the declared lengths reads the episode column
    batch by batch (its 160 MB, and a sort of it, never at once)."""
    _grow_data_file(v30, 20_000_000)
    out = run_guarded(f"""
        from dzmodel.data.lerobot_format import open_dataset
        reader = open_dataset({str(v30)!r})
        """, """
        print("PROBLEMS", reader.length_problems())
        """, timeout_s=60)
    assert out.rc == 0 and not out.killed, out.out
    assert "PROBLEMS []" in out.out, out.out
    assert out.growth_mb < 100, f"{out.growth_mb:.0f} MB"


# ---------------------------------------------------------------- metadata files bounded before parsing


def test_a_stats_file_of_many_megabytes_is_refused_before_parsing(v30, capsys):
    stats = v30 / "meta/stats.json"
    stats.write_text('{"x": [' + "0.0," * 2_000_000 + "0.0]}")  # 8 MB: a gigabyte once parsed at this rate
    from dzmodel.data.lerobot_format import crosscheck_with_lerobot

    with pytest.raises(DataError, match=r"stats\.json: .* bytes; at most"):
        crosscheck_with_lerobot(open_dataset(v30))


def test_an_info_file_of_many_megabytes_is_refused_before_parsing(v30, capsys):
    info = v30 / "meta/info.json"
    doc = json.loads(info.read_text())
    doc["padding"] = [[]] * 3_000_000
    info.write_text(json.dumps(doc))
    assert main(["data", "check", str(v30)]) == 2
    assert "info.json" in _one_error(capsys)
    with pytest.raises(DataError, match=r"info\.json: .* bytes; at most"):
        from dzmodel.data.metadata_scan import load_info

        load_info(v30)


def test_a_megabytes_long_line_of_an_episodes_file_is_refused_before_parsing(v21):
    """One line of 50 MB of empty lists would be more than a gigabyte once parsed."""
    path = v21 / "meta/episodes.jsonl"
    lines = path.read_text().splitlines()
    row = json.loads(lines[0])
    with path.open("w") as fh:
        fh.write(json.dumps(row)[:-1] + ', "junk": [' + "[]," * 17_000_000 + "[]]}\n")
        fh.write("\n".join(lines[1:]) + "\n")
    out = run_guarded(f"""
        from dzmodel.data.errors import DataError
        from dzmodel.data.lerobot_format import open_dataset
        """, f"""
        try:
            open_dataset({str(v21)!r})
        except DataError as e:
            print("REFUSED", e)
        """, timeout_s=60)
    assert not out.killed, out.out
    assert "REFUSED" in out.out and "episodes.jsonl:1:" in out.out, out.out
    assert out.growth_mb < 100 and out.elapsed < 5, (out.growth_mb, out.elapsed)


# ---------------------------------------------------------------- dz data fetch from a local folder


def test_fetching_a_folder_with_a_device_or_fifo_is_refused_before_copying(v30, tmp_path):
    """When a hard link is not possible (another file system), files are copied: a link to /dev/zero would be copied
    until the disk is full. Anything but a regular file is refused by name first."""
    os.symlink("/dev/zero", v30 / "meta/zeros.bin")
    os.mkfifo(v30 / "meta/pipe")
    dest = tmp_path / "datasets"
    out = run_guarded(f"""
        import os, resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (50 * 2**20, 50 * 2**20))
        def no_link(src, dst, **kw):
            raise OSError(18, "Invalid cross-device link")
        os.link = no_link
        from dzmodel.data.errors import DataError
        from dzmodel.data.fetch import fetch_dataset
        """, f"""
        try:
            fetch_dataset({str(v30)!r}, {str(dest)!r})
        except DataError as e:
            print("REFUSED", e)
        """, timeout_s=30)
    assert not out.killed, out.out
    assert "REFUSED" in out.out and "meta/pipe" in out.out and "not a regular file" in out.out, out.out
    assert out.elapsed < 5
    assert not list(dest.iterdir()) if dest.exists() else True


# ---------------------------------------------------------------- s3:// keys


class _Bucket:
    """A stand-in for boto3's S3 client over a dict of keys (what the listing says is all that matters here)."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects

    def get_paginator(self, name):
        objects = self.objects

        class Pages:
            def paginate(self, Bucket, Prefix):  # noqa: N803 - boto3's names
                yield {"Contents": [{"Key": k, "Size": len(v)} for k, v in objects.items() if k.startswith(Prefix)]}

        return Pages()

    def download_file(self, bucket, key, path):
        Path(path).write_bytes(self.objects[key])


@pytest.mark.parametrize("key", ["meta/../../../../escaped.txt", "meta/./x/../../../../escaped.txt",
                                 "/escaped.txt", "meta//x", "meta/a\\..\\x"])
def test_an_s3_key_that_leaves_the_dataset_is_refused_before_any_download(v30, tmp_path, monkeypatch, key):
    from dzmodel.data import remote

    objects = {f"lake/ds/{p.relative_to(v30).as_posix()}": p.read_bytes() for p in v30.rglob("*") if p.is_file()}
    objects[f"lake/ds/{key}"] = b"written outside the cache"
    bucket = _Bucket(objects)
    monkeypatch.setattr(remote, "_client", lambda: bucket)
    cache = tmp_path / "a" / "b" / "c" / "cache"
    with pytest.raises(DataError, match="not a plain relative path"):
        remote.S3Mirror("s3://bucket/lake/ds", cache_dir=cache)
    written = [p for p in tmp_path.rglob("escaped.txt")]
    assert not written and not (cache / "bucket").exists()


# ---------------------------------------------------------------- index columns of a v3.0 episode table


@pytest.mark.parametrize("column, value", [("episode_index", float("nan")), ("episode_index", -1.0),
                                           ("data/chunk_index", float("nan")), ("data/file_index", 2.5)])
def test_an_index_that_is_not_a_whole_number_is_one_error(v30, column, value, capsys):
    """A float index column holding a NaN would be cast to an arbitrary index (with numpy's warning printed first)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = v30 / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    values = table[column].to_numpy().astype(np.float64)
    values[1 if column == "episode_index" else 0] = value
    pq.write_table(table.set_column(table.column_names.index(column), column, pa.array(values)), path)
    assert main(["data", "check", str(v30)]) == 2
    line = _one_error(capsys)
    assert f"file-000.parquet: {column}: row" in line and "must be an integer" in line, line
