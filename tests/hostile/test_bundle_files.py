"""Hostile bundles that would fill a disk, hang a loader or make the server accept enormous frames: tarball
directory members (deep, many, unlisted), a bundle folder's sparse file listed at a huge size, a listed file
swapped for a FIFO or a link, and an embodiment whose view size, layout, horizon or dims are absurd. Each is
refused with one line naming the file or field, within seconds, writing next to nothing."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml

from dzmodel.data.embodiments import load_embodiments, get_embodiment, parse_embodiment
from dzmodel.data.errors import DataError
from dzmodel.serve.bundles import BundleError, ExtractLimits, cached_bundle, file_sha256
from dzmodel.serve.package import PackageError, verified_copy, verify_package
from tests.hostile.guarded import run_guarded

TOP = "b-1.0"
GIB = 1 << 30
DATA = b"weights" * 100


def disk_used(folder: Path) -> tuple[int, int]:
    """(directories, bytes of disk blocks) under `folder`."""
    dirs, used = 0, 0
    for dirpath, dirnames, filenames in os.walk(folder):
        dirs += 1
        for name in dirnames + filenames:
            used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return dirs, used


def listing(files: dict[str, bytes]) -> bytes:
    return "".join(f"{hashlib.sha256(d).hexdigest()}  {len(d)}  {n}\n" for n, d in sorted(files.items())).encode()


def dir_bomb(path: Path, files: dict[str, bytes], members: int, depth: int) -> Path:
    """MANIFEST (listing `files`) first, then `members` directory members `b-1.0/dN/a/a/...` `depth` deep, then
    the files."""
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        top = tarfile.TarInfo(TOP)
        top.type = tarfile.DIRTYPE
        tar.addfile(top)
        manifest = listing(files)
        info = tarfile.TarInfo(f"{TOP}/MANIFEST")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        for i in range(members):
            d = tarfile.TarInfo(f"{TOP}/d{i}/" + "a/" * depth)
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{TOP}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# --- tarball directory members ----------------------------------------------------------------------


def test_a_tarball_of_an_empty_manifest_and_deep_directories_is_refused_and_creates_nothing(tmp_path):
    tb = dir_bomb(tmp_path / "b-1.0.tar.gz", {}, members=20, depth=30)
    cache = tmp_path / "cache"
    with pytest.raises(BundleError, match=r"b-1.0.tar.gz: MANIFEST lists no files"):
        cached_bundle(tb, cache)
    dirs, used = disk_used(cache)
    assert dirs == 1 and used < 64 << 10  # the cache folder itself; no entry, nothing cached


def test_directory_members_of_a_good_tarball_are_not_created(tmp_path):
    tb = dir_bomb(tmp_path / "b-1.0.tar.gz", {"model/w.bin": DATA}, members=20, depth=30)
    root, fresh = cached_bundle(tb, tmp_path / "cache")
    assert fresh and (root / "model/w.bin").read_bytes() == DATA
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == ["MANIFEST", "model", "model/w.bin"]
    assert disk_used(tmp_path / "cache")[0] <= 5  # cache, entry, bundle, model (no d0/a/a/...)


@pytest.mark.parametrize("depth", [800, 1200])
def test_a_member_path_hundreds_of_folders_deep_is_refused_in_one_line(tmp_path, depth):
    tb = dir_bomb(tmp_path / "b-1.0.tar.gz", {"model/w.bin": DATA}, members=2, depth=depth)
    with pytest.raises(BundleError, match=r"b-1.0.tar.gz: member 'b-1.0/d0/a/a/.*levels deep, over the limit of 32"):
        cached_bundle(tb, tmp_path / "cache")
    dirs, used = disk_used(tmp_path / "cache")
    assert dirs == 1 and used < 64 << 10


def test_files_spread_over_many_folders_count_against_the_member_cap(tmp_path):
    files = {f"d{i}/" + "x/" * 20 + "w.bin": DATA for i in range(10)}  # 10 members, 210 folders
    tb = dir_bomb(tmp_path / "b-1.0.tar.gz", files, members=0, depth=0)
    with pytest.raises(BundleError, match=r"more than 100 folders"):
        cached_bundle(tb, tmp_path / "cache", ExtractLimits(max_members=100))
    assert disk_used(tmp_path / "cache")[0] == 1


# --- a bundle folder's sparse file ------------------------------------------------------------------


def sparse_bundle(root: Path, actual: int, listed: int) -> Path:
    """A bundle folder whose model/w.bin is a sparse file of `actual` bytes (no disk), listed at `listed` bytes
    with a made-up sha256."""
    (root / "model").mkdir(parents=True)
    with open(root / "model/w.bin", "wb") as f:
        f.truncate(actual)
    (root / "MANIFEST").write_text(f"{'0' * 64}  {listed}  model/w.bin\n")
    return root


COPY_WATCHED = """
import os, threading, time
from pathlib import Path
from dzmodel.serve.package import PackageError, verified_copy
from dzmodel.serve.bundles import ExtractLimits
root, private = Path({root!r}), Path({private!r})
peak, stop = [0], [False]
def watch():
    while not stop[0]:
        used = 0
        for dirpath, _, files in os.walk(private):
            for name in files:
                try:
                    used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass
        peak[0] = max(peak[0], used)
        time.sleep(0.005)
