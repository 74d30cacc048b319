"""`make lock`: resolve what the Makefile's targets install, once, and write it down with exact versions and hashes.

    python infra/lock.py [--venv DIR] [--out-dir DIR]

It builds a throw-away virtual environment from the requests below (the project's extras and the few packages the
Makefile installs without their dependencies), with `pip install --report` at every step, and writes

    requirements.lock          every Python package `make setup` installs, transitive ones included:
                               `name==version --hash=sha256:...` (the installer itself, pip and setuptools, first)
    requirements-libero.lock   what `make libero` adds on top (LIBERO, robosuite, MuJoCo and their needs)
    apt.lock                   the Debian packages `make setup`, `make libero` and `make browser` install, with
                               everything they depend on, at exact versions

`make setup` and `make libero` then install from these files only (`pip install --require-hashes --no-deps`): no
resolver runs, so a release that nobody chose cannot change a build. Upgrading is `make lock`, then `make test`,
then committing the three files together. The lock is for the project's platform: Linux x86_64, CPython 3.11.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "dzmodel"

# What the targets ask for; the resolver picks the rest once, here.
INSTALLER = ["pip", "setuptools"]
# torch first: the local CPU wheel (with no torch installed, a plain requirement would take a CUDA build of GBs)
TORCH = ["torch==2.13.0"]
# one resolve for the project and lerobot 0.4.4's runtime needs (its dataset code), so no later install moves a pin
LEROBOT_NEEDS = ["datasets==4.1.1", "pandas<3", "fsspec==2025.9.0", "jsonlines==4.0.0", "deepdiff==8.6.2",
                 "termcolor==3.3.0", "accelerate==1.15.0", "draccus==0.10.0"]
PROJECT_EXTRAS = [".[dev,data,serve,pipeline]"]
# without their own pins: lerobot's would pull CUDA torch 2.10 (dzmodel.data.lerobot_compat makes the CUDA-built
# torchvision 0.28 import on CPU torch); openpi-client's numpy<2 pin is stale (its wire code is msgpack + numpy)
NO_DEPS = [["lerobot==0.4.4", "torchvision==0.28.0"], ["openpi-client==0.1.2"]]
LIBERO_EXTRAS = [".[libero]"]

APT = {
    "setup": ["ffmpeg"],                                            # shared libraries for torchcodec
    "libero": ["libegl1", "libegl-mesa0", "libgl1-mesa-dri"],       # EGL software rendering for LIBERO
    "browser": ["chromium"],                                        # headless rendering checks
}
# Targets whose packages come from the release's own archive (its point-release versions, which the mirror keeps)
# rather than from its security updates (which the mirror drops when the next one arrives: Chromium gets one every
# few weeks, and a lock pinning the dropped one stops `make browser`). The browser only renders pages of the tests'
# own local servers.
APT_FROM_RELEASE = {"browser"}


def release_codename() -> str:
    """The Debian release this machine runs (`VERSION_CODENAME` of /etc/os-release), e.g. bookworm."""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip().strip('"')
    raise LockError("/etc/os-release names no VERSION_CODENAME")


def _apt_release(target: str) -> list[str]:
    """apt-get's `-t RELEASE` for a target of APT_FROM_RELEASE, else nothing."""
    return ["-t", release_codename()] if target in APT_FROM_RELEASE else []

HEADER = """\
# {what}
# Written by `make lock` (infra/lock.py) on {python}, {platform}; install with
#   pip install --require-hashes --no-deps -r {name}
# Do not edit by hand: change the requests in infra/lock.py (or pyproject.toml), run `make lock`, then `make test`.
"""


class LockError(RuntimeError):
    pass


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def pip_install(py: Path, args: list[str], report: Path) -> list[dict]:
    """Install with pip's JSON report; the report's entries (name, version, sha256 of the file it installed)."""
    run([str(py), "-m", "pip", "install", "--quiet", "--report", str(report), *args], cwd=ROOT)
    entries = []
    for item in json.loads(report.read_text())["install"]:
        meta, info = item["metadata"], item["download_info"]
        name = canonical(meta["name"])
        if name == PROJECT:
            continue
        archive = info.get("archive_info")
        if archive is None:
            raise LockError(f"{name} {meta['version']} came from {info.get('url')}, not a release file: it cannot be "
                            "locked by hash")
        digest = (archive.get("hashes") or {}).get("sha256")
        if digest is None and str(archive.get("hash", "")).startswith("sha256="):
            digest = archive["hash"].split("=", 1)[1]
        if digest is None:
            raise LockError(f"{name} {meta['version']}: pip reported no sha256 for {info.get('url')}")
        entries.append({"name": name, "version": normal_version(meta["version"]), "sha256": digest,
                         "file": info["url"].rsplit("/", 1)[-1]})
    return entries


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def normal_version(version: str) -> str:
    """PEP 440's normal form (pip's report gives the version as the package wrote it: 0.1.1-2209072238 is
    0.1.1.post2209072238)."""
    from pip._vendor.packaging.version import InvalidVersion, Version

    try:
        return str(Version(version))
    except InvalidVersion:
        return version


