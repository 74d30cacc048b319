"""The public WAN checkpoints' tensor names and shapes, shipped with the package.

`compare_to_manifest` is how tests and `dz model manifest` prove that a module's
state dict equals a real checkpoint's, key for key and shape for shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

MANIFEST_PATH = Path(__file__).with_name("specs") / "wan_state_dict_manifest.json"

@lru_cache(maxsize=1)
def load_manifest() -> dict[str, dict[str, list[int]]]:
    with open(MANIFEST_PATH) as f:
        return json.load(f)


def manifest_entry(name: str) -> dict[str, tuple[int, ...]]:
    manifest = load_manifest()
    if name not in manifest:
        raise KeyError(f"unknown manifest entry {name!r}; known: {', '.join(manifest)}")
    return {k: tuple(v) for k, v in manifest[name].items()}


@dataclass
class ManifestDiff:
    missing: list[str] = field(default_factory=list)      # in the manifest, not in the module
    unexpected: list[str] = field(default_factory=list)   # in the module, not in the manifest
    shape_mismatch: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatch)

    def summary(self, limit: int = 10) -> str:
        lines = []
        for title, items in (("missing", self.missing), ("unexpected", self.unexpected)):
            if items:
                shown = ", ".join(items[:limit]) + (f", ... (+{len(items) - limit})" if len(items) > limit else "")
                lines.append(f"{len(items)} {title}: {shown}")
        if self.shape_mismatch:
            shown = "; ".join(f"{k}: module {m} vs checkpoint {c}" for k, m, c in self.shape_mismatch[:limit])
            lines.append(f"{len(self.shape_mismatch)} shape mismatches: {shown}")
        return "\n".join(lines) or "identical keys and shapes"


def compare_shapes(
    module_shapes: dict[str, tuple[int, ...]], reference: dict[str, tuple[int, ...]], prefix: str = ""
) -> ManifestDiff:
    """Compare `module_shapes` (after stripping `prefix`) with `reference`."""
    ours = {k[len(prefix):] if prefix and k.startswith(prefix) else k: tuple(v) for k, v in module_shapes.items()}
    diff = ManifestDiff()
    diff.missing = sorted(set(reference) - set(ours))
    diff.unexpected = sorted(set(ours) - set(reference))
    diff.shape_mismatch = [(k, ours[k], reference[k]) for k in sorted(set(ours) & set(reference)) if ours[k] != reference[k]]
    return diff


def compare_to_manifest(module: torch.nn.Module, name: str, prefix: str = "") -> ManifestDiff:
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    return compare_shapes(shapes, manifest_entry(name), prefix=prefix)
