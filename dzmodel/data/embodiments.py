"""Embodiments: how a robot's dataset maps onto the model's inputs, defined in YAML alone.

`embodiments.yaml` beside this file holds the built-in `libero_sim`, `libero_sim_tiny`, `oxe_droid` and `franka_pnp`
(reference §4.5). Users add robots with their own YAML (same schema); no code changes. Every field is
validated here, and a bad entry gets one error naming the file, the embodiment and the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..schema import bounded_repr, load_yaml
from .errors import DataError

BUILTIN_YAML = Path(__file__).with_name("embodiments.yaml")
# the built-in layouts of DROID's three cameras (the first: the 14B's 352x640 frame; then the 5B's 176x320)
DROID_EMBODIMENTS = ("oxe_droid", "oxe_droid_5b")
SAMPLING_MODES = ("multi_anchor", "fixed_window")

# Bounds on an embodiment's sizes: a server derives its camera and frame limits from the view size, and a
# loader sizes its buffers from the horizon and dims, so a bundle's YAML must not be able to make them absurd.
MAX_VIEW_SIDE = 1024        # pixels, each side of one view (the built-in ones are 64..320)
MAX_FRAME_SIDE = 4096       # pixels, each side of the multi-view frame the layout makes
MAX_VIEWS = 8               # cameras
MAX_LAYOUT = 8              # rows of the layout, and view widths in one row
MAX_ACTION_HORIZON = 256    # action rows per chunk (the built-in ones are 12..24)
MAX_KEYS = 64               # state or action keys
MAX_DIM = 1024              # dims of one key (its `dim`, or the end of its slice)
MAX_TAG_ID = 1023


@dataclass(frozen=True)
class KeySpec:
    """A state/action key: a dataset column, optionally a [start, end) slice of it, optionally a checked dim."""

    name: str
    column: str
    start: int | None = None
    end: int | None = None
    dim: int | None = None

    def width(self, column_width: int) -> int:
        start = self.start or 0
        end = column_width if self.end is None else self.end
        return end - start

    def take(self, values, column_width: int):
        """values [..., column_width] -> [..., width]."""
        start = self.start or 0
        end = column_width if self.end is None else self.end
        return values[..., start:end]


@dataclass(frozen=True)
class LayoutCell:
    view: str
    width: int = 1   # in view widths


ROBOARENA_ACTION_SPACES = {"joint_position": 8, "joint_velocity": 8, "cartesian_position": 7, "cartesian_velocity": 7}
ROBOARENA_FIELDS = ("image_resolution", "needs_wrist_camera", "n_external_cameras", "needs_stereo_camera",
                    "needs_session_id", "action_space")


@dataclass(frozen=True)
class ServeSpec:
    """How a policy server's clients name this robot's inputs (`serve:` in the YAML).

    images / state map protocol keys (openpi: observation/image, RoboArena: observation/exterior_image_0_left,
    ...) onto the embodiment's views and state keys; `ignored` keys are accepted and unused; `roboarena`, when
    set, is the handshake RoboArena's evaluator parses as its PolicyServerConfig (exactly those six fields)."""

    images: dict[str, str]
    state: dict[str, str]
    ignored: tuple[str, ...] = ()
    roboarena: dict[str, Any] | None = None


ROBOT_KINDS = ("franka", "arm", "humanoid", "mobile_manipulator")
ACTION_SPACES = ("joint", "end_effector")
ACTION_MODES = ("absolute", "delta")


@dataclass(frozen=True)
class RobotSpec:
    """What robot an embodiment drives and the limits `dz serve` enforces on every action it sends (`robot:` in
    the YAML; `dz embodiment init` drafts it). A built-in embodiment without a `robot:` block is a Franka arm,
    packaged with a site robot config; `dz package` refuses a user's without one unless given such a config."""

    kind: str                                  # franka | arm | humanoid | mobile_manipulator
    name: str                                  # e.g. "Unitree G1": the model card and robot.json say it
    action_space: str                          # joint | end_effector
    action_mode: str                           # absolute | delta
    control_rate_hz: float
    action_min: tuple[float, ...] | None = None    # per action dim: clipped to [min, max]
    action_max: tuple[float, ...] | None = None
    max_step_change: tuple[float, ...] | None = None  # per action dim: most change from one row of a chunk to the next
    joint_names: tuple[str, ...] | None = None     # per action dim: what it drives (robot.json names the limits)

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "name": self.name, "action_space": self.action_space,
             "action_mode": self.action_mode, "control_rate_hz": self.control_rate_hz,
             "action_min": None if self.action_min is None else list(self.action_min),
             "action_max": None if self.action_max is None else list(self.action_max),
             "max_step_change": None if self.max_step_change is None else list(self.max_step_change)}
        return {**d, "joint_names": list(self.joint_names)} if self.joint_names else d