watcher = threading.Thread(target=watch)
watcher.start()
"""


def copy_watched(tmp_path: Path, root: Path, limits: str = "ExtractLimits()"):
    private = tmp_path / "private"
    private.mkdir()
    body = f"""
try:
    verified_copy(root, private / root.name, None, limits={limits})
    print("ACCEPTED")
except PackageError as exc:
    print("REFUSED", exc)
finally:
    stop[0] = True
    watcher.join()
    print("PEAK", peak[0])
"""
    out = run_guarded(COPY_WATCHED.format(root=str(root), private=str(private)), body, timeout_s=30)
    lines = out.lines()
    peak = int(next(line.split()[1] for line in lines if line.startswith("PEAK ")))
    refused = [line for line in lines if line.startswith(("REFUSED ", "ACCEPTED"))]
    return out, refused, peak


def test_a_sparse_file_listed_at_100_gib_is_refused_before_any_byte_is_copied(tmp_path):
    root = sparse_bundle(tmp_path / TOP, 100 * GIB, 100 * GIB)
    out, refused, peak = copy_watched(tmp_path, root)
    assert not out.killed, out.out
    assert refused and refused[0].startswith("REFUSED") and "over the copy cap" in refused[0], out.out
    assert peak < 1 << 20 and out.elapsed < 5


def test_a_file_larger_than_its_listed_size_is_refused_before_any_byte_is_copied(tmp_path):
    root = sparse_bundle(tmp_path / TOP, GIB, 200 << 20)
    out, refused, peak = copy_watched(tmp_path, root)
    assert not out.killed, out.out
    assert refused and f"{root / 'model/w.bin'}: 1073741824 bytes, MANIFEST says 209715200" in refused[0], out.out
    assert peak < 1 << 20


def test_a_bundle_that_would_fill_the_private_folders_disk_is_refused_naming_tmpdir(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    size = max(free - (256 << 20), 1)  # fits the disk, but not with the free margin kept
    root = sparse_bundle(tmp_path / TOP, size, size)
    out, refused, peak = copy_watched(tmp_path, root, f"ExtractLimits(max_total_bytes={1 << 50}, "
                                                      f"max_member_bytes={1 << 50})")
    assert not out.killed, out.out
    assert refused and "set TMPDIR to a folder with room" in refused[0] and "bytes free" in refused[0], out.out
    assert peak < 1 << 20


# --- FIFOs and links in a bundle folder -------------------------------------------------------------


FIFO_SWAP = """
import hashlib, os
from pathlib import Path
import dzmodel.serve.package as P
root, private = Path({root!r}), Path({private!r})
(root / "model").mkdir(parents=True)
(root / "model/a.json").write_text("{{}}")
(root / "MANIFEST").write_text(hashlib.sha256(b"{{}}").hexdigest() + "  2  model/a.json\\n")
listed = P._listed_files
def swap_after_listing(*args, **kwargs):
    result = listed(*args, **kwargs)
    os.mkfifo(root / "model/a.json.new")
    os.replace(root / "model/a.json.new", root / "model/a.json")  # a FIFO with no writer
    return result
P._listed_files = swap_after_listing
"""


@pytest.mark.parametrize("copy", [True, False])
def test_a_listed_file_swapped_for_a_fifo_is_refused_instead_of_hanging(tmp_path, copy):
    root, private = tmp_path / TOP, tmp_path / "private"
    private.mkdir()
    call = "P.load_package(root, copy_to=private)" if copy else "P.verify_package(root)"
    body = f"""
