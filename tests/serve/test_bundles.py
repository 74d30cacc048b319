"""The bundle cache: verified while extracting, capped, nothing left on refusal, stale entries replaced."""

import hashlib
import io
import tarfile

import pytest

from dzmodel.serve.bundles import COMPLETE, BundleError, ExtractLimits, cached_bundle
from dzmodel.serve.package import PackageError, load_package


def _manifest(files: dict[str, bytes]) -> bytes:
    return "".join(f"{hashlib.sha256(d).hexdigest()}  {len(d)}  {n}\n" for n, d in sorted(files.items())).encode()


def _tarball(path, members: list[tuple[str, bytes]], top="b-1.0"):
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(top)
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


FILES = {"robot.json": b"{}", "model/w.bin": b"\x00" * 1000}


def test_extracts_once_into_the_cache_and_reuses_it(tmp_path):
    tb = _tarball(tmp_path / "b.tar.gz", [("MANIFEST", _manifest(FILES)), *FILES.items()])
    root, fresh = cached_bundle(tb, tmp_path / "cache")
    assert fresh and (root / "model" / "w.bin").read_bytes() == FILES["model/w.bin"]
    assert root.parent.name == hashlib.sha256(tb.read_bytes()).hexdigest() and (root.parent / COMPLETE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.gz", "cache"]
    again, fresh = cached_bundle(tb, tmp_path / "cache")
    assert again == root and not fresh


@pytest.mark.parametrize("members, match", [
    ([("MANIFEST", _manifest(FILES)), ("robot.json", b"{}"), ("model/w.bin", b"\x01" * 1000)], "checksum mismatch"),
    ([("MANIFEST", _manifest(FILES)), *FILES.items(), ("extra.py", b"x")], "extra.py is not listed"),
    ([("MANIFEST", _manifest(FILES)), ("robot.json", b"{}")], "model/w.bin is listed in MANIFEST but missing"),
    ([("MANIFEST", _manifest(FILES)), ("robot.json", b"{}"), ("model/w.bin", b"\x00" * 999)], "MANIFEST says 1000"),
    ([*FILES.items()], "no MANIFEST"),
    ([("MANIFEST", b"not a manifest\n")], "malformed MANIFEST"),
])
def test_a_refused_tarball_leaves_nothing_behind(tmp_path, members, match):
    tb = _tarball(tmp_path / "b.tar.gz", members)
    with pytest.raises(BundleError, match=match):
        cached_bundle(tb, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_decompression_bomb_stops_at_the_cap(tmp_path):
    big = b"\x00" * (4 << 20)  # compresses to a few KB
    tb = _tarball(tmp_path / "bomb.tar.gz", [("a.bin", big), ("b.bin", big), ("c.bin", big)])
    assert tb.stat().st_size < 64 << 10
    with pytest.raises(BundleError, match="exceeds the extraction cap|no MANIFEST before"):
        cached_bundle(tb, tmp_path / "cache", ExtractLimits(max_total_bytes=6 << 20))
    assert list((tmp_path / "cache").iterdir()) == []
    # a MANIFEST that lists small files caps the rest at its total, before anything big is written
    tb2 = _tarball(tmp_path / "bomb2.tar.gz", [("MANIFEST", _manifest({"a.bin": b"x"})), ("a.bin", big)])
    with pytest.raises(BundleError, match="exceeds the extraction cap|MANIFEST says 1"):
        cached_bundle(tb2, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("name, match", [("../x", "escapes"), ("/etc/x", "escapes"), ("other/x", "one top-level")])
def test_members_outside_the_bundle_are_refused(tmp_path, name, match):
    tb = tmp_path / "evil.tar.gz"
    with tarfile.open(tb, "w:gz") as tar:
        for n, data in (("b-1.0/MANIFEST", _manifest({"robot.json": b"x"})), (name, b"x")):
            info = tarfile.TarInfo(n)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match=match):
        cached_bundle(tb, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_links_and_garbage_are_refused(tmp_path):
    tb = tmp_path / "link.tar.gz"
    with tarfile.open(tb, "w:gz") as tar:
        info = tarfile.TarInfo("b-1.0/robot.json")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(BundleError, match="link or device"):
        cached_bundle(tb, tmp_path / "cache")
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"definitely not gzip")
    with pytest.raises(BundleError, match="not a gzip tarball|corrupt"):
        cached_bundle(junk, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_stale_or_tampered_cache_entry_never_blocks_the_good_tarball(tmp_path):
    files = {**FILES, "embodiment.json": b"{}", "robot.json": (
        b'{"robot_ip": "127.0.0.1", "camera_serials": ["a"], "target_ee_pose": [0.5, 0, 0.3, 0, 0, 0], '
        b'"workspace_min": [0, -1, 0], "workspace_max": [1, 1, 1]}')}
    tb = _tarball(tmp_path / "b.tar.gz", [("MANIFEST", _manifest(files)), *files.items()])
    cache = tmp_path / "cache"
    root = load_package(tb, cache).root
    (root / "model" / "w.bin").write_bytes(b"tampered")            # a modified cached copy
    assert (load_package(tb, cache).root / "model" / "w.bin").read_bytes() == FILES["model/w.bin"]
    (root.parent / COMPLETE).unlink()                               # an interrupted extraction
    (root / "robot.json").unlink()
    assert load_package(tb, cache).root == root and (root / "robot.json").is_file()
    assert [p.name for p in cache.iterdir()] == [root.parent.name]
    with pytest.raises(PackageError, match="no such bundle"):
        load_package(tmp_path / "missing.tar.gz", cache)
