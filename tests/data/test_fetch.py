"""fetch_dataset: local copies, a fake hub, the synthetic source; atomic, idempotent, verified."""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("av")

from dzmodel.data import fetch as F  # noqa: E402
from dzmodel.data.errors import DataError  # noqa: E402
from dzmodel.data.fetch import fetch_dataset, marker_path  # noqa: E402
from dzmodel.data.lerobot_format import open_dataset  # noqa: E402
from tests.data.lerobot_writers import CAMERAS, write_v21, write_v30  # noqa: E402


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return write_v30(tmp_path_factory.mktemp("src") / "tiny_v30", (5, 4), codec="libx264", cameras=CAMERAS[:1])


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _leftovers(dest_root: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in dest_root.iterdir() if p.name not in keep)


# ------------------------------------------------------------------------------------ local


def test_fetch_local(src, tmp_path):
    dest_root = tmp_path / "datasets"
    out = fetch_dataset(str(src), dest_root)
    assert out == dest_root / "tiny_v30"
    assert _files(out) == _files(src)
    open_dataset(out).check()
    marker = marker_path(out)
    assert marker == dest_root / "tiny_v30.dz_fetch.json" and marker.is_file()
    rec = json.loads(marker.read_text())
    assert rec["kind"] == "local" and rec["source"] == str(src.resolve())
    assert not any(p.name.endswith(".dz_fetch.json") for p in out.rglob("*"))  # marker is beside, not inside
    assert _leftovers(dest_root, {"tiny_v30", "tiny_v30.dz_fetch.json"}) == []


def test_fetch_idempotent(src, tmp_path, monkeypatch):
    dest_root = tmp_path / "d"
    out = fetch_dataset(str(src), dest_root)
    mtime = marker_path(out).stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("fetched again")

    monkeypatch.setattr(F, "_copy_local", boom)
    assert fetch_dataset(str(src), dest_root) == out
    assert marker_path(out).stat().st_mtime_ns == mtime


def test_fetch_refetches_damaged_or_changed(src, tmp_path):
    dest_root = tmp_path / "d"
    out = fetch_dataset(str(src), dest_root)
    (out / "data/chunk-000/file-000.parquet").unlink()  # damaged copy -> fetched again
    assert fetch_dataset(str(src), dest_root) == out
    open_dataset(out).check()
    # different allow_patterns -> fetched again (here: meta + data only, files not verified)
    out2 = fetch_dataset(str(src), dest_root, allow_patterns=["meta/", "data/*"], verify_files=False)
    assert out2 == out and not (out / "videos").exists()
    assert json.loads(marker_path(out).read_text())["allow_patterns"] == ["meta/", "data/*"]


def test_fetch_local_name_and_conflicts(src, tmp_path):
    dest_root = tmp_path / "d"
    assert fetch_dataset(str(src), dest_root, name="other") == dest_root / "other"
    (dest_root / "foreign").mkdir()
    with pytest.raises(DataError, match="no fetch marker"):
        fetch_dataset(str(src), dest_root, name="foreign")
    other_src = write_v21(tmp_path / "tiny_v30", (3,), codec="libx264", cameras=())  # same basename
    fetch_dataset(str(src), dest_root)
    with pytest.raises(DataError, match="holds local source"):
        fetch_dataset(str(other_src), dest_root)


def test_fetch_local_incomplete_leaves_nothing(src, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / f"videos/{CAMERAS[0]}/chunk-000/file-000.mp4").unlink()
    dest_root = tmp_path / "d"
    with pytest.raises(DataError, match="missing file") as ei:
        fetch_dataset(str(broken), dest_root)
    assert f"videos/{CAMERAS[0]}/chunk-000/file-000.mp4" in str(ei.value)
    assert list(dest_root.iterdir()) == []


def test_fetch_bad_sources(tmp_path):
    with pytest.raises(DataError, match="neither an existing local directory"):
        fetch_dataset("./does/not/exist", tmp_path)
    not_ds = tmp_path / "plain"
    not_ds.mkdir()
    (not_ds / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="info.json: missing"):
        fetch_dataset(str(not_ds), tmp_path / "d")
    assert list((tmp_path / "d").iterdir()) == []
    with pytest.raises(DataError, match="synth_kwargs"):
        fetch_dataset(str(not_ds), tmp_path / "d", synth_kwargs={"num_episodes": 2})


# ------------------------------------------------------------------------------------ hub


