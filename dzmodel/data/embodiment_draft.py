"""`dz embodiment init DATASET`: a draft embodiment YAML from a LeRobot dataset's info.json (cameras, state and
action columns with their dims, fps) and its action data, for the user to review and edit. The draft parses as an
embodiment (`parse_embodiment`) before it is written, so `dz data check DATASET --embodiment TAG --embodiments FILE`
runs on it at once, and it is complete: its `robot:` block (the kind guessed from the action's names and dims, the
limits from the data's range with a margin, the joint names from info.json) lets `dz package` describe the robot.
Its action horizon is the model preset's num_action_per_block (the caller passes it: the presets live above this
layer)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Mapping

import numpy as np

from ..atomic import atomic_write_text
from .embodiments import parse_embodiment
from .errors import DataError
from .lerobot_format import open_dataset

# Columns every LeRobot dataset has: bookkeeping, never state or action.
BOOKKEEPING = {"timestamp", "frame_index", "episode_index", "index", "task_index"}
FLOAT_DTYPES = {"float16", "float32", "float64", "bfloat16"}
TAG = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
MAX_VIEW_SIDE = 256   # a draft's view_size: the camera's aspect, longer side at most this ...
# ... or, for the presets meant for a CPU or a quick first run, at most these (the built-in libero_sim_tiny and
# libero_sim_small views): the frame's pixels drive a step's cost
PRESET_VIEW_SIDE = {"tiny": 64, "small": 128}
VIEW_MULTIPLE = 32    # ... and both sides a multiple of this (VAE 16x down, 2x2 patches)
LIMIT_MARGIN = 0.05   # the drafted action limits: the data's range widened by this fraction of it on each side
MIN_MARGIN = 1e-3     # ... and by at least this (a dimension the data never moves)
LIMIT_DECIMALS = 4    # written with this many decimals, rounded outwards
# what a robot's action names or info.json robot_type say about it (lower case, as substrings)
HUMANOID_WORDS = ("hip", "knee", "ankle", "waist", "torso", "pelvis", "leg")
FRANKA_WORDS = ("franka", "panda", "droid", "fr3")
MOBILE_WORDS = ("wheel", "base", "odom", "chassis")
CARTESIAN_NAMES = {"x", "y", "z", "roll", "pitch", "yaw", "rx", "ry", "rz"}
DELTA_NAME = re.compile(r"d_?(x|y|z|roll|pitch|yaw|rx|ry|rz)")   # dx, d_roll: an end-effector delta
FRANKA_JOINTS = 7
HUMANOID_DIMS = 20    # at least this many action dims and no Franka sign: a humanoid


def _short_names(keys: list[str]) -> dict[str, str]:
    """Short, unique, YAML-safe names for dotted column keys: the last component, more where two collide."""
    for depth in range(1, max((k.count(".") + 1 for k in keys), default=1) + 1):
        names = {k: re.sub(r"[^a-z0-9_]+", "_", "_".join(k.lower().split(".")[-depth:])).strip("_") or "x"
                 for k in keys}
        if len(set(names.values())) == len(keys):
            return names
    return {k: f"key{i}" for i, k in enumerate(keys)}


def _view_size(height: int, width: int, max_side: int = MAX_VIEW_SIDE) -> list[int]:
    scale = min(1.0, max_side / max(height, width))
    return [max(VIEW_MULTIPLE, round(side * scale / VIEW_MULTIPLE) * VIEW_MULTIPLE) for side in (height, width)]


def _camera_hw(feature) -> tuple[int, int]:
    names = [str(n).lower() for n in feature.names] if isinstance(feature.names, list) else []
    shape = list(feature.shape)
    if "height" in names and "width" in names and len(names) == len(shape):
        return shape[names.index("height")], shape[names.index("width")]
    if len(shape) == 3:  # [H, W, C] or [C, H, W]
        return (shape[1], shape[2]) if shape[0] in (1, 3, 4) and shape[2] not in (1, 3, 4) else (shape[0], shape[1])
    raise DataError(f"camera {feature.key}: cannot tell its height and width from shape {shape} and names {names}")


def _feature_names(feature) -> list[str] | None:
    """A vector feature's per-dim names from info.json: a list, or {"motors": [...]} (one list), one per dim."""
    names = feature.names
    if isinstance(names, dict) and len(names) == 1:
        names = next(iter(names.values()))
    if isinstance(names, list) and len(names) == 1 and isinstance(names[0], list):
        names = names[0]
    dim = int(feature.shape[0])
    if isinstance(names, list) and len(names) == dim and all(isinstance(n, str) and n.strip() for n in names):
        return [n.strip() for n in names]
    return None


