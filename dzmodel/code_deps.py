"""The source files a module runs: itself, every project module it imports (at the top or inside a function,
transitively), the packages above them, and the data files they name. Computed from the source, so a stage's
code dependencies (its Prefect cache key, dvc.yaml's deps) can never miss a file it imports."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

DATA_SUFFIXES = (".yaml", ".yml", ".json")


def module_file(module: str, root: Path) -> Path | None:
    """The file that defines `module` under `root` (a package's __init__.py), or None when it is not there."""
    base = root.joinpath(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _package_of(module: str, file: Path) -> str:
    return module if file.name == "__init__.py" else module.rpartition(".")[0]


@lru_cache(maxsize=None)
def _parsed(file: Path, mtime_ns: int) -> tuple[frozenset[str], frozenset[str]]:
    """(imported module names as written, absolute or as (level, name) text; string constants) of one file."""
    tree = ast.parse(file.read_text(), filename=str(file))
    names: set[str] = set()
    strings: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{alias.name}" if node.module or node.level == 0 else f"{base}{alias.name}"
                         for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
            strings.add(node.value)
    return frozenset(names), frozenset(strings)


def _absolute(name: str, package: str) -> str:
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - level + 1])
    rest = name[level:]
    return f"{base}.{rest}" if rest else base


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def module_closure(entries: tuple[str, ...] | list[str], root: Path, packages: tuple[str, ...] = ("dzmodel",)) -> list[Path]:
    """Every project file that importing the `entries` modules (and calling into them) may run, sorted."""
    seen: dict[str, Path] = {}
    todo = [m for e in entries for m in _with_parents(e)]
    data: set[Path] = set()
    while todo:
        module = todo.pop()
        if module in seen or module.split(".")[0] not in packages:
            continue
        file = module_file(module, root)
        if file is None:  # `from pkg import name` where name is not a module
            continue
        seen[module] = file
        names, strings = _parsed(file, file.stat().st_mtime_ns)
        package = _package_of(module, file)
        for name in names:
            todo.extend(_with_parents(_absolute(name, package)))
        named = {s for s in strings if s.endswith(DATA_SUFFIXES)}
        for path in file.parent.rglob("*") if named else ():  # the data files it names, beside it or below
            if path.suffix in DATA_SUFFIXES and path.name in named and "__pycache__" not in path.parts:
                data.add(path)
    return sorted(set(seen.values()) | data)
