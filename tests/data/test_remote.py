"""s3:// datasets against a real S3-compatible server on loopback (moto): read as the local copy, fetched file by
file when read, within the cache's budget, and trained from."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import open_dataset
from dzmodel.data.remote import MARKER, S3Mirror
from tests.flows.servers import BIN, background, free_port
from tests.tiny_data import make_tabletop_data

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server with bucket `lake` holding the tabletop dataset under `robots/tabletop`."""
    boto3 = pytest.importorskip("boto3")
    if not (BIN / "moto_server").exists():
        pytest.skip("moto_server not installed (moto[server], the dev extra)")
    root = tmp_path_factory.mktemp("remote")
    data = make_tabletop_data(root / "local")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with background([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], dict(os.environ, **CREDS),
                    root / "moto.log", health=f"{url}/moto-api/"):
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                              region_name="us-east-1")
        client.create_bucket(Bucket="lake")
        for f in sorted((data / "ds").rglob("*")):
            if f.is_file():
                rel = f.relative_to(data / "ds").as_posix()
                client.upload_file(str(f), "lake", f"robots/tabletop/{rel}")
                # the same dataset with its first video file overwritten by junk of the same size
                broken = rel.startswith("videos/") and not any(k.startswith("robots/broken/videos/") for k in
                                                               _keys(client, "robots/broken/"))
                client.put_object(Bucket="lake", Key=f"robots/broken/{rel}",
                                  Body=b"\0" * f.stat().st_size if broken else f.read_bytes())
        yield dict(url=url, data=data, uri="s3://lake/robots/tabletop")


def _keys(client, prefix: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket="lake", Prefix=prefix).get("Contents", [])]


@pytest.fixture
def env(s3, tmp_path, monkeypatch):
    for k, v in {**CREDS, "AWS_ENDPOINT_URL": s3["url"], "DZ_DATA_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    return tmp_path / "cache"


def _fetched(reader) -> list[str]:
    return sorted(p.relative_to(reader.root).as_posix() for p in reader.root.rglob("*")
                  if p.is_file() and p.name != MARKER and not p.name.startswith("."))


def test_a_remote_dataset_reads_as_its_local_copy_and_fetches_only_what_is_read(s3, env):
    local = open_dataset(s3["data"] / "ds")
    remote = open_dataset(s3["uri"])
    assert remote.root.is_relative_to(env)
    remote.check()  # every file the episode table names exists in the bucket
    assert [(e.index, e.length, e.tasks) for e in remote.episodes] == [(e.index, e.length, e.tasks)
                                                                       for e in local.episodes]
    assert all(rel.startswith("meta/") for rel in _fetched(remote))  # opening fetched the index only
    key = local.video_keys[0]
    cols = [k for k, f in local.features.items() if f.dtype not in ("video", "image")]
    np.testing.assert_array_equal(remote.read_frames(1, key, [0, 5, 9]), local.read_frames(1, key, [0, 5, 9]))
    for k, v in remote.read_columns(1, cols).items():
        np.testing.assert_array_equal(v, local.read_columns(1, cols)[k])
    data_rel = local.data_file(1).relative_to(local.root).as_posix()
    video_rel = local.video_file(1, key).relative_to(local.root).as_posix()
    assert [r for r in _fetched(remote) if not r.startswith("meta/")] == sorted([data_rel, video_rel])


def test_the_cache_stays_within_its_budget_and_fetches_again_what_it_evicted(s3, env):
    local = open_dataset(s3["data"] / "ds")
    files = sorted({(local.video_file(e.index, k), e.index, k) for e in local.episodes for k in local.video_keys})
    assert len({f for f, _, _ in files}) >= 2
    budget = max(f.stat().st_size for f, _, _ in files) + 1  # one video file at a time
    os.environ["DZ_DATA_CACHE_GIB"] = str(budget / 2**30)
    try:
        remote = open_dataset(s3["uri"])
    finally:
        del os.environ["DZ_DATA_CACHE_GIB"]
    assert remote.remote.max_bytes == pytest.approx(budget, abs=1)
    for _, ep, key in files:
        remote.read_frames(ep, key, [0])
        assert remote.remote.cached_bytes() <= budget
    fetches = remote.remote.fetches
    _, ep, key = files[0]
    np.testing.assert_array_equal(remote.read_frames(ep, key, [3]), local.read_frames(ep, key, [3]))
    assert remote.remote.fetches == fetches + 1  # the first file had been evicted: fetched again
    assert (remote.root / "meta" / "info.json").is_file()  # the index is never evicted


def test_training_streams_from_the_bucket(s3, env):
    from dzmodel.train.config import TrainConfig
    from dzmodel.train.trainer import train

    data = s3["data"]
    cfg = TrainConfig(preset="tiny", datasets=[s3["uri"]], embodiment="tabletop_pusher",
                      embodiment_files=[str(data / "emb.yaml")], metadata=str(data / "meta.json"), steps=3,
                      save_every=0, out_dir=str(env.parent / "run"), progress=False, micro_batch=2, global_batch=2,
                      num_workers=0)
    history = train(cfg)
    assert [h["step"] for h in history] == [1, 2, 3] and all(np.isfinite(h["loss"]) for h in history)
    assert any(p.suffix == ".mp4" for p in env.rglob("*"))  # the videos came through the cache


def test_eviction_never_deletes_in_a_directory_it_did_not_make(s3, env):
    mirror = S3Mirror(s3["uri"], max_bytes=1)
    (mirror.root / MARKER).unlink()
    mine = mirror.root / "videos" / "someone_elses.mp4"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_bytes(b"x" * 100)
    assert mirror.evict() == 0 and mine.is_file()


def test_bad_uris_get_one_clear_error(s3, env):
    with pytest.raises(DataError, match="s3://lake/robots/nothing: no meta/info.json"):
        open_dataset("s3://lake/robots/nothing")
    with pytest.raises(DataError, match="s3://no-such-bucket/x: cannot list it"):
        open_dataset("s3://no-such-bucket/x")
    with pytest.raises(DataError, match="no bucket"):
        S3Mirror("s3:///x")


def test_dz_data_check_reads_every_remote_file_and_finds_a_broken_one(s3, env, capsys):
    from dzmodel.cli import main

    assert main(["data", "check", s3["uri"]]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{s3['uri']} (cached in ") and "every data file's footer opens" in out
    assert main(["data", "check", "s3://lake/robots/broken"]) != 0
    err = capsys.readouterr().err
    assert "1 problem(s)" in err and "file-000.mp4: not a video container" in err