try:
    {call}
    print("ACCEPTED")
except P.PackageError as exc:
    print("REFUSED", exc)
"""
    out = run_guarded(FIFO_SWAP.format(root=str(root), private=str(private)), body, timeout_s=15)
    assert not out.killed, out.out
    assert out.lines() == [f"REFUSED {root / 'model/a.json'}: not a regular file (a FIFO); refused"]


def test_file_sha256_of_a_fifo_is_refused_instead_of_hanging(tmp_path):
    fifo = tmp_path / "w.bin"
    os.mkfifo(fifo)
    out = run_guarded(f"""
from dzmodel.serve.bundles import BundleError, file_sha256
""", f"""
try:
    file_sha256({str(fifo)!r})
except BundleError as exc:
    print("REFUSED", exc)
""", timeout_s=15)
    assert not out.killed and out.lines() == [f"REFUSED {fifo}: not a regular file (a FIFO); refused"]


@pytest.mark.parametrize("target", ["file", "folder"])
def test_a_link_inside_a_bundle_folder_is_refused_by_name(tmp_path, target):
    root = tmp_path / TOP
    (root / "model").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "w.bin").write_bytes(DATA)
    if target == "file":
        (root / "model/w.bin").symlink_to(outside / "w.bin")
    else:
        (root / "model/enc").symlink_to(outside)
    name = "model/w.bin" if target == "file" else "model/enc/w.bin"
    (root / "MANIFEST").write_bytes(listing({name: DATA}))
    link = root / ("model/w.bin" if target == "file" else "model/enc")
    message = f"{link}: a symbolic link inside the bundle folder; a bundle holds plain files only"
    with pytest.raises(PackageError, match=message):
        verify_package(root)
    with pytest.raises(PackageError, match=message):
        verified_copy(root, tmp_path / "private")


# --- embodiments with absurd sizes ------------------------------------------------------------------


BASE = {"views": {"cam": "observation.images.cam"}, "view_size": [64, 64], "layout": [["cam"]],
        "state": {"s": {"column": "observation.state", "dim": 8}},
        "action": {"a": {"column": "action", "dim": 7}}, "action_horizon": 16}


@pytest.mark.parametrize("patch, field", [
    ({"view_size": [100000, 100000]}, "view_size"),
    ({"view_size": [64, 5000]}, "view_size"),
    ({"layout": [["cam*100000"]]}, "layout"),
    ({"layout": [["cam*0"]]}, "layout"),
    ({"layout": [["cam"]] * 100}, "layout"),
    ({"action_horizon": 1_000_000}, "action_horizon"),
    ({"state": {"s": {"column": "observation.state", "dim": 10**9}}}, "state.s.dim"),
    ({"action": {"a": {"column": "action", "slice": [0, 10**9]}}}, "action.a.slice"),
    ({"views": {f"v{i}": f"observation.images.v{i}" for i in range(100)}, "layout": [["v0"]]}, "views"),
    ({"tag_id": 10**12}, "tag_id"),
    ({"serve": {"images": {"image": "cam"}, "state": {"s": "s"},
                "roboarena": {"image_resolution": [100000, 100000], "needs_wrist_camera": False,
                              "n_external_cameras": 1, "needs_stereo_camera": False, "needs_session_id": False,
                              "action_space": "joint_position"}}}, "serve.roboarena.image_resolution"),
])
def test_an_embodiment_with_an_absurd_size_is_refused_naming_the_field(patch, field):
    with pytest.raises(DataError, match=rf"robots.yaml: embodiment 'arm', field '{field}': .*at most"):
        parse_embodiment("arm", {**BASE, **patch}, "robots.yaml")


def test_the_built_in_embodiments_are_within_the_bounds():
    registry = load_embodiments()
    assert registry and all(get_embodiment(tag, registry) for tag in registry)


def test_a_bundle_embodiment_file_with_a_huge_view_is_refused_naming_the_file_and_field(tmp_path):
    path = tmp_path / "libero.yaml"
    path.write_text(yaml.safe_dump({"arm": {**BASE, "view_size": [100000, 100000]}}))
    registry = load_embodiments([path])
    with pytest.raises(DataError, match=rf"{path}: embodiment 'arm', field 'view_size': .*at most 1024"):
        get_embodiment("arm", registry)


def test_file_sha256_still_hashes_a_plain_file(tmp_path):
    (tmp_path / "f").write_bytes(DATA)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(DATA).hexdigest()
