"""Installs that cannot drift: the lock files are complete and exact, the Makefile installs only from them, and the
venv the tests run in holds what they lock (infra/lock.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK_PY = ROOT / "infra" / "lock.py"
LOCKS = [ROOT / "requirements.lock", ROOT / "requirements-libero.lock"]
ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\\n\s+--hash=sha256:([0-9a-f]{64})\b", re.M)


def lock_tool(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(LOCK_PY), *args], capture_output=True, text=True, timeout=120)


def entries(path: Path) -> dict[str, str]:
    return {re.sub(r"[-_.]+", "-", m[0]).lower(): m[1] for m in ENTRY.findall(path.read_text())}


@pytest.mark.parametrize("path", LOCKS, ids=lambda p: p.name)
def test_every_lock_line_is_an_exact_version_with_its_hash(path):
    text = path.read_text()
    requirements = [line for line in text.splitlines() if line and not line.startswith(("#", " "))]
    assert requirements, f"{path.name} is empty"
    assert len(entries(path)) == len(requirements), "a line without ==version and a sha256 hash"
    assert not any(">" in r or "<" in r or "~=" in r for r in requirements)


def test_the_locks_hold_the_project_pins_and_what_broke_before():
    """pyproject.toml's exact pins are the lock's versions (an edit without `make lock` fails here), and the
    packages that changed under the project unasked are locked: opencv-python (robosuite and hf-libero ask for it
    unpinned) and torch's local CPU build."""
    setup, libero = entries(LOCKS[0]), entries(LOCKS[1])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [r for extra in ("dev", "data", "serve", "pipeline", "libero")
            for r in project["optional-dependencies"][extra] if "==" in r]
    assert pins
    for req in pins:
        name, version = re.match(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==(\S+)", req).groups()
        name = re.sub(r"[-_.]+", "-", name).lower()
        assert {**setup, **libero}.get(name) == version, f"{req}: the lock has {name} {setup.get(name) or libero.get(name)}"
    assert setup["torch"] == "2.13.0+cpu"
    assert "opencv-python" in libero
    assert not set(setup) & set(libero), "requirements-libero.lock lists only what make libero adds"
    assert {"pip", "setuptools"} <= set(setup)


def test_the_makefile_installs_only_from_the_locks():
    """No pip call of the Makefile resolves anything: the locked ones need hashes and take no dependencies, and the
    project itself is installed without them. Debian packages come through apt.lock."""
    make = (ROOT / "Makefile").read_text()
    pip_calls = [line.strip() for line in make.splitlines() if "pip install" in line]
    assert pip_calls
    for call in pip_calls:
        if call.startswith("PIP_LOCKED :="):
            assert "--require-hashes" in call and "--no-deps" in call
        else:
            assert "--no-deps" in call and call.endswith("-e ."), call
    assert "apt-get" not in make, "Debian packages go through `infra/lock.py apt-install` (apt.lock's versions)"
    for target in ("setup", "libero", "browser"):
        assert f"lock.py apt-install {target}" in make
    assert re.search(r"^lock:\n\tpython3 infra/lock.py lock$", make, re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make setup libero browser" in ci


def test_apt_lock_pins_what_the_targets_install():
    lines = [line.split() for line in (ROOT / "apt.lock").read_text().splitlines() if line and line[0] != "#"]
    pinned = {(target, spec.split("=", 1)[0]): spec.split("=", 1)[1] for target, spec in lines}
    for target, package in [("setup", "ffmpeg"), ("setup", "libavcodec59"), ("libero", "libegl1"),
                            ("libero", "libgl1-mesa-dri"), ("browser", "chromium")]:
        assert pinned.get((target, package)), f"apt.lock: no version for {package} ({target})"


def test_verify_accepts_this_venv_and_refuses_a_lock_it_does_not_match(tmp_path):
    """The gate the Makefile runs after each install: it passes on the venv the tests run in (installed from the
    lock) and fails, naming the package, when one version differs."""
    record = Path(sys.prefix) / "lock-dir"  # `make setup` writes where its lock files were
    if not record.is_file():
        pytest.skip(f"{sys.prefix} is not a venv that `make setup` built from a lock")
    lock_dir = Path(record.read_text().strip())
    built_from = [lock_dir / p.name for p in LOCKS if (lock_dir / p.name).is_file()]
    ok = lock_tool("verify", *map(str, built_from))
    assert ok.returncode == 0, ok.stderr
    wrong = tmp_path / "requirements.lock"
    text = LOCKS[0].read_text()
    version = entries(LOCKS[0])["numpy"]
    wrong.write_text(text.replace(f"numpy=={version} ", "numpy==0.0.1 "))
    bad = lock_tool("verify", str(wrong))
    assert bad.returncode == 1
    assert f"numpy {version} (locked 0.0.1, requirements.lock)" in bad.stderr


def test_installer_lines_are_pip_and_setuptools_with_hashes():
    out = lock_tool("installer", str(LOCKS[0]))
    assert out.returncode == 0, out.stderr
    names = [m[0] for m in ENTRY.findall(out.stdout)]
    assert sorted(names) == ["pip", "setuptools"]


def test_diff_names_what_moved(tmp_path):
    new = tmp_path / "requirements.lock"
    version = entries(LOCKS[0])["numpy"]
    new.write_text(LOCKS[0].read_text().replace(f"numpy=={version} ", "numpy==9.9.9 "))
    out = lock_tool("diff", str(LOCKS[0]), str(new))
    assert out.returncode == 0 and f"1 moved: numpy {version} -> 9.9.9" in out.stdout
    same = lock_tool("diff", str(LOCKS[0]), str(LOCKS[0]))
    assert "nothing moved" in same.stdout


def load_lock_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dz_lock_tool", LOCK_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_apt_install_leaves_an_installed_package_alone_and_names_a_missing_target(tmp_path):
    import shutil

    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg is not installed here (`make setup` installs it)")
    lock = tmp_path / "apt.lock"
    lock.write_text("# test\nsetup ffmpeg=0:0-not-this-version\n")
    out = lock_tool("apt-install", "setup", "--lock", str(lock))
    assert out.returncode == 0, out.stderr
    assert "left as it is: ffmpeg" in out.stdout and "(locked 0:0-not-this-version)" in out.stdout
    assert "installing" not in out.stdout
    lock.write_text("# test\n")
    empty = lock_tool("apt-install", "browser", "--lock", str(lock))
    assert empty.returncode == 2 and "no packages for target 'browser'" in empty.stderr


@pytest.fixture
def as_root():
    import os

    if os.geteuid() != 0:
        pytest.skip("apt-get needs root here (as root, `make setup` installs Debian packages without sudo)")


def test_apt_install_refuses_a_package_the_lock_has_no_version_for(as_root, tmp_path, capsys):
    """`hello` (a small Debian package no target asks for) is missing here, and the lock pins something else: apt
    would install it unpinned, so nothing is installed and the message says how on."""
    lock = tmp_path / "apt.lock"
    lock.write_text("browser chromium=1\n")
    assert load_lock_module().apt_install("browser", lock, roots=["hello"]) == 1
    err = capsys.readouterr().err
    assert "apt.lock has no version for hello, which hello needs here: `make lock` records them" in err


def test_apt_install_says_how_on_when_the_mirror_lacks_a_locked_version(as_root, tmp_path, capsys):
    lock = tmp_path / "apt.lock"
    lock.write_text("browser hello=0.0-no-such-version\n")
    assert load_lock_module().apt_install("browser", lock, roots=["hello"]) == 1
    err = capsys.readouterr().err
    assert "could not install the versions apt.lock pins for browser" in err and "`make lock`" in err


def _apt_offers(packages: list[str]) -> dict[str, dict[str, str]]:
    """name -> {version: archive} of what the configured mirror offers (`apt-cache madison`)."""
    out = subprocess.run(["apt-cache", "madison", *packages], capture_output=True, text=True, timeout=120).stdout
    offered: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 3 and "Sources" not in parts[2]:
            offered.setdefault(parts[0], {})[parts[1]] = parts[2]
    return offered


def test_the_mirror_offers_every_locked_version_that_a_target_would_install():
    """A locked version that the mirror has dropped stops `make setup`/`make browser` on a fresh machine (a Debian
    security update replaces the previous one). Checked for the packages not installed here at that version, those
    a fresh machine may have to install. The browser's packages come from the release's own archive (its point
    release), which the mirror keeps, not from the security archive (Chromium's changes every few weeks)."""
    import shutil

    if shutil.which("apt-cache") is None or not any(Path("/var/lib/apt/lists").glob("*Packages*")):
        pytest.skip("no apt package lists here (`apt-get update`, which `make setup` runs)")
    lock = load_lock_module()
    installed = lock.dpkg_installed()
    pinned = [line.split()[:2] for line in (ROOT / "apt.lock").read_text().splitlines() if line and line[0] != "#"]
    wanted = {(target, *spec.split("=", 1)) for target, spec in pinned}
    check = sorted({(t, n, v) for t, n, v in wanted if installed.get(n) != v or t == "browser"})
    offered = _apt_offers(sorted({n for _, n, _ in check}))
    dropped = [f"{t} {n}={v}" for t, n, v in check if v not in offered.get(n, {})]
    assert not dropped, f"apt.lock pins versions the mirror no longer offers: {dropped} (`make lock` takes new ones)"
    for name in ("chromium", "chromium-common"):
        version = next(v for t, n, v in wanted if t == "browser" and n == name)
        assert "-security" not in offered[name][version], f"{name} {version} is locked from the security archive"
