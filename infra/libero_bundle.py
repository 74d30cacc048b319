#!/usr/bin/env python3
"""Pack the part of a LIBERO install that some tasks need, for a machine that cannot install it (the GPU machines:
no package index, a different Python, and a 64 MiB limit on what travels).

    .venv/bin/python infra/libero_bundle.py --suite object --tasks 0,1,2,3 --python 3.12 --out .libero_bundle
    .venv/bin/python infra/libero_bundle.py --suite object,spatial --tasks 0-9 --python 3.12 --out .libero_bundle
    .venv/bin/python infra/libero_bundle.py --suite goal --tasks 0-9 --distractor 2 --out .libero_bundle

(several suites: the listed tasks of each; `--distractor N` also keeps the object models that the robustness
evaluation's `distractor=N` adds, under `--eval-seed`).

The full install is about 1.2 GB (robosuite ships every robot's meshes, the asset wheels every scene). This keeps:
* the pure-Python packages LIBERO imports (libero, robosuite, bddl, gymnasium, ...) as .py files, plus the data
  files that creating each task's env actually reads: Python-level opens seen by an audit hook while each env is
  built, reset and stepped in a fresh process, and the mesh/texture files named in the MJCF that MuJoCo compiled;
* the compiled packages (mujoco, cffi, and `--extra-wheel`s such as av for recording) as wheels for `--python`,
  downloaded with pip.

Output: OUT/site.tar.xz, OUT/wheels/*.whl and OUT/install.sh. On the target, from the repository root:

    bash .libero_bundle/install.sh /tmp/libero && export PYTHONPATH=/tmp/libero/site:$PYTHONPATH

installs it into /tmp/libero; `dz` writes LIBERO's config into $LIBERO_CONFIG_PATH (e.g. /tmp/libero/config)
when it first needs it. The ASSET_PROBE file that `check_libero` looks for is always kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from dzmodel.atomic import temp_sibling
from dzmodel.eval.libero_env import ASSET_PROBE

# What `libero.libero.envs` imports that a plain PyTorch image may lack (found by importing it in a fresh venv).
PURE_PACKAGES = ("libero", "robosuite", "bddl", "easydict", "gymnasium", "farama_notifications", "dill", "pydot",
                 "future", "past", "OpenGL", "pycparser", "termcolor")
COMPILED = ("mujoco", "cffi")
SUITES = ("spatial", "object", "goal", "10")
# Packages that hold large data trees: only the traced data files are kept from them.
TRACED_DATA = ("libero", "robosuite")

_TRACE = r"""
import json, os, re, sys, numpy as np
opened = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes)):
        opened.add(os.path.realpath(os.fsdecode(args[0])))
sys.addaudithook(hook)
from dzmodel.eval.libero_env import ensure_libero_config, list_tasks, init_state, CAMERAS
ensure_libero_config()
from libero.libero.envs import OffScreenRenderEnv
suite, index = sys.argv[1], int(sys.argv[2])
task = list_tasks(suite)[index]
env = OffScreenRenderEnv(bddl_file_name=task.bddl_file, camera_heights=32, camera_widths=32, camera_names=list(CAMERAS))
env.seed(0); env.reset(); env.set_init_state(init_state(task, 0)); env.step(np.zeros(7))
xml = env.env.sim.model.get_xml()
env.close()
count, seed = int(sys.argv[3]), int(sys.argv[4])
if count:  # the scene `dz eval libero --perturb distractor=COUNT` builds for this task under eval seed SEED
    from dzmodel.eval.libero_perturb import parse_perturbations, scene_bddl
    bddl = scene_bddl(task.bddl_file, parse_perturbations([f"distractor={count}"]), (seed, task.suite, task.index))
    env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=32, camera_widths=32, camera_names=list(CAMERAS))
    env.seed(0); env.reset(); env.step(np.zeros(7))
    xml += env.env.sim.model.get_xml()
    env.close()
for f in re.findall(r'file="([^"]+)"', xml):
    opened.add(os.path.realpath(f))
print("TRACE" + json.dumps(sorted(opened)))
"""


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"libero_bundle: package {name!r} is not installed here (run `make libero` first)")
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    return Path(spec.origin).resolve()  # a single-module package (e.g. easydict may be one file)


def trace_task(suite: str, index: int, distractor: int = 0, eval_seed: int = 0) -> set[Path]:
    """The files that building, resetting and stepping the task's env opens; with `distractor` > 0 also those of
    the scene that `--perturb distractor=N` builds for it under `eval_seed` (the distractors' models)."""
    out = subprocess.run([sys.executable, "-c", _TRACE, suite, str(index), str(distractor), str(eval_seed)],
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("TRACE")), None)
    if out.returncode or line is None:
        raise SystemExit(f"libero_bundle: tracing {suite} task {index} failed:\n{out.stderr[-3000:]}")
    return {Path(p) for p in json.loads(line[5:])}


def member_name(path: Path, roots: dict[Path, str]) -> str | None:
    """The bundle path of a file, relative to the site folder, or None if it is outside every kept package."""
    for root, name in roots.items():
        if root in path.parents:
            return str(Path(name) / path.relative_to(root))
    return None