class FakeHub:
    """Stands in for huggingface_hub.snapshot_download: copies a local dataset honouring allow_patterns."""

    def __init__(self, repos: dict[str, Path], fail_after: int | None = None):
        self.repos = repos
        self.calls: list[dict] = []
        self.fail_after = fail_after

    def __call__(self, repo_id, *, repo_type=None, revision=None, allow_patterns=None, local_dir=None, **kw):
        self.calls.append(dict(repo_id=repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns, local_dir=local_dir, **kw))
        from huggingface_hub.errors import RepositoryNotFoundError

        if repo_id not in self.repos:
            raise RepositoryNotFoundError(f"404 Client Error: Repository Not Found for url: {repo_id}")
        src, dst = self.repos[repo_id], Path(local_dir)
        (dst / ".cache/huggingface").mkdir(parents=True, exist_ok=True)
        pats = None if allow_patterns is None else [p + "*" if p.endswith("/") else p for p in allow_patterns]
        for n, p in enumerate(sorted(q for q in src.rglob("*") if q.is_file())):
            if self.fail_after is not None and n >= self.fail_after:
                raise OSError("connection reset by peer")
            rel = p.relative_to(src).as_posix()
            if pats is None or any(fnmatch.fnmatch(rel, pat) for pat in pats):
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dst / rel)
        return str(dst)


def test_fetch_hub(src, tmp_path, monkeypatch):
    import huggingface_hub

    hub = FakeHub({"lerobot/tiny": src})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    dest_root = tmp_path / "d"
    pats = ["meta/*", "data/*", "videos/*"]
    out = fetch_dataset("lerobot/tiny", dest_root, revision="abc123", allow_patterns=pats)
    assert out == dest_root / "tiny"
    assert len(hub.calls) == 1
    call = hub.calls[0]
    assert call["repo_id"] == "lerobot/tiny" and call["repo_type"] == "dataset"
    assert call["revision"] == "abc123" and call["allow_patterns"] == pats
    assert Path(call["local_dir"]).parent == dest_root and Path(call["local_dir"]) != out  # built beside, then renamed
    assert _files(out) == _files(src)  # hub bookkeeping (.cache) dropped
    rec = json.loads(marker_path(out).read_text())
    assert (rec["kind"], rec["source"], rec["revision"]) == ("hub", "lerobot/tiny", "abc123")
    # idempotent; a new revision fetches again
    assert fetch_dataset("lerobot/tiny", dest_root, revision="abc123", allow_patterns=pats) == out
    assert len(hub.calls) == 1
    fetch_dataset("lerobot/tiny", dest_root, revision="def456", allow_patterns=pats)
    assert len(hub.calls) == 2 and json.loads(marker_path(out).read_text())["revision"] == "def456"
    assert _leftovers(dest_root, {"tiny", "tiny.dz_fetch.json"}) == []


def test_fetch_hub_needs_revision(tmp_path):
    with pytest.raises(DataError, match="pinned revision"):
        fetch_dataset("lerobot/libero_10_image", tmp_path)


def test_fetch_hub_partial_download_fails_clean(src, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({"lerobot/tiny": src}))
    dest_root = tmp_path / "d"
    with pytest.raises(DataError, match="failed verification.*missing file") as ei:
        fetch_dataset("lerobot/tiny", dest_root, revision="r1", allow_patterns=["meta/", "data/"])
    assert "videos/" in str(ei.value)
    assert list(dest_root.iterdir()) == []


def test_fetch_hub_error_mid_download_fails_clean(src, tmp_path, monkeypatch):
    import huggingface_hub

    hub = FakeHub({"lerobot/tiny": src}, fail_after=2)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the online hint; `make test` exports HF_HUB_OFFLINE=1
    dest_root = tmp_path / "d"
    with pytest.raises(DataError, match="cannot download dataset 'lerobot/tiny' at revision 'r1'.*connection reset"):
        fetch_dataset("lerobot/tiny", dest_root, revision="r1", retries=2, retry_delay_s=0)
    assert len(hub.calls) == 3  # a connection reset is transient: tried 1 + 2 times
    assert list(dest_root.iterdir()) == []
    with pytest.raises(DataError, match="RepositoryNotFoundError.*check the repo id"):
        fetch_dataset("lerobot/nope", dest_root, revision="r1", retries=2, retry_delay_s=0)
    assert len(hub.calls) == 4  # not found is an answer: no retry
    assert list(dest_root.iterdir()) == []


class _HTTPError(Exception):
    def __init__(self, status):
        super().__init__(f"{status} Server Error")
        self.response = type("Response", (), {"status_code": status})()


