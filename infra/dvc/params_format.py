"""Keep params.yaml in the layout DVC writes, so that `dvc exp run -S KEY=VALUE` changes one line of it.

`dvc exp run -S` (`--set-param`) loads params.yaml with ruamel.yaml's round-trip loader, applies the override and
dumps the whole file again (dvc.utils.hydra.apply_overrides). Comments and unchanged scalars survive that, but
some layouts do not: a `[a, b]` list comes back as a block list, `null` as an empty value, a quoted string
unquoted, and a plain string past 80 columns folded onto the next line. A params.yaml in any of those layouts
turns a one-value experiment into a diff of hundreds of lines. This script rewrites params.yaml once into DVC's
layout (long strings as folded `>-` blocks, which DVC keeps), so that every later `-S` is a one-line diff:

    .venv/bin/python infra/dvc/params_format.py          # rewrite params.yaml in place
    .venv/bin/python infra/dvc/params_format.py --check  # exit 1 if a `-S` would reformat it

tests/test_params_roundtrip.py runs the check, and applies DVC's own `-S` code to one key.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 80  # ruamel.yaml's default line width, which DVC's dumper keeps


def dvc_set(text: str, overrides: list[str]) -> str:
    """params.yaml's text after DVC's `-S` code applied `overrides` (none: DVC's layout of the same values)."""
    from dvc.utils.hydra import apply_overrides

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(text)
        apply_overrides(str(path), overrides)
        return path.read_text()


def _fold_long_strings(node, indent: int = 0) -> None:
    """Plain strings that would not fit on their key's line become folded `>-` blocks (the same value)."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import FoldedScalarString, ScalarString

    if isinstance(node, CommentedMap):
        for key, value in node.items():
            if isinstance(value, str) and not isinstance(value, ScalarString):
                if indent + len(str(key)) + 2 + len(value) > WIDTH:
                    node[key] = FoldedScalarString(value)
            else:
                _fold_long_strings(value, indent + 2)
    elif isinstance(node, CommentedSeq):
        for value in node:
            _fold_long_strings(value, indent + 2)


def formatted(text: str) -> str:
    """`text` in DVC's layout: the same values and comments, and a fixed point of DVC's `-S` rewrite."""
    from dvc.utils.serialize import dumps_yaml
    from dvc.utils.serialize._yaml import parse_yaml_for_update

    data = parse_yaml_for_update(text, "params.yaml")
    _fold_long_strings(data)
    return dvc_set(dumps_yaml(data), [])


def one_line_diff(before: str, after: str) -> list[str]:
    """The changed lines (`-old`, `+new`) between two texts."""
    return [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?", default=str(ROOT / "params.yaml"), help="the params file (params.yaml)")
    ap.add_argument("--check", action="store_true", help="only check: exit 1 if DVC's `-S` would reformat it")
    ns = ap.parse_args(argv)
    path = Path(ns.path)
    text = path.read_text()
    if ns.check:
        changed = one_line_diff(text, dvc_set(text, []))
        if changed:
            print(f"{path}: `dvc exp run -S` would rewrite {len(changed)} lines; run "
                  f"`python infra/dvc/params_format.py` to put it in DVC's layout", file=sys.stderr)
            return 1
        print(f"{path}: in DVC's layout (a `dvc exp run -S` changes only the value it sets)")
        return 0
    new = formatted(text)
    import yaml

    assert yaml.safe_load(new) == yaml.safe_load(text), "the values changed"
    if new == text:
        print(f"{path}: already in DVC's layout")
        return 0
    path.write_text(new)
    print(f"{path}: rewrote {len(one_line_diff(text, new))} lines into DVC's layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
