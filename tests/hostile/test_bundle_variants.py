"""Further hostile bundles and packaging inputs: two servers extracting one tarball at once, a bundle folder
named like the cache's own marker, names that would break an error message over lines, tarballs and folders
of very many entries, and model folders whose links or special files would leak a file into a bundle or fill
the disk while packaging."""

from __future__ import annotations

import gzip
import multiprocessing
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

import dzmodel.serve.package as package
from dzmodel.serve.bundles import BundleError, cached_bundle
from dzmodel.serve.package import PackageError, load_package
from tests.hostile.test_tar_bombs import ROBOT, TOP, Gzip, end, header, manifest, member
from tests.serve.test_package import ROBOT as FRANKA
from tests.serve.test_package import model  # noqa: F401  (the tiny converted model fixture)

ROOT = Path(__file__).resolve().parents[2]
FILES = {"robot.json": ROBOT, "model/w.bin": b"w" * 4096, "model/config.json": b"{}"}


def good_tarball(path: Path, top: str = TOP, files: dict[str, bytes] = FILES) -> Path:
    body = b"".join(member(f"{top}/{n}", d) for n, d in sorted(files.items()))
    return Gzip(path).write(header(top, kind=tarfile.DIRTYPE) + member(f"{top}/MANIFEST", manifest(files)) + body
                            + end()).close()


def one_line(error: str) -> None:
    assert "\n" not in error and "\r" not in error and "\x1b" not in error, repr(error)


# --- the bundle cache, shared by several servers ----------------------------------------------------------


def _serve_load(args) -> str:
    """What `dz serve` does with a tarball: its cached copy, then a verified private copy of it."""
    tarball, cache = args
    private = tempfile.mkdtemp()
    try:
        root, _ = package._cached_package(Path(tarball), cache)
        package.verified_copy(root, Path(private) / root.name, None, package._tarball_manifest_sha256(Path(tarball)))
        return "ok"
    except BaseException as exc:  # noqa: BLE001  every failure is counted, whatever its kind
        return f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(private)


def test_servers_started_together_on_one_tarball_all_load_it(tmp_path):
    files = {**FILES, **{f"model/part{i}.bin": bytes([i]) * 65536 for i in range(24)}}
    tb = good_tarball(tmp_path / "b.tar.gz", files=files)
    failures = []
    with multiprocessing.get_context("fork").Pool(4) as pool:
        for round_ in range(6):
            cache = tmp_path / f"cache{round_}"
            failures += [r for r in pool.map(_serve_load, [(tb, cache)] * 4) if r != "ok"]
    assert failures == []


def test_a_bundle_folder_named_like_the_cache_marker_is_refused_in_one_line(tmp_path):
    tb = good_tarball(tmp_path / "b.tar.gz", top=".complete")
    with pytest.raises(BundleError, match=r"\.complete") as err:
        cached_bundle(tb, tmp_path / "cache")
    one_line(str(err.value))
    assert list((tmp_path / "cache").iterdir()) == []


# --- names that would break a message over lines ----------------------------------------------------------


@pytest.mark.parametrize("name", ["robot.json\nINFO serving fine", "\x1b[2Jrobot.json", "w\rINFO ok"])
def test_a_tar_member_name_with_control_characters_is_quoted_in_its_error(tmp_path, name):
    body = member(f"{TOP}/MANIFEST", manifest(FILES)) + member(f"{TOP}/{name}", b"x")
    tb = Gzip(tmp_path / "b.tar.gz").write(header(TOP, kind=tarfile.DIRTYPE) + body + end()).close()
    with pytest.raises(BundleError, match="not listed") as err:
        cached_bundle(tb, tmp_path / "cache")
    one_line(str(err.value))


def bundle_folder(root: Path, files: dict[str, bytes] = FILES) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "MANIFEST").write_bytes(manifest(files))
    return root


@pytest.mark.parametrize("copy", [False, True])
def test_a_bundle_folder_file_name_with_control_characters_is_quoted_in_its_error(tmp_path, copy):
    root = bundle_folder(tmp_path / TOP)
    (root / "model" / "x\nINFO serving fine \x1b[2J").write_bytes(b"x")
    with pytest.raises(PackageError, match="not listed") as err:
        load_package(root, copy_to=tmp_path / "private" if copy else None)
    one_line(str(err.value))


# --- very many entries ---------------------------------------------------------------------------------


def test_a_tarball_of_the_most_directory_members_is_refused_within_a_second(tmp_path):
    tb = Gzip(tmp_path / "dirs.tar.gz").write(header(TOP, kind=tarfile.DIRTYPE)
                                              + header(f"{TOP}/", kind=tarfile.DIRTYPE) * 20_001 + end()).close()
    assert tb.stat().st_size < 100_000
    start = time.process_time()  # the CPU time the refusal costs, whatever else this machine runs
    with pytest.raises(BundleError, match="more than 20000 members"):
        cached_bundle(tb, tmp_path / "cache")
    assert time.process_time() - start < 1


def test_a_tarball_of_many_empty_gzip_members_is_refused_quickly(tmp_path):
    tb = good_tarball(tmp_path / "b.tar.gz")
    data = tb.read_bytes()
    tb.write_bytes(gzip.compress(b"") * 100_000 + data)  # 2 MB of gzip members that hold nothing
    start = time.perf_counter()
    with pytest.raises(BundleError, match="gzip members"):
        cached_bundle(tb, tmp_path / "cache")
    assert time.perf_counter() - start < 1


