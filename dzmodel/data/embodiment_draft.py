"""`dz embodiment init DATASET`: a draft embodiment YAML from a LeRobot dataset's info.json (cameras, state and
action columns with their dims, fps), for the user to review and edit. The draft parses as an embodiment
(`parse_embodiment`) before it is written, so `dz data check DATASET --embodiment TAG --embodiments FILE` runs on it
at once."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..atomic import atomic_write_text
from .embodiments import parse_embodiment
from .errors import DataError
from .lerobot_format import open_dataset

# Columns every LeRobot dataset has: bookkeeping, never state or action.
BOOKKEEPING = {"timestamp", "frame_index", "episode_index", "index", "task_index"}
FLOAT_DTYPES = {"float16", "float32", "float64", "bfloat16"}
TAG = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
MAX_VIEW_SIDE = 256   # a draft's view_size: the camera's aspect, longer side at most this
VIEW_MULTIPLE = 32    # ... and both sides a multiple of this (VAE 16x down, 2x2 patches)


def _short_names(keys: list[str]) -> dict[str, str]:
    """Short, unique, YAML-safe names for dotted column keys: the last component, more where two collide."""
    for depth in range(1, max((k.count(".") + 1 for k in keys), default=1) + 1):
        names = {k: re.sub(r"[^a-z0-9_]+", "_", "_".join(k.lower().split(".")[-depth:])).strip("_") or "x"
                 for k in keys}
        if len(set(names.values())) == len(keys):
            return names
    return {k: f"key{i}" for i, k in enumerate(keys)}


def _view_size(height: int, width: int) -> list[int]:
    scale = min(1.0, MAX_VIEW_SIDE / max(height, width))
    return [max(VIEW_MULTIPLE, round(side * scale / VIEW_MULTIPLE) * VIEW_MULTIPLE) for side in (height, width)]


def _camera_hw(feature) -> tuple[int, int]:
    names = [str(n).lower() for n in feature.names] if isinstance(feature.names, list) else []
    shape = list(feature.shape)
    if "height" in names and "width" in names and len(names) == len(shape):
        return shape[names.index("height")], shape[names.index("width")]
    if len(shape) == 3:  # [H, W, C] or [C, H, W]
        return (shape[1], shape[2]) if shape[0] in (1, 3, 4) and shape[2] not in (1, 3, 4) else (shape[0], shape[1])
    raise DataError(f"camera {feature.key}: cannot tell its height and width from shape {shape} and names {names}")


def draft_embodiment(dataset: str | Path, tag: str | None = None, action_horizon: int = 24,
                     view_size: tuple[int, int] | None = None) -> tuple[str, str]:
    """(tag, YAML text) of a draft embodiment for `dataset`."""
    reader = open_dataset(dataset)
    if tag is not None and not TAG.fullmatch(tag):
        raise DataError(f"--tag {tag!r}: an embodiment tag is letters, digits and _, starting with a letter")
    tag = tag or re.sub(r"[^a-z0-9_]+", "_", Path(reader.root).name.lower()).strip("_") or "robot"
    if not TAG.fullmatch(tag):  # a directory named 2024: a key YAML would read as a number
        tag = f"robot_{tag}"
    cameras = [reader.features[k] for k in reader.video_keys]
    if not cameras:
        raise DataError(f"{reader.root}: info.json lists no video or image feature; an embodiment needs a camera")
    vectors = [f for k, f in reader.features.items() if k not in BOOKKEEPING and f.dtype in FLOAT_DTYPES
               and len(f.shape) == 1 and f.shape[0] > 0]
    # every float vector under observation.* and action*: a dataset with both `action` and `action.x` lists both
    # (the same numbers twice, perhaps); the review decides which to keep
    state = [f for f in vectors if f.key.startswith("observation.")]
    action = [f for f in vectors if f.key == "action" or f.key.startswith("action")]
    if not action:
        floats = [f.key for f in vectors]
        raise DataError(f"{reader.root}: no action column (a float vector named 'action' or 'action.*'); float "
                        f"vector columns: {floats or 'none'}")
    if not state:
        raise DataError(f"{reader.root}: no state column (a float vector named 'observation.*')")
    view_names = _short_names([f.key for f in cameras])
    state_names = _short_names([f.key for f in state])
    action_names = _short_names([f.key for f in action])
    sizes = {f.key: _camera_hw(f) for f in cameras}
    first = cameras[0].key
    size = list(view_size) if view_size else _view_size(*sizes[first])
    views = [view_names[f.key] for f in cameras]
    sentence = (f"The video is split into {len(views)} horizontal views: "
                + ", ".join(f"view {i + 1} shows the {v.replace('_', ' ')} camera" for i, v in enumerate(views)) + ".")
    entry = {
        "tag_id": 0,
        "views": {view_names[f.key]: f.key for f in cameras},
        "view_size": size,
        "layout": [views],
        "state": {state_names[f.key]: {"column": f.key, "dim": int(f.shape[0])} for f in state},
        "action": {action_names[f.key]: {"column": f.key, "dim": int(f.shape[0])} for f in action},
        "action_horizon": int(action_horizon),
        "relative_action_keys": [],
        "layout_sentence": sentence,
        "prompt_template": "A multi-view video shows that a robot {instruction} {layout_sentence} The robot {instruction}",
        "sampling": "multi_anchor",
    }
    parse_embodiment(tag, entry, source="the draft")  # the draft must load as written
    flow = json.dumps  # JSON is YAML's flow style: one line per field, strings quoted
    cams = ", ".join(f"{f.key} {sizes[f.key][0]}x{sizes[f.key][1]}" for f in cameras)
    lines = [
        f"# Drafted by `dz embodiment init` from {reader.root}/meta/info.json (LeRobot {reader.version}, "
        f"{reader.fps:g} fps, {len(reader.episodes)} episodes). Review every field, then:",
        f"#   dz data check {reader.root} --embodiment {tag} --embodiments THIS_FILE",
        "# Field reference: dzmodel/data/embodiments.yaml (the built-in embodiments).",
        f"{json.dumps(tag)}:",  # quoted: yes, no, null, on are strings here, not YAML's booleans
        "  tag_id: 0",
        f"  # cameras: {cams}",
        f"  views: {flow(entry['views'])}",
        f"  # every view is cropped, then resized to [H, W]; drafted from {first}'s aspect, longer side <= "
        f"{MAX_VIEW_SIDE}",
        f"  view_size: {flow(size)}",
        "  # rows of views; 'name*2' stretches a view over two widths (all rows of equal width)",
        f"  layout: {flow(entry['layout'])}",
        "  # every float vector column under observation.*: keep what the policy should see (slice: [a, b] takes "
        "part of one)",
        f"  state: {flow(entry['state'])}",
        f"  action: {flow(entry['action'])}",
        "  # actions per chunk: must equal the model's num_action_per_block (24 for dreamzero_5b/14b, 16 for "
        "tiny/small)",
        f"  action_horizon: {int(action_horizon)}",
        "  # action keys made relative to the same-named state key at each chunk's anchor (delta actions)",
        "  relative_action_keys: []",
        f"  layout_sentence: {flow(sentence)}",
        f"  prompt_template: {flow(entry['prompt_template'])}",
        "  sampling: multi_anchor",
        "",
    ]
    text = "\n".join(lines)
    import yaml  # not on the GPU image; only this command and the YAML registry need it

    parsed = yaml.safe_load(text)
    if parsed != {tag: entry}:  # the comments and flow style must not change what loads
        raise AssertionError(f"the draft's YAML does not load back as drafted: {parsed!r}")
    return tag, text


def write_draft(dataset: str | Path, out: str | Path | None, tag: str | None = None, action_horizon: int = 24,
                view_size: tuple[int, int] | None = None, overwrite: bool = False) -> tuple[str, Path]:
    """Draft and write; refuses to replace an existing file (unless `overwrite`) or to write into the dataset."""
    tag, text = draft_embodiment(dataset, tag, action_horizon, view_size)
    path = Path(out) if out else Path(f"{tag}.yaml")
    text = text.replace("--embodiments THIS_FILE", f"--embodiments {path}")
    root = Path(dataset).resolve()
    if root == path.resolve().parent or root in path.resolve().parents:
        raise DataError(f"--out {path} is inside the dataset {dataset}: write the embodiment file elsewhere")
    if path.exists() and not overwrite:
        raise DataError(f"--out {path} exists; pass --overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return tag, path