def installed(py: Path) -> dict[str, str]:
    out = subprocess.run([str(py), "-m", "pip", "list", "--format", "json"], check=True, capture_output=True,
                         text=True).stdout
    return {canonical(d["name"]): normal_version(d["version"]) for d in json.loads(out)
            if canonical(d["name"]) != PROJECT}


def collect(entries: list[dict], have: dict[str, str], exclude: dict[str, str] | None = None) -> list[dict]:
    """The installed set, each at the version the venv ended with, with the hash of the file pip installed it from;
    `exclude`: a set already locked at those versions (the libero lock lists only what it adds or changes)."""
    by_key = {(e["name"], e["version"]): e for e in entries}
    locked = []
    for name, version in sorted(have.items()):
        if exclude is not None and exclude.get(name) == version:
            continue
        entry = by_key.get((name, version))
        if entry is None:
            raise LockError(f"{name}=={version} is installed but no install step reported its file (installed "
                            "before the lock build started?): nothing to hash")
        locked.append(entry)
    return locked


def write_lock(path: Path, what: str, entries: list[dict]) -> None:
    first = [e for e in entries if e["name"] in INSTALLER]
    rest = [e for e in entries if e["name"] not in INSTALLER]
    lines = [HEADER.format(what=what, python=sys.version.split()[0], platform=sys.platform + "/" + os.uname().machine,
                           name=path.name)]
    for e in first + rest:
        lines.append(f"{e['name']}=={e['version']} \\\n    --hash=sha256:{e['sha256']}  # {e['file']}")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}: {len(entries)} packages")


def lock_python(venv: Path, out_dir: Path) -> None:
    if venv.exists():
        shutil.rmtree(venv)
    run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    reports = Path(tempfile.mkdtemp(prefix="dz-lock-"))
    steps = [["--upgrade", *INSTALLER], TORCH, ["-e", *PROJECT_EXTRAS, *LEROBOT_NEEDS],
             *[["--no-deps", *s] for s in NO_DEPS]]
    entries = []
    for i, step in enumerate(steps):
        entries += pip_install(py, step, reports / f"setup{i}.json")
    setup = installed(py)
    write_lock(out_dir / "requirements.lock", "What `make setup` installs (the project's own code is installed "
               "editable, without dependencies).", collect(entries, setup))
    # LIBERO on top, every package already there held at its version (robomimic would otherwise move torchvision
    # and with it torch to a CUDA build)
    constraints = reports / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(setup.items())))
    libero = pip_install(py, ["-c", str(constraints), "-e", *LIBERO_EXTRAS], reports / "libero.json")
    write_lock(out_dir / "requirements-libero.lock", "What `make libero` adds to `make setup`'s packages.",
               collect(entries + libero, installed(py), exclude=setup))


def apt_closure(packages: list[str], release: list[str] | None = None) -> dict[str, str]:
    """What apt installs for `packages` on a machine that has nothing (its own choice among alternatives), each at
    the version installed here, or else the version apt would install (from `release`: `-t NAME`, if given)."""
    sim = subprocess.run(["apt-get", "-s", "-o", "Dir::State::status=/dev/null", *(release or []), "install",
                          "--no-install-recommends", *packages], check=True, capture_output=True, text=True).stdout
    closure = dict(re.findall(r"^Inst (\S+) \((\S+) ", sim, flags=re.M))
    if not release:  # what is installed here stands for the target's choice (not so for a release's own versions)
        closure.update({n: v for n, v in dpkg_installed().items() if n in closure})
    return closure


def dpkg_installed() -> dict[str, str]:
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version} ${db:Status-Abbrev}\n"], check=True,
                         capture_output=True, text=True).stdout
    return {p[0]: p[1] for p in (line.split() for line in out.splitlines()) if len(p) == 3 and p[2] == "ii"}


def lock_apt(out_dir: Path) -> None:
    lines = ["# Debian packages the make targets install: `<target> <package>=<version>`, what they depend on "
             "included.",
             "# Written by `make lock` (infra/lock.py); `python3 infra/lock.py apt-install TARGET` pins what apt installs "
             "to these versions."]
    for target, packages in APT.items():
        closure = apt_closure(packages, _apt_release(target))
        missing = [n for n in packages if n not in closure and n not in dpkg_installed()]
        if missing:
            raise LockError(f"apt would not install {missing}")
        lines += [f"{target} {name}={version}" for name, version in sorted(closure.items())]
    (out_dir / "apt.lock").write_text("\n".join(lines) + "\n")
    print(f"wrote {out_dir / 'apt.lock'}: {len(lines) - 2} entries")