def test_a_tarball_of_many_gzip_members_written_by_a_block_writer_still_loads(tmp_path):
    tb = good_tarball(tmp_path / "b.tar.gz")
    raw = gzip.decompress(tb.read_bytes())
    tb.write_bytes(b"".join(gzip.compress(raw[i:i + 4096]) for i in range(0, len(raw), 4096)) + gzip.compress(b""))
    root, fresh = cached_bundle(tb, tmp_path / "cache")
    assert fresh and (root / "model" / "w.bin").read_bytes() == FILES["model/w.bin"]


def test_a_bundle_folder_of_very_many_files_is_refused_without_listing_them_all(tmp_path):
    root = bundle_folder(tmp_path / TOP)
    for d in range(30):
        junk = root / "junk" / str(d)
        junk.mkdir(parents=True)
        for i in range(1000):
            (junk / str(i)).touch()
    start = time.process_time()  # the CPU time the refusal costs, whatever else this machine runs
    with pytest.raises(PackageError, match="at most 20000 files"):
        load_package(root, copy_to=tmp_path / "private")
    assert time.process_time() - start < 1


# --- the model folder `dz package` copies ------------------------------------------------------------------


def packaged(hf: Path, tmp_path: Path, change) -> tuple[subprocess.CompletedProcess, Path]:
    """`dz package` of a copy of the tiny model with `change` applied to it, in a child limited to 64 MiB files."""
    mine = tmp_path / "model"
    shutil.copytree(hf, mine)
    change(mine)
    (tmp_path / "robot.json").write_text(__import__("json").dumps(FRANKA))
    out = tmp_path / "out"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20)); "
            "from dzmodel.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "package", str(mine), "--robot", str(tmp_path / "robot.json"),
                           "--version", "1.0.0", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return done, out


def assert_package_refused(done: subprocess.CompletedProcess, out: Path, match: str) -> None:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    error = done.stderr.strip()
    assert error.startswith("dz: error:") and match in error and "\n" not in error, error[-2000:]
    assert [p.name for p in out.iterdir() if not p.name.startswith(".dz-")] == [] if out.exists() else True


def test_a_link_in_the_model_folder_to_a_file_outside_it_is_not_packaged(model, tmp_path):  # noqa: F811
    _, hf = model
    secret = tmp_path / "id_ed25519"
    secret.write_text("PRIVATE KEY\n")
    done, out = packaged(hf, tmp_path, lambda m: (m / "tokenizer" / "extra.json").symlink_to(secret))
    assert_package_refused(done, out, "extra.json")


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "dangling"])
def test_a_special_file_in_the_model_folder_is_refused_in_one_line(model, tmp_path, kind):  # noqa: F811
    _, hf = model

    def plant(m: Path) -> None:
        target = m / "tokenizer" / "odd.json"
        if kind == "fifo":
            os.mkfifo(target)
        else:
            target.symlink_to(kind if kind != "dangling" else tmp_path / "gone")

    start = time.perf_counter()
    done, out = packaged(hf, tmp_path, plant)
    assert_package_refused(done, out, "odd.json")
    assert time.perf_counter() - start < 60


def test_a_link_inside_the_model_folder_to_its_own_file_is_packaged_as_a_copy(model, tmp_path):  # noqa: F811
    _, hf = model
    done, out = packaged(hf, tmp_path, lambda m: (m / "tokenizer" / "copy.json").symlink_to("tokenizer.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    bundle = out / "dreamzero-tabletop_pusher-1.0.0"
    copy = bundle / "model" / "tokenizer" / "copy.json"
    assert not copy.is_symlink() and copy.read_bytes() == (hf / "tokenizer" / "tokenizer.json").read_bytes()
    assert package.verify_package(bundle) > 5


# --- `dz serve models:/...`: servers started together download the version once -----------------------------


def _resolve(args) -> str:
    from tasks.resolver import pinned_registered_bundle

    uri, cache = args
    try:
        path, _ = pinned_registered_bundle(uri, cache_dir=cache)
        return "ok" if (Path(path) / "MANIFEST").is_file() else f"no MANIFEST at {path}"
    except BaseException as exc:  # noqa: BLE001  every failure is counted, whatever its kind
        return f"{type(exc).__name__}: {exc}"


def test_servers_started_together_on_one_registry_version_all_resolve_it(tmp_path, monkeypatch):
    from tests.hostile.test_registry_hostile import NAME, project, register  # noqa: F401

    from dzmodel.config import StagePaths, load_params
    from tasks.tracking import Tracker

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DZ_BUNDLE_ROOTS", raising=False)
    monkeypatch.chdir(tmp_path)
    prof = load_params(tmp_path / "params.yaml").selected("demo")
    paths = StagePaths(tmp_path, "demo")
    env = (tmp_path, prof, paths, Tracker.start(prof, "demo", paths))
    version, _ = register(env, "dreamzero-demo-7")
    failures = []
    with multiprocessing.get_context("fork").Pool(4) as pool:
        for round_ in range(4):
            job = (f"models:/{NAME}/{version}", tmp_path / f"cache{round_}")
            failures += [r for r in pool.map(_resolve, [job] * 4) if r != "ok"]
    assert failures == []
