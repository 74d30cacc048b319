"""Draw the project's import layers from the code: one row per layer of the layers contract in pyproject.toml
([tool.importlinter]), top to bottom, each package or module a box whose width grows with its lines of code, and
one arrow per pair of boxes that import each other's modules (its width grows with the number of imports).
An arrow that points up would break the contract; `lint-imports` refuses those, so none are drawn here.

    .venv/bin/python infra/layers_picture.py docs/img/layers.png     # what docs/architecture.md shows
    .venv/bin/python infra/layers_picture.py --text                  # the same, as text

Needs grimp (installed with import-linter) and matplotlib (the pipeline extras).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Box:
    name: str          # a package or module, as the contract names it
    layer: int         # 0 = the top layer
    lines: int = 0     # lines of code of its files
    files: int = 0


def contract_layers(pyproject: Path = ROOT / "pyproject.toml") -> tuple[list[str], list[list[str]]]:
    """(root packages, layers top to bottom, each a list of sibling names) of the first layers contract."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    layers = next(c["layers"] for c in config["contracts"] if c["type"] == "layers")
    return config["root_packages"], [[m.strip() for m in layer.split("|")] for layer in layers]


def _owner(module: str, names: list[str]) -> str | None:
    """The contract's name that holds `module` (the longest that is it or one of its packages)."""
    found = [n for n in names if module == n or module.startswith(n + ".")]
    return max(found, key=len) if found else None


def measure(root: Path = ROOT) -> tuple[list[Box], dict[tuple[str, str], int], list[str]]:
    """The boxes (with lines and files), the imports between boxes, and modules no layer names."""
    import grimp

    roots, layers = contract_layers(root / "pyproject.toml")
    sys.path.insert(0, str(root))
    graph = grimp.build_graph(*roots)
    names = [n for layer in layers for n in layer]
    boxes = {n: Box(n, i) for i, layer in enumerate(layers) for n in layer}
    unlisted = []
    for module in sorted(graph.modules):
        owner = _owner(module, names)
        path = root / Path(*module.split("."))
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if owner is None:
            if module.split(".")[0] in roots and module not in roots:
                unlisted.append(module)
            continue
        if source.is_file():
            boxes[owner].lines += sum(1 for line in source.read_text().splitlines() if line.strip())
            boxes[owner].files += 1
    edges: dict[tuple[str, str], int] = {}
    for importer in graph.modules:
        a = _owner(importer, names)
        if a is None:
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            b = _owner(imported, names)
            if b is not None and b != a:
                edges[(a, b)] = edges.get((a, b), 0) + 1
    return list(boxes.values()), edges, unlisted


def as_text(boxes: list[Box], edges: dict[tuple[str, str], int], unlisted: list[str]) -> str:
    rows = []
    for layer in sorted({b.layer for b in boxes}):
        here = [b for b in boxes if b.layer == layer]
        rows.append(" | ".join(f"{b.name} ({b.lines} lines, {b.files} files)" for b in here))
    rows.append(f"{sum(edges.values())} imports between {len(edges)} pairs of boxes; "
                f"{sum(b.lines for b in boxes)} lines in {sum(b.files for b in boxes)} files")
    if unlisted:
        rows.append("in no layer: " + ", ".join(unlisted))
    return "\n".join(rows)


def draw(boxes: list[Box], edges: dict[tuple[str, str], int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    layers = sorted({b.layer for b in boxes})
    width, row_h, box_h, gap = 100.0, 10.0, 6.0, 1.5
    place: dict[str, tuple[float, float, float]] = {}  # name -> (x, y of the box's bottom, width)
    for layer in layers:
        here = [b for b in boxes if b.layer == layer]
        weights = [max(b.lines, 1) ** 0.5 for b in here]
        span = min(width, 12.0 * len(here) + 0.02 * sum(b.lines for b in here) ** 0.5 * 30)
        usable = span - gap * (len(here) - 1)
        x = (width - span) / 2
        y = (len(layers) - 1 - layer) * row_h
        for b, w in zip(here, weights):
            bw = usable * w / sum(weights)
            place[b.name] = (x, y, bw)
            x += bw + gap
    fig, ax = plt.subplots(figsize=(16, 0.9 * len(layers) + 1.5))
    top = max(edges.values(), default=1)
    for (a, b), n in sorted(edges.items(), key=lambda e: e[1]):
        xa, ya, wa = place[a]
        xb, yb, wb = place[b]
        ax.add_patch(FancyArrowPatch((xa + wa / 2, ya), (xb + wb / 2, yb + box_h), arrowstyle="-|>",
                                     mutation_scale=8, lw=0.4 + 2.6 * n / top, color="#5a6b85", alpha=0.55,
                                     connectionstyle="arc3,rad=0.08", zorder=1))
    for b in boxes:
        x, y, bw = place[b.name]
        ax.add_patch(Rectangle((x, y), bw, box_h, facecolor="#dce6f2", edgecolor="#34495e", lw=0.8, zorder=2))
        label = b.name.removeprefix("dzmodel.") if b.name.startswith("dzmodel.") else b.name + "/"
        ax.text(x + bw / 2, y + box_h * 0.62, label, ha="center", va="center", fontsize=9, weight="bold", zorder=3)
        ax.text(x + bw / 2, y + box_h * 0.25, f"{b.lines:,} lines, {b.files} files", ha="center", va="center",
                fontsize=7, color="#34495e", zorder=3)
    ax.set_xlim(-1, width + 1)
    ax.set_ylim(-2, (len(layers) - 1) * row_h + box_h + 2)
    ax.axis("off")
    total = sum(b.lines for b in boxes)
    ax.set_title(f"Import layers, top to bottom ({total:,} lines of code in {sum(b.files for b in boxes)} files; "
                 f"{sum(edges.values())} imports between {len(edges)} pairs; every arrow points down)", fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="the PNG to write")
    ap.add_argument("--text", action="store_true", help="print the layers instead of drawing them")
    ns = ap.parse_args(argv)
    boxes, edges, unlisted = measure()
    if ns.text or not ns.out:
        print(as_text(boxes, edges, unlisted))
        return 0
    draw(boxes, edges, Path(ns.out))
    print(f"{ns.out}: {len(boxes)} boxes on {len({b.layer for b in boxes})} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