def apt_install(target: str, lock: Path, roots: list[str] | None = None) -> int:
    """Install what `target` asks of apt (`roots`, by default APT's), pinning every package apt would install to
    apt.lock's version. A package already installed stays as it is (a different version is reported, never
    changed)."""
    roots = roots or APT[target]
    pinned = {}
    for line in lock.read_text().splitlines():
        if line.strip() and not line.startswith("#") and line.split()[0] == target:
            name, version = line.split()[1].split("=", 1)
            pinned[name] = version
    if not pinned:
        print(f"{lock}: no packages for target {target!r}", file=sys.stderr)
        return 2
    have = dpkg_installed()
    other = [f"{n} {have[n]} (locked {pinned.get(n)})" for n in roots if n in have and have[n] != pinned.get(n)]
    if other:
        print(f"{lock.name}, {target}: already installed at another version, left as it is: " + ", ".join(other))
    if all(n in have for n in roots):
        return 0
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True, env=env)
    sim = subprocess.run(["apt-get", "-s", *_apt_release(target), "install", "--no-install-recommends", *roots],
                         capture_output=True, text=True, env=env)
    if sim.returncode != 0:
        print(f"apt cannot install {' '.join(roots)} here: {sim.stderr.strip()}", file=sys.stderr)
        return 1
    sim = sim.stdout
    needed = re.findall(r"^Inst (\S+) ", sim, flags=re.M)
    unlocked = [n for n in needed if n not in pinned]
    if unlocked:
        print(f"{lock.name} has no version for {', '.join(unlocked)}, which {' '.join(roots)} needs here: "
              f"`make lock` records them (then `make test`, then commit {lock.name})", file=sys.stderr)
        return 1
    print(f"installing {len(needed)} Debian package(s) for {target} at the versions of {lock.name}")
    proc = subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends",
                           *[f"{n}={pinned[n]}" for n in needed]], env=env)
    if proc.returncode != 0:
        print(f"apt could not install the versions {lock.name} pins for {target} (the mirror may no longer offer "
              f"them; `apt-cache policy PACKAGE` shows what it has). To take the mirror's versions deliberately: "
              f"`make lock`, then `make test`, then commit {lock.name}.", file=sys.stderr)
        return 1
    return 0


def read_lock(path: Path) -> dict[str, str]:
    """name -> version of a lock file's entries."""
    if not path.is_file():
        raise LockError(f"{path}: no such lock file (`make lock` writes it)")
    return {canonical(m[0]): m[1] for m in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", path.read_text(),
                                                      flags=re.M)}


def installer_lines(path: Path) -> str:
    """The lock's entries for the installer itself (pip, setuptools), hashes included: installed first, so the rest
    installs with the locked pip and builds with the locked setuptools."""
    blocks = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*==\S+ \\\n\s+--hash=\S+)", path.read_text(), flags=re.M)
    return "".join(b + "\n" for b in blocks if canonical(b.split("==")[0]) in INSTALLER)


def verify(paths: list[Path]) -> int:
    """This interpreter's environment holds every locked package at its locked version (run with the venv's
    python)."""
    from importlib import metadata

    have = {canonical(d.metadata["Name"]): normal_version(d.version) for d in metadata.distributions()}
    wrong = []
    for path in paths:
        for name, version in read_lock(path).items():
            if have.get(name) != version:
                wrong.append(f"{name} {have.get(name, 'missing')} (locked {version}, {path.name})")
    if wrong:
        print(f"{sys.prefix} does not match the lock: " + "; ".join(wrong), file=sys.stderr)
        return 1
    print(f"{sys.prefix}: {sum(len(read_lock(p)) for p in paths)} packages at their locked versions")
    return 0


def diff(old: Path, new: Path) -> int:
    a, b = read_lock(old), read_lock(new)
    moved = [f"{n} {a.get(n, '-')} -> {b.get(n, '-')}" for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
    print(f"{old.name} -> {new}: " + (f"{len(moved)} moved: " + ", ".join(moved) if moved else "nothing moved"))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    lock = sub.add_parser("lock", help="resolve and write the lock files (the default)")
    lock.add_argument("--venv", default=str(ROOT / ".venv-lock"), help="the throw-away environment it resolves into")
    lock.add_argument("--out-dir", default=str(ROOT), help="where the lock files go (default: the checkout)")
    lock.add_argument("--no-apt", action="store_true", help="leave apt.lock as it is")
    apt = sub.add_parser("apt-install", help="install a target's Debian packages at apt.lock's versions")
    apt.add_argument("target", choices=sorted(APT))
    apt.add_argument("--lock", default=str(ROOT / "apt.lock"))
    sub.add_parser("installer", help="print a lock's pip and setuptools entries").add_argument("lock")
    sub.add_parser("verify", help="check that this python's environment holds the locked versions").add_argument(
        "locks", nargs="+")
    d = sub.add_parser("diff", help="what moved between two lock files")
    d.add_argument("old")
    d.add_argument("new")
    ns = p.parse_args(argv if argv is not None else (sys.argv[1:] or ["lock"]))
    try:
        if ns.command == "apt-install":
            return apt_install(ns.target, Path(ns.lock))
        if ns.command == "installer":
            print(installer_lines(Path(ns.lock)), end="")
            return 0
        if ns.command == "verify":
            return verify([Path(x) for x in ns.locks])
        if ns.command == "diff":
            return diff(Path(ns.old), Path(ns.new))
    except LockError as e:
        print(f"infra/lock.py: {e}", file=sys.stderr)
        return 2
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock_python(Path(ns.venv), out_dir)
        if not ns.no_apt:
            lock_apt(out_dir)
    except (LockError, subprocess.CalledProcessError) as e:
        print(f"make lock: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