def build(suites: list[str], tasks: list[int], python: str, out: Path, extra_wheels: list[str],
          distractor: int = 0, eval_seed: int = 0) -> None:
    packages = {package_dir(name): name for name in PURE_PACKAGES}
    libero_root = next(d for d, name in packages.items() if name == "libero")
    # hf-libero finds its scenes at libero/libero/assets (a symlink into the asset wheel): keep that layout
    assets = (libero_root / "libero" / "assets").resolve()
    roots = {assets: "libero/libero/assets", **{d: d.name for d in packages}}

    traced: set[Path] = set()
    for suite in suites:
        for index in tasks:
            print(f"tracing {suite} task {index} ...", flush=True)
            traced |= trace_task(suite, index, distractor, eval_seed)

    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for root, name in ((d, d.name) for d in packages):
        if root.is_file():
            files[name] = root
            continue
        for path in root.rglob("*"):
            if path.is_dir() or "__pycache__" in path.parts or path.is_symlink():
                continue
            keep = path.suffix == ".py" or name not in TRACED_DATA
            # the task files and init states of the whole suite are small; the meshes and textures are not
            rel = path.relative_to(root)
            if name == "libero" and rel.parts[:2] in (("libero", "bddl_files"), ("libero", "init_files")):
                keep = keep or any(f"libero_{suite}" in rel.parts for suite in suites)
            if keep:
                files[str(Path(name) / rel)] = path
    traced.add((libero_root / "libero" / ASSET_PROBE).resolve())
    for path in traced:
        name = member_name(path, roots)
        if name is not None and path.is_file():
            files[name] = path
    raw = sum(p.stat().st_size for p in files.values())
    print(f"{len(files)} files, {raw / 2**20:.1f} MiB before compression; compressing ...", flush=True)
    tmp = temp_sibling(out / "site.tar.xz")
    try:
        with tarfile.open(tmp, mode="w:xz", preset=6) as tar:
            for name in sorted(files):
                tar.add(files[name], arcname=f"site/{name}", recursive=False)
        os.replace(tmp, out / "site.tar.xz")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir()
    pins = [f"{name}=={_version(name)}" for name in COMPILED] + list(extra_wheels)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(wheels)]
    for n in (39, 35, 34, 31, 28, 27, 24, 17):
        cmd += ["--platform", f"manylinux_2_{n}_x86_64"]
    cmd += ["--platform", "manylinux2014_x86_64"]
    subprocess.run(cmd + pins, check=True)
    (out / "install.sh").write_text(_INSTALL)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"bundle: {out} ({size / 2**20:.1f} MiB): site.tar.xz + {', '.join(sorted(p.name for p in wheels.iterdir()))}")


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


_INSTALL = r"""#!/usr/bin/env bash
# Install a LIBERO bundle (infra/libero_bundle.py) into DEST (default /tmp/libero); then
#   export PYTHONPATH=DEST/site:$PYTHONPATH LIBERO_CONFIG_PATH=DEST/config MUJOCO_GL=egl
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-/tmp/libero}
mkdir -p "$dest"
tar -xJf "$here/site.tar.xz" -C "$dest"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dest/site" "$here"/wheels/*.whl
echo "LIBERO installed in $dest (dz writes LIBERO's config into \$LIBERO_CONFIG_PATH on first use)"
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", required=True,
                   help=f"a suite, or comma-separated suites ({', '.join(SUITES)}), e.g. object,spatial")
    p.add_argument("--tasks", required=True, help="task indices of each suite: comma-separated, ranges allowed "
                                                  "(e.g. 0,1,2,3 or 0-9)")
    p.add_argument("--python", default="3.12", help="the target machine's Python version (for the wheels)")
    p.add_argument("--extra-wheel", action="append", default=[], help="another wheel to ship, e.g. av==15.1.0")
    p.add_argument("--distractor", type=int, default=0, metavar="N",
                   help="also keep the models that `dz eval libero --perturb distractor=N` adds to each task")
    p.add_argument("--eval-seed", type=int, default=0, help="the evaluation's seed (eval.seed), which picks the "
                                                            "distractors (default 0)")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()
    if ns.distractor < 0:
        raise SystemExit(f"--distractor: expected a count >= 0, got {ns.distractor}")
    suites = [s.strip() for s in ns.suite.split(",") if s.strip()]
    bad = [s for s in suites if s not in SUITES]
    if not suites or bad:
        raise SystemExit(f"--suite: expected one or more of {', '.join(SUITES)}, got {ns.suite!r}")
    try:
        tasks = parse_tasks(ns.tasks)
    except ValueError:
        raise SystemExit(f"--tasks: expected comma-separated integers or ranges (0-9), got {ns.tasks!r}")
    build(list(dict.fromkeys(suites)), tasks, ns.python, ns.out, ns.extra_wheel, ns.distractor, ns.eval_seed)


def parse_tasks(text: str) -> list[int]:
    """'0,1,2' or '0-9' or '0-3,7' -> sorted unique task indices (ValueError otherwise)."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(part)
        out.update(range(first, last + 1))
    if not out:
        raise ValueError(text)
    return sorted(out)


if __name__ == "__main__":
    main()