def _action_names(action: list) -> list[str] | None:
    """One distinct name per action dim (the columns' in order), or None where info.json does not give them all."""
    parts = [_feature_names(f) for f in action]
    if any(p is None for p in parts):
        return None
    names = [n for p in parts for n in p]
    return names if len(set(names)) == len(names) else None


def _robot_kind(names: list[str] | None, width: int, robot_type: str) -> tuple[str, str]:
    """(kind, why): the robot's kind as the action's names and dims and info.json's robot_type suggest it."""
    lower = [n.lower() for n in names or []]
    if any(w in n for n in lower for w in HUMANOID_WORDS):
        return "humanoid", "joint names like hip, knee or waist"
    if any(w in robot_type.lower() for w in FRANKA_WORDS):
        return "franka", f"robot_type {robot_type!r}"
    if width in (7, 8) and (not names or any("joint" in n or "gripper" in n for n in lower)):
        return "franka", f"a {width}-dim action (an arm of 7 joints or axes, and a gripper)"
    if width >= HUMANOID_DIMS:
        return "humanoid", f"{width} action dims"
    if any(w in n for n in lower for w in MOBILE_WORDS):
        return "mobile_manipulator", "action names like wheel or base"
    return "arm", f"{width} action dims"


def _action_range(reader, columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-dim min and max of the action columns over every data file (their dims side by side)."""
    from .metadata_scan import iter_batches

    files = [reader.local(f) for f in reader.iter_data_files() if reader.has_file(f)]
    lo = hi = None
    for _, _, _, cols in iter_batches(files, columns, 65_536, None):
        x = np.concatenate([cols[c] for c in columns], axis=1)
        lo = x.min(axis=0) if lo is None else np.minimum(lo, x.min(axis=0))
        hi = x.max(axis=0) if hi is None else np.maximum(hi, x.max(axis=0))
    if lo is None:
        raise DataError(f"{reader.root}: no action rows in its data files to draft the robot's limits from")
    return lo, hi


def _limits(lo: np.ndarray, hi: np.ndarray) -> tuple[list[float], list[float]]:
    """The data's range widened by LIMIT_MARGIN of it (at least MIN_MARGIN) on each side, rounded outwards."""
    pad = np.maximum(LIMIT_MARGIN * (hi - lo), MIN_MARGIN)
    scale = 10 ** LIMIT_DECIMALS
    return ([math.floor(v * scale) / scale for v in (lo - pad).tolist()],
            [math.ceil(v * scale) / scale for v in (hi + pad).tolist()])


def _numbers(values: list[float]) -> str:
    """A YAML flow list of floats that loads back as written (every number with its decimal point)."""
    return "[" + ", ".join(f"{v:.{LIMIT_DECIMALS}f}" for v in values) + "]"


def _space_and_mode(names: list[str] | None) -> tuple[str, str]:
    """(action_space, action_mode) as the action's names suggest them: end_effector for x, y, z, roll, ... (or
    their d-prefixed deltas), delta for delta, velocity or d-prefixed names; joint and absolute otherwise."""
    lower = [n.lower() for n in names or []]
    deltas = [n for n in lower if "delta" in n or "vel" in n or DELTA_NAME.fullmatch(n)]
    axes = [n for n in lower if n in CARTESIAN_NAMES or DELTA_NAME.fullmatch(n) or "eef" in n or "cartesian" in n]
    cartesian = bool(axes) and not any("joint" in n for n in lower)
    return ("end_effector" if cartesian else "joint"), ("delta" if deltas else "absolute")


def _franka_action(action: list) -> dict | None:
    """A Franka's absolute joint positions as the keys its published limits apply to (joint_position, and
    gripper_position for an 8th dim), when the action is one column of 7 or 8 dims; else None."""
    if len(action) != 1 or int(action[0].shape[0]) not in (FRANKA_JOINTS, FRANKA_JOINTS + 1):
        return None
    column = action[0].key
    keys = {"joint_position": {"column": column, "slice": [0, FRANKA_JOINTS], "dim": FRANKA_JOINTS}}
    if int(action[0].shape[0]) > FRANKA_JOINTS:
        keys["gripper_position"] = {"column": column, "slice": [FRANKA_JOINTS, FRANKA_JOINTS + 1], "dim": 1}
    return keys


def draft_robot(reader, action: list, tag: str) -> tuple[dict, list[str], dict | None]:
    """(the robot: entry, its YAML lines with comments, the action keys a Franka's joint limits need or None) for
    the dataset's action columns."""
    names = _action_names(action)
    width = sum(int(f.shape[0]) for f in action)
    robot_type = str(reader.info.get("robot_type") or "")
    kind, why = _robot_kind(names, width, robot_type)
    space, mode = _space_and_mode(names)
    franka_keys = None
    if kind == "franka" and (space, mode) == ("joint", "absolute"):
        franka_keys = _franka_action(action)  # `dz serve` clips them to the Panda's published joint limits
        if franka_keys is None:
            kind, why = "arm", f"{why}, but its joint positions are not a Franka's 7 + 1 (then its limits would apply)"
    entry = {"kind": kind, "name": robot_type if robot_type and robot_type.lower() != "unknown" else tag,
             "action_space": space, "action_mode": mode, "control_rate_hz": float(reader.fps)}
    if kind != "franka":
        lo, hi = _limits(*_action_range(reader, [f.key for f in action]))
        entry.update(action_min=[float(f"{v:.{LIMIT_DECIMALS}f}") for v in lo],
                     action_max=[float(f"{v:.{LIMIT_DECIMALS}f}") for v in hi])
        if names:
            entry["joint_names"] = names
    return entry, _robot_comment(kind, why) + _robot_yaml(entry), franka_keys


def _robot_comment(kind: str, why: str) -> list[str]:
    if kind == "franka":
        return [f"  # the robot it drives: a Franka arm, guessed from {why}. Check it (another arm: kind",
                "  # arm, with action_min/action_max). `dz package` takes a Franka's site config: --robot SITE.yaml",
                "  # (robot_ip, camera_serials, target_ee_pose, workspace_min, workspace_max)"]
    article = "an" if kind[0] in "aeiou" else "a"
    return [f"  # the robot it drives: {article} {kind.replace('_', ' ')}, guessed from {why}. Check every field: kind",
            "  # (franka | arm | humanoid | mobile_manipulator), action_space (joint | end_effector), action_mode",
            "  # (absolute | delta). `dz serve` clips every action to [action_min, action_max], drafted from the",
            f"  # data's range widened by {LIMIT_MARGIN:.0%} of it on each side: where a joint has a hard stop (a "
            "gripper's",
            "  # travel, say), set its limit back to the stop. An optional max_step_change (one number per dim)",
            "  # limits the change from one row of a chunk to the next"]


def _robot_yaml(entry: dict) -> list[str]:
    lines = ["  robot:", f"    kind: {entry['kind']}", f"    name: {json.dumps(entry['name'])}",
             f"    action_space: {entry['action_space']}", f"    action_mode: {entry['action_mode']}",
             f"    control_rate_hz: {entry['control_rate_hz']}"]
    if "action_min" in entry:
        lines += [f"    action_min: {_numbers(entry['action_min'])}",
                  f"    action_max: {_numbers(entry['action_max'])}"]
    if "joint_names" in entry:
        lines.append(f"    joint_names: {json.dumps(entry['joint_names'])}")
    return lines


def _horizon_lines(action_horizon: int, presets: Mapping[str, int], preset: str | None) -> list[str]:
    """The comment above action_horizon: each preset's num_action_per_block, and what to set if it differs."""
    table = ", ".join(f"{name} {n}" for name, n in presets.items())
    lines = ["  # actions per chunk: must equal the model's num_action_per_block"
             + (f" ({table})" if table else "")]
    if preset is not None and preset in presets:
        wanted = presets[preset]
        lines.append(f"  # drafted for preset {preset}" + ("" if wanted == action_horizon else
                     f"; {action_horizon} is not its {wanted}: train with "
                     f"train.model_overrides.num_action_per_block: {action_horizon}"))
    return lines


def _horizon(action_horizon: int | None, presets: Mapping[str, int], preset: str | None) -> int:
    if action_horizon is None:
        if preset not in presets:
            raise DataError(f"the draft's action horizon: give action_horizon, or a preset of {sorted(presets)}")
        action_horizon = presets[preset]
    if isinstance(action_horizon, bool) or not isinstance(action_horizon, int) or action_horizon < 1:
        raise DataError(f"--action-horizon must be a positive integer, got {action_horizon!r}")
    return action_horizon


def draft_embodiment(dataset: str | Path, tag: str | None = None, action_horizon: int | None = None,
                     view_size: tuple[int, int] | None = None, presets: Mapping[str, int] | None = None,
                     preset: str | None = None) -> tuple[str, str]:
    """(tag, YAML text) of a draft embodiment for `dataset`. presets: each model preset's num_action_per_block
    (the draft's comment lists them); action_horizon: by default `preset`'s."""
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
    max_side = PRESET_VIEW_SIDE.get(preset, MAX_VIEW_SIDE)
    size = list(view_size) if view_size else _view_size(*sizes[first], max_side)
    views = [view_names[f.key] for f in cameras]
    if len(views) == 1:
        sentence = f"The video shows one view: the {views[0].replace('_', ' ')} camera."
    else:
        sentence = (f"The video is split into {len(views)} horizontal views: " + ", ".join(
            f"view {i + 1} shows the {v.replace('_', ' ')} camera" for i, v in enumerate(views)) + ".")
    presets = dict(presets or {})
    action_horizon = _horizon(action_horizon, presets, preset)
    robot, robot_lines, franka_keys = draft_robot(reader, action, tag)
    entry = {
        "tag_id": 0,
        "views": {view_names[f.key]: f.key for f in cameras},
        "view_size": size,
        "layout": [views],
        "state": {state_names[f.key]: {"column": f.key, "dim": int(f.shape[0])} for f in state},
        "action": franka_keys or {action_names[f.key]: {"column": f.key, "dim": int(f.shape[0])} for f in action},
        "action_horizon": int(action_horizon),
        "relative_action_keys": [],
        "layout_sentence": sentence,
        "prompt_template": "A multi-view video shows that a robot {instruction} {layout_sentence} The robot {instruction}",
        "sampling": "multi_anchor",
        "robot": robot,
    }
    parse_embodiment(tag, entry, source="the draft")  # the draft must load as written
    flow = json.dumps  # JSON is YAML's flow style: one line per field, strings quoted
    cams = ", ".join(f"{f.key} {sizes[f.key][0]}x{sizes[f.key][1]}" for f in cameras)
    lines = [
        f"# Drafted by `dz embodiment init` from {reader.root}/meta/info.json and its action data (LeRobot "
        f"{reader.version}, {reader.fps:g} fps, {len(reader.episodes)} episodes). Review every field, then:",
        f"#   dz data check {reader.root} --embodiment {tag} --embodiments THIS_FILE",
        "# Field reference: dzmodel/data/embodiments.yaml (the built-in embodiments).",
        f"{json.dumps(tag)}:",  # quoted: yes, no, null, on are strings here, not YAML's booleans
        "  tag_id: 0",
        f"  # cameras: {cams}",
        f"  views: {flow(entry['views'])}",
        f"  # every view is cropped, then resized to [H, W]; drafted from {first}'s aspect, longer side <= "
        + (f"{max_side} (for preset {preset}; --view-size H W for another size)" if preset in PRESET_VIEW_SIDE
           else f"{max_side}"),
        f"  view_size: {flow(size)}",
        "  # rows of views; 'name*2' stretches a view over two widths (all rows of equal width)",
        f"  layout: {flow(entry['layout'])}",
        "  # every float vector column under observation.*: keep what the policy should see (slice: [a, b] takes "
        "part of one)",
        f"  state: {flow(entry['state'])}",
        *(["  # a Franka's absolute joint positions, as the keys `dz serve` clips to its published joint limits"]
          if franka_keys else []),
        f"  action: {flow(entry['action'])}",
        *_horizon_lines(action_horizon, presets, preset),
        f"  action_horizon: {int(action_horizon)}",
        "  # action keys made relative to the same-named state key at each chunk's anchor (delta actions)",
        "  relative_action_keys: []",
        f"  layout_sentence: {flow(sentence)}",
        f"  prompt_template: {flow(entry['prompt_template'])}",
        "  sampling: multi_anchor",
        *robot_lines,
        "",
    ]
    text = "\n".join(lines)
    import yaml  # not on the GPU image; only this command and the YAML registry need it

    parsed = yaml.safe_load(text)
    if parsed != {tag: entry}:  # the comments and flow style must not change what loads
        raise AssertionError(f"the draft's YAML does not load back as drafted: {parsed!r}")
    return tag, text


def write_draft(dataset: str | Path, out: str | Path | None, tag: str | None = None, action_horizon: int | None = None,
                view_size: tuple[int, int] | None = None, overwrite: bool = False,
                presets: Mapping[str, int] | None = None, preset: str | None = None) -> tuple[str, Path]:
    """Draft and write; refuses to replace an existing file (unless `overwrite`) or to write into the dataset."""
    tag, text = draft_embodiment(dataset, tag, action_horizon, view_size, presets, preset)
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