@dataclass(frozen=True)
class Embodiment:
    tag: str
    tag_id: int
    views: dict[str, str]
    view_size: tuple[int, int]
    layout: tuple[tuple[LayoutCell, ...], ...]
    state: tuple[KeySpec, ...]
    action: tuple[KeySpec, ...]
    action_horizon: int
    relative_action_keys: tuple[str, ...] = ()
    layout_sentence: str = ""
    prompt_template: str = "{instruction}"
    crop_scale: float = 0.95
    color_jitter: dict[str, float] = field(default_factory=dict)
    sampling: str = "multi_anchor"
    serve: ServeSpec | None = None
    robot: RobotSpec | None = None
    source: str = "<dict>"

    @property
    def image_size(self) -> tuple[int, int]:
        """(H, W) of the multi-view frame after the layout."""
        h, w = self.view_size
        widths = {sum(c.width for c in row) for row in self.layout}
        return (h * len(self.layout), w * max(widths))

    def prompt(self, instruction: str) -> str:
        instr = instruction.strip().rstrip(".").lower()
        return self.prompt_template.format(instruction=instr, layout_sentence=self.layout_sentence.strip())

    def columns(self) -> list[str]:
        return sorted({k.column for k in self.state + self.action})

    def horizon_mismatch(self, per_block: int, model: str, trained: bool = False) -> str:
        """The error for a model (`model` says which) whose num_action_per_block is not this action_horizon: it
        names both settings that fix it (`trained`: the model exists, so the other one means training again)."""
        again = " and train again" if trained else ""
        return (f"embodiment {self.tag!r} ({self.source}) has action_horizon {self.action_horizon}, {model} has "
                f"num_action_per_block {per_block}: set the embodiment's action_horizon to {per_block}, or "
                f"train.model_overrides.num_action_per_block to {self.action_horizon}{again}")

    @property
    def wire(self) -> ServeSpec:
        """The declared `serve:` keys, or observation/<view> and observation/<state key> when none are declared."""
        return self.serve or ServeSpec(images={f"observation/{v}": v for v in self.views},
                                       state={f"observation/{k.name}": k.name for k in self.state})


# --- parsing ---------------------------------------------------------------------------

def _fail(source: str, tag: str, field_name: str, why: str) -> DataError:
    return DataError(f"{source}: embodiment {tag!r}, field {field_name!r}: {why}")


_ALLOWED = {"robot", "tag_id", "views", "view_size", "layout", "state", "action", "action_horizon", "relative_action_keys",
            "layout_sentence", "prompt_template", "crop_scale", "color_jitter", "sampling", "serve"}
