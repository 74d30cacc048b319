"""The import contracts of pyproject.toml ([tool.importlinter]: the layers, no orchestration in the library, no
cycles) hold for the repository, and each one fails when a module breaks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("dzmodel", "tasks", "flows")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy's packages, not the installed ones
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


def verdicts(root: Path, output: str) -> dict[str, str]:
    """Each contract's name -> KEPT or BROKEN, from lint-imports' report (whose lines wrap)."""
    contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    text = " ".join(output.split())
    found = {}
    for contract in contracts:
        name = " ".join(contract["name"].split())
        found[name] = ("BROKEN" if f"{name} BROKEN" in text else "KEPT" if f"{name} KEPT" in text else "missing")
    return found


def test_every_module_of_the_library_has_a_layer():
    """A module the layers contract does not name is checked by no layer: each top-level module and package of
    dzmodel is named (as itself or as a sibling of a layer)."""
    layers = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                  if c["type"] == "layers")["layers"]
    named = {m.strip() for layer in layers for m in layer.split("|")}
    library = ROOT / "dzmodel"
    modules = {f"dzmodel.{p.stem}" for p in library.glob("*.py") if p.name != "__init__.py"}
    modules |= {f"dzmodel.{p.name}" for p in library.iterdir() if (p / "__init__.py").is_file()}
    assert modules - named == set(), "name these in pyproject.toml's layers contract"


def test_the_repository_keeps_every_contract():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    found = verdicts(ROOT, result.stdout)
    assert len(found) == 3 and set(found.values()) == {"KEPT"}, found


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.mark.parametrize("module,added,broken", [
    # the model layer reaching up into the trainer
    ("dzmodel/model/args.py", "import dzmodel.train.trainer", "layers:"),
    # the model staying on tensors: no data code (the IO pipeline is the policy's and the loaders')
    ("dzmodel/model/sampler.py", "import dzmodel.data.transforms", "layers:"),
    # serving a robot and evaluating one are siblings: neither imports the other
    ("dzmodel/serve/server.py", "import dzmodel.eval.libero_env", "layers:"),
    ("dzmodel/eval/oracle.py", "import dzmodel.serve.protocol", "layers:"),
    # the loaders sit below the policy that composes the same IO pipeline
    ("dzmodel/data/dataset.py", "import dzmodel.policy.policy", "layers:"),
    # the library importing an orchestrator
    ("dzmodel/atomic.py", "import mlflow", "the library imports no orchestration"),
    # flops.py sits below args.py, which imports it: importing back closes a cycle inside one layer
    ("dzmodel/model/flops.py", "from dzmodel.model import args", "no import cycles"),
    # two train modules importing each other (the kind of cycle the cache and trainer once formed)
    ("dzmodel/train/windows.py", "import dzmodel.train.cache", "no import cycles"),
])
def test_each_contract_fails_when_a_module_breaks_it(copy, module, added, broken):
    assert lint(copy).returncode == 0  # the unchanged copy passes
    path = copy / module
    path.write_text(path.read_text() + f"\n{added}  # added by the test\n")
    result = lint(copy)
    assert result.returncode != 0, result.stdout[-3000:]
    found = verdicts(copy, result.stdout)
    # the contract named breaks (an upward import that closes a loop breaks the cycle contract too)
    assert [verdict for name, verdict in found.items() if name.startswith(broken)] == ["BROKEN"], found