def test_fetch_hub_retries_transient_errors_then_succeeds(src, tmp_path, monkeypatch):
    """A hub that fails twice (a timeout, then a 503) and then answers: the fetch succeeds on the third try, with
    exponential backoff; a 403 is not retried."""
    import huggingface_hub

    from dzmodel.data import fetch as fetch_module

    copy = FakeHub({"lerobot/tiny": src})
    failures = [TimeoutError("read timed out"), _HTTPError(503)]
    calls, sleeps = [], []

    def flaky(repo_id, **kw):
        calls.append(repo_id)
        if failures:
            raise failures.pop(0)
        return copy(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", flaky)
    monkeypatch.setattr(fetch_module.time, "sleep", sleeps.append)
    out = fetch_dataset("lerobot/tiny", tmp_path / "d", revision="r1", retries=3, retry_delay_s=2.0)
    assert len(calls) == 3 and sleeps == [2.0, 4.0] and _files(out) == _files(src)
    assert fetch_module.is_transient(_HTTPError(429)) and not fetch_module.is_transient(_HTTPError(403))
    assert not fetch_module.is_transient(DataError("bad data")) and not fetch_module.is_transient(FileNotFoundError())


def test_fetch_hub_offline(tmp_path, monkeypatch):
    """The real snapshot_download in offline mode (no network touched) surfaces as a DataError."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_home/hub"))
    dest_root = tmp_path / "d"
    with pytest.raises(DataError, match="cannot download dataset 'lerobot/libero_10_image'.*offline") as ei:
        fetch_dataset("lerobot/libero_10_image", dest_root, revision="main")
    assert "HF_HUB_OFFLINE" in str(ei.value)
    assert list(dest_root.iterdir()) == []


# ------------------------------------------------------------------------------------ synthetic


def test_fetch_synthetic_fake(tmp_path, monkeypatch):
    from dzmodel.data import synth

    seen = []

    def fake(out_dir, **kw):
        seen.append((Path(out_dir), kw))
        assert not Path(out_dir).exists()
        return write_v30(Path(out_dir), (3, 2), codec="libx264", cameras=CAMERAS[:1])

    monkeypatch.setattr(synth, "make_synthetic_dataset", fake)
    dest_root = tmp_path / "d"
    out = fetch_dataset("synthetic", dest_root, synth_kwargs={"num_episodes": 2})
    assert out == dest_root / "synthetic" and [e.length for e in open_dataset(out).episodes] == [3, 2]
    assert seen[0][1] == {"num_episodes": 2} and seen[0][0].parent == dest_root
    fetch_dataset("synthetic", dest_root, synth_kwargs={"num_episodes": 2})
    assert len(seen) == 1  # idempotent
    fetch_dataset("synthetic", dest_root, synth_kwargs={"num_episodes": 3})
    assert len(seen) == 2  # new kwargs -> rebuilt
    assert _leftovers(dest_root, {"synthetic", "synthetic.dz_fetch.json"}) == []


def test_fetch_synthetic_real(tmp_path):
    """The real generator (dzmodel.data.synth), tiny, read back through the reader."""
    out = fetch_dataset(
        "synthetic", tmp_path, synth_kwargs=dict(num_episodes=2, episode_length=6, image_size=32, codec="libx264")
    )
    r = open_dataset(out)
    assert [e.length for e in r.episodes] == [6, 6]
    frames = r.read_frames(1, r.video_keys[0], [5, 0])
    assert frames.shape == (2, 32, 32, 3)


# ------------------------------------------------------------------------------------ libero


def test_libero_source_is_recorded_by_the_callers_recorder(src, tmp_path):
    """The data layer does not import the LIBERO recorder (it lives above it): the caller passes one."""
    with pytest.raises(DataError, match="source 'libero' is recorded"):
        fetch_dataset("libero", tmp_path / "none", record_kwargs={"tasks": [0]})
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())
    seen = []

    def recorder(kwargs, out):
        seen.append(kwargs)
        shutil.copytree(src, out)

    out = fetch_dataset("libero", tmp_path / "datasets", name="rec", record_kwargs={"tasks": [0]}, recorder=recorder)
    assert seen == [{"tasks": [0]}] and len(open_dataset(out).episodes) == 2
    assert fetch_dataset("libero", tmp_path / "datasets", name="rec", record_kwargs={"tasks": [0]},
                         recorder=recorder) == out and len(seen) == 1  # the marker matches: not recorded again