_REQUIRED = {"views", "view_size", "layout", "state", "action", "action_horizon"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _keyspecs(raw: Any, source: str, tag: str, field_name: str) -> tuple[KeySpec, ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise _fail(source, tag, field_name, "must be a non-empty mapping key -> {column, slice?, dim?}")
    if len(raw) > MAX_KEYS:
        raise _fail(source, tag, field_name, f"has {len(raw)} keys, at most {MAX_KEYS}")
    out = []
    for name, spec in raw.items():
        if isinstance(spec, str):
            spec = {"column": spec}
        if not isinstance(spec, Mapping) or "column" not in spec:
            raise _fail(source, tag, f"{field_name}.{name}", "needs a 'column'")
        unknown = set(spec) - {"column", "slice", "dim"}
        if unknown:
            raise _fail(source, tag, f"{field_name}.{name}", f"unknown keys {sorted(unknown)}")
        start = end = None
        if "slice" in spec:
            sl = spec["slice"]
            if not (isinstance(sl, (list, tuple)) and len(sl) == 2 and all(_is_int(v) for v in sl)
                    and 0 <= sl[0] < sl[1] <= MAX_DIM):
                raise _fail(source, tag, f"{field_name}.{name}.slice",
                            f"must be [start, end) with 0 <= start < end and end at most {MAX_DIM}, got {bounded_repr(sl)}")
            start, end = sl
        dim = spec.get("dim")
        if dim is not None and not (_is_int(dim) and 1 <= dim <= MAX_DIM):
            raise _fail(source, tag, f"{field_name}.{name}.dim", f"must be a positive int, at most {MAX_DIM}, got "
                        f"{bounded_repr(dim)}")
        if dim is not None and start is not None and end - start != dim:
            raise _fail(source, tag, f"{field_name}.{name}", f"slice {[start, end]} has {end - start} dims, dim says {dim}")
        out.append(KeySpec(name=str(name), column=str(spec["column"]), start=start, end=end, dim=dim))
    return tuple(out)


def _serve_spec(raw: Any, source: str, tag: str, views: Mapping, state: tuple[KeySpec, ...]) -> ServeSpec:
    if not isinstance(raw, Mapping):
        raise _fail(source, tag, "serve", "must be a mapping {images, state, ignored?, roboarena?}")
    unknown = set(raw) - {"images", "state", "ignored", "roboarena"}
    if unknown:
        raise _fail(source, tag, f"serve.{sorted(unknown)[0]}", "unknown field; allowed: images, state, ignored, roboarena")
    images, states = raw.get("images"), raw.get("state")
    if not isinstance(images, Mapping) or set(images.values()) != set(views) or len(images) != len(views):
        raise _fail(source, tag, "serve.images", f"must map one protocol key to each view {sorted(views)}, got {bounded_repr(images)}")
    names = {k.name for k in state}
    if not isinstance(states, Mapping) or set(states.values()) != names or len(states) != len(names):
        raise _fail(source, tag, "serve.state", f"must map one protocol key to each state key {sorted(names)}, got {bounded_repr(states)}")
    ignored = raw.get("ignored") or []
    if not isinstance(ignored, list) or not all(isinstance(k, str) for k in ignored):
        raise _fail(source, tag, "serve.ignored", "must be a list of protocol keys")
    arena = raw.get("roboarena")
    if arena is not None:
        if not isinstance(arena, Mapping) or set(arena) != set(ROBOARENA_FIELDS):
            raise _fail(source, tag, "serve.roboarena", f"must hold exactly {list(ROBOARENA_FIELDS)}")
        if arena["action_space"] not in ROBOARENA_ACTION_SPACES:
            raise _fail(source, tag, "serve.roboarena.action_space", f"must be one of {sorted(ROBOARENA_ACTION_SPACES)}")
        res = arena["image_resolution"]
        if res is not None and not (isinstance(res, list) and len(res) == 2
                                    and all(_is_int(v) and 0 < v <= MAX_VIEW_SIDE for v in res)):
            raise _fail(source, tag, "serve.roboarena.image_resolution",
                        f"must be [H, W] (positive ints, each at most {MAX_VIEW_SIDE}) or null, got {bounded_repr(res)}")
        n_ext = arena["n_external_cameras"]
        if n_ext not in (0, 1, 2):
            raise _fail(source, tag, "serve.roboarena.n_external_cameras", f"must be 0, 1 or 2, got {bounded_repr(n_ext)}")
        needed = [f"observation/exterior_image_{i}_left" for i in range(n_ext)]
        needed += ["observation/wrist_image_left"] if arena["needs_wrist_camera"] else []
        if sorted(needed) != sorted(images):
            raise _fail(source, tag, "serve.images", f"RoboArena sends {needed} for this config, not {sorted(images)}")
        for flag in ("needs_wrist_camera", "needs_stereo_camera", "needs_session_id"):
            if not isinstance(arena[flag], bool):
                raise _fail(source, tag, f"serve.roboarena.{flag}", "must be true or false")
        if arena["needs_stereo_camera"]:
            raise _fail(source, tag, "serve.roboarena.needs_stereo_camera", "stereo views are not supported")
        arena = dict(arena)
    return ServeSpec(images=dict(images), state=dict(states), ignored=tuple(ignored), roboarena=arena)


def finite_numbers(value: Any) -> tuple[float, ...] | None:
    """`value` as floats if it is a non-empty list of real, finite numbers (no bools, strings or None), else None."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return None
        try:
            x = float(x)
        except OverflowError:
            return None
        if not math.isfinite(x):
            return None
        out.append(x)
    return tuple(out)


def robot_limits_problem(lo, hi, step, width: int | None) -> str | None:
    """Why action limits are unusable (None if they are fine): min < max per dim, steps > 0, one per dim."""
    if (lo is None) != (hi is None):
        return "action_min and action_max come together"
    for name, value in (("action_min", lo), ("action_max", hi), ("max_step_change", step)):
        if value is not None and width is not None and len(value) != width:
            return f"{name} has {len(value)} numbers; the action has {width} dims"
    if lo is not None and (len(lo) != len(hi) or not all(a < b for a, b in zip(lo, hi))):
        return "action_min must be below action_max on every dim"
    if step is not None and (min(step) <= 0 or (lo is not None and len(step) != len(lo))):
        return "max_step_change must be positive, one number per action dim"
    return None


def _robot_spec(raw: Any, source: str, tag: str, action: tuple[KeySpec, ...]) -> RobotSpec:
    fields_ = {"kind", "name", "action_space", "action_mode", "control_rate_hz", "action_min", "action_max",
               "max_step_change", "joint_names"}
    if not isinstance(raw, Mapping):
        raise _fail(source, tag, "robot", f"must be a mapping of {sorted(fields_)}")
    unknown = set(raw) - fields_
    if unknown:
        raise _fail(source, tag, f"robot.{sorted(unknown)[0]}", f"unknown field; allowed: {sorted(fields_)}")
    for name, choices in (("kind", ROBOT_KINDS), ("action_space", ACTION_SPACES), ("action_mode", ACTION_MODES)):
        if raw.get(name) not in choices:
            raise _fail(source, tag, f"robot.{name}", f"must be one of {list(choices)}, got {bounded_repr(raw.get(name))}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _fail(source, tag, "robot.name", "must name the robot, e.g. 'Unitree G1'")
    rate = raw.get("control_rate_hz")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1000:
        raise _fail(source, tag, "robot.control_rate_hz", f"must be in (0, 1000], got {bounded_repr(rate)}")
    dims = [k.dim for k in action]
    width = sum(dims) if all(d is not None for d in dims) else None

    def per_dim(key: str):
        v = raw.get(key)
        if v is None:
            return None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if width is None:
                raise _fail(source, tag, f"robot.{key}", "one number for every dim needs each action key's `dim`; "
                                                         "give a list, one number per action dim")
            v = [v] * width  # one number for every dim
        numbers = finite_numbers(v)
        if numbers is None:
            raise _fail(source, tag, f"robot.{key}", f"must be a list of finite numbers, one per action dim, got {bounded_repr(v)}")
        return numbers

    lo, hi, step = per_dim("action_min"), per_dim("action_max"), per_dim("max_step_change")
    problem = robot_limits_problem(lo, hi, step, width)
    if problem:
        raise _fail(source, tag, "robot.action_min" if "action_m" in problem else "robot.max_step_change", problem)
    if raw["kind"] == "franka" and (lo is not None or step is not None):
        raise _fail(source, tag, "robot.action_min", "a Franka is described by its site config (dz package --robot, "
                                                     "package.robot); action limits are for the other kinds")
    if raw["kind"] != "franka" and lo is None:
        raise _fail(source, tag, "robot.action_min", f"a {raw['kind']} needs action_min and action_max (the "
                                                     "limits `dz serve` clips every action to)")
    return RobotSpec(kind=raw["kind"], name=name.strip(), action_space=raw["action_space"],
                     action_mode=raw["action_mode"], control_rate_hz=float(rate), action_min=lo, action_max=hi,
                     max_step_change=step, joint_names=_joint_names(raw, source, tag, width))


def _joint_names(raw: Mapping, source: str, tag: str, width: int | None) -> tuple[str, ...] | None:
    names = raw.get("joint_names")
    if names is None:
        return None
    if raw["kind"] == "franka":
        raise _fail(source, tag, "robot.joint_names", "a Franka is described by its site config (dz package --robot); "
                                                      "joint names are for the other kinds")
    if (not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names)
            or len(set(names)) != len(names)):
        raise _fail(source, tag, "robot.joint_names", f"must be a list of distinct names, one per action dim, got "
                                                      f"{names!r:.80}")
    if width is not None and len(names) != width:
        raise _fail(source, tag, "robot.joint_names", f"has {len(names)} names; the action has {width} dims")
    return tuple(names)


def _layout(rows: Any, views: Mapping, source: str, tag: str) -> tuple[tuple[LayoutCell, ...], ...]:
    """Rows of view names, "name*N" spanning N view widths; at most MAX_LAYOUT rows and widths, rows of equal
    width."""
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
        raise _fail(source, tag, "layout", "must be a non-empty list of non-empty rows of view names")
    if len(rows) > MAX_LAYOUT:
        raise _fail(source, tag, "layout", f"has {len(rows)} rows, at most {MAX_LAYOUT}")
    layout = []
    for row in rows:
        cells = []
        for cell in row[:MAX_LAYOUT + 1]:
            m = re.fullmatch(r"([^*\s]+)(?:\*(\d{1,4}))?", str(cell)[:200])
            if not m or m.group(1) not in views:
                raise _fail(source, tag, "layout", f"{bounded_repr(cell)} is not a view name, or name*N with N at "
                            f"most {MAX_LAYOUT} (views: {sorted(views)})")
            cells.append(LayoutCell(view=m.group(1), width=int(m.group(2) or 1)))
        if not all(c.width >= 1 for c in cells) or sum(c.width for c in cells) > MAX_LAYOUT:
            raise _fail(source, tag, "layout", f"a row spans {sum(c.width for c in cells)} view widths; each cell "
                        f"spans at least 1, a row at most {MAX_LAYOUT}")
        layout.append(tuple(cells))
    widths = {sum(c.width for c in row) for row in layout}
    if len(widths) != 1:
        raise _fail(source, tag, "layout", f"rows must have equal total width, got {sorted(widths)}")
    return tuple(layout)


def parse_embodiment(tag: str, raw: Mapping[str, Any], source: str = "<dict>") -> Embodiment:
    if not isinstance(raw, Mapping):
        raise DataError(f"{source}: embodiment {tag!r} must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - _ALLOWED
    if unknown:
        raise _fail(source, tag, sorted(unknown)[0], f"unknown field; allowed: {sorted(_ALLOWED)}")
    missing = _REQUIRED - set(raw)
    if missing:
        raise _fail(source, tag, sorted(missing)[0], "is required")
    views = raw["views"]
    if not isinstance(views, Mapping) or not views or not all(isinstance(v, str) for v in views.values()):
        raise _fail(source, tag, "views", "must map short names to dataset video keys")
    if len(views) > MAX_VIEWS:
        raise _fail(source, tag, "views", f"has {len(views)} views, at most {MAX_VIEWS}")
    size = raw["view_size"]
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(_is_int(v) and 0 < v <= MAX_VIEW_SIDE for v in size)):
        raise _fail(source, tag, "view_size", f"must be [H, W] positive ints, each at most {MAX_VIEW_SIDE}, got "
                    f"{bounded_repr(size)}")
    layout = _layout(raw["layout"], views, source, tag)
    width = sum(c.width for c in layout[0])
    if size[0] * len(layout) > MAX_FRAME_SIDE or size[1] * width > MAX_FRAME_SIDE:
        raise _fail(source, tag, "layout", f"makes a {size[0] * len(layout)}x{size[1] * width} frame of views "
                    f"{size[0]}x{size[1]}; each side must be at most {MAX_FRAME_SIDE}")
    horizon = raw["action_horizon"]
    if not (_is_int(horizon) and 1 <= horizon <= MAX_ACTION_HORIZON):
        raise _fail(source, tag, "action_horizon", f"must be a positive int, at most {MAX_ACTION_HORIZON}, got "
                    f"{bounded_repr(horizon)}")
    state = _keyspecs(raw["state"], source, tag, "state")
    action = _keyspecs(raw["action"], source, tag, "action")
    rel = tuple(raw.get("relative_action_keys") or ())
    state_names = {k.name for k in state}
    action_names = {k.name for k in action}
    for key in rel:
        if key not in action_names or key not in state_names:
            raise _fail(source, tag, "relative_action_keys", f"{bounded_repr(key)} must name both an action key and a state key")
    template = raw.get("prompt_template", "{instruction}")
    for name in ("prompt_template", "layout_sentence"):  # text, never a list or mapping rendered as text
        if isinstance(raw.get(name), (list, tuple, dict)):
            raise _fail(source, tag, name, f"must be a string, got {type(raw[name]).__name__}")
    if "{instruction}" not in str(template):
        raise _fail(source, tag, "prompt_template", "must contain {instruction}")
    scale = float(raw.get("crop_scale", 0.95))
    if not 0 < scale <= 1:
        raise _fail(source, tag, "crop_scale", f"must be in (0, 1], got {scale}")
    jitter = dict(raw.get("color_jitter") or {})
    bad = set(jitter) - {"brightness", "contrast", "saturation", "hue"}
    if bad:
        raise _fail(source, tag, "color_jitter", f"unknown keys {sorted(bad)}")
    if not 0 <= float(jitter.get("hue", 0)) <= 0.5:
        raise _fail(source, tag, "color_jitter.hue", "must be in [0, 0.5]")
    sampling = raw.get("sampling", "multi_anchor")
    if sampling not in SAMPLING_MODES:
        raise _fail(source, tag, "sampling", f"must be one of {SAMPLING_MODES}, got {bounded_repr(sampling)}")
    tag_id = raw.get("tag_id", 0)
    if not (_is_int(tag_id) and 0 <= tag_id <= MAX_TAG_ID):
        raise _fail(source, tag, "tag_id", f"must be an int from 0 to at most {MAX_TAG_ID}, got {bounded_repr(tag_id)}")
    serve = _serve_spec(raw["serve"], source, tag, views, state) if raw.get("serve") is not None else None
    robot = _robot_spec(raw["robot"], source, tag, action) if raw.get("robot") is not None else None
    return Embodiment(tag=tag, tag_id=tag_id, views=dict(views), view_size=(size[0], size[1]), layout=layout,
                      state=state, action=action, action_horizon=horizon, relative_action_keys=rel,
                      layout_sentence=str(raw.get("layout_sentence", "")), prompt_template=str(template),
                      crop_scale=scale, color_jitter={k: float(v) for k, v in jitter.items()}, sampling=sampling,
                      serve=serve, robot=robot, source=source)


def _read_yaml(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise DataError(f"embodiment file not found: {path}")
    try:
        data = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise DataError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise DataError(f"{path}: must map embodiment tags to their configs")
    return data


class EmbodimentRegistry(dict):
    """tag -> Embodiment for the entries that parse; `broken` holds each bad entry's error, raised only when that
    tag is asked for, so one bad entry does not take the rest of its file down."""

    def __init__(self):
        super().__init__()
        self.broken: dict[str, DataError] = {}


def load_embodiments(paths: Iterable[str | Path] = (), extra: Mapping[str, Mapping] | None = None,
                     include_builtin: bool = True) -> EmbodimentRegistry:
    """The registry: built-ins, then each YAML file, then `extra` (later entries replace earlier ones)."""
    registry = EmbodimentRegistry()
    sources: list[tuple[str, dict]] = []
    if include_builtin:
        sources.append((str(BUILTIN_YAML), _read_yaml(BUILTIN_YAML)))
    for p in paths:
        sources.append((str(p), _read_yaml(Path(p))))
    if extra:
        sources.append(("<params>", dict(extra)))
    for source, entries in sources:
        for tag, raw in entries.items():
            try:
                registry[str(tag)] = parse_embodiment(str(tag), raw, source)
                registry.broken.pop(str(tag), None)
            except DataError as exc:
                registry.pop(str(tag), None)
                registry.broken[str(tag)] = exc
    return registry


def get_embodiment(tag: str, registry: Mapping[str, Embodiment] | None = None) -> Embodiment:
    registry = load_embodiments() if registry is None else registry
    broken = getattr(registry, "broken", {})
    if tag in broken:
        raise broken[tag]
    if tag not in registry:
        raise DataError(f"unknown embodiment tag {tag!r}; known: {', '.join(sorted(registry))} "
                        f"(add one with a YAML entry, see {BUILTIN_YAML.name})")
    return registry[tag]
