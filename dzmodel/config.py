"""The typed schema of params.yaml: the single source of every pipeline stage's parameters, in profiles.

    profile: demo                 # the profile `dvc repro` and `dz stage` use unless told otherwise
    profiles:
      demo:      {fetch: ..., metadata: ..., vision: ..., cache: ..., train: ..., convert: ..., eval: ..., package: ...,
                  promote: ...}
      libero_5b: {...}
      droid_14b: {...}

`load_params` validates the whole file, `--set` overrides included, before anything runs: an unknown key, a wrong
type or an out-of-range value anywhere is one `ParamsError` naming the file and each bad field. Every number must be
finite (YAML's .nan and .inf are refused) and inside its field's range, LIBERO task indices inside their suite, and
every name that becomes part of a path (package version and name, registered model, alias, experiment, embodiment,
profile) a plain name: no separators, no '..'. Stage outputs live at fixed places
under the project root (`StagePaths`, dzmodel/stage_paths.py), so dvc.yaml can name them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .eval.record_params import RecordParams
from .eval.rollout import RolloutParams, check_suite_tasks
from .schema import SEED, SchemaError, bounded_repr, build, load_yaml
from .stage_paths import StagePaths
from .stage_table import STAGES, stage_params

PROFILE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
# The standard fixed init states per LIBERO task: the static bound of the evaluated init states.
LIBERO_INIT_STATES = 50
LEARNING_RATE = {"gt": 0, "max": 1.0}
PLAIN_NAME = {"plain_name": True}
# MLflow's alias rule, and the forms it reserves for its own version references.
MLFLOW_ALIAS = re.compile(r"[A-Za-z0-9_-]+")
MLFLOW_RESERVED_ALIAS = re.compile(r"latest|v[0-9]+", re.IGNORECASE)
# Train fields the pipeline fills from the upstream stages' outputs; params.yaml must not set them.
PIPELINE_TRAIN_FIELDS = ("datasets", "metadata", "embodiment", "embodiment_files", "out_dir", "cache", "progress",
                         "stop_at")
LAUNCH_FIELDS = ("nproc_per_node", "nnodes")


class ParamsError(ValueError):
    """params.yaml (or an override) is invalid; the message names the file and every bad field."""


@dataclass
class FetchParams:
    source: str = "synthetic"  # a hub dataset repo id, a local LeRobot directory, "synthetic" or "libero" (recorded)
    revision: str | None = None  # required for hub ids: a commit sha or tag
    allow: list[str] = field(default_factory=list)  # hub allow-patterns, e.g. ['meta/*', 'data/*', 'videos/*']
    synth_episodes: int = field(default=8, metadata={"min": 1, "max": 100_000})
    synth_length: int = field(default=96, metadata={"min": 16, "max": 100_000})
    # walk: random walks (not predictable from a frame); orbit: actions a policy can learn (dzmodel/data/synth.py)
    synth_motion: Literal["walk", "orbit"] = "walk"
    # the layout: LIBERO's two views (8-dim state, 7-dim action), DROID's three views and 14/21-dim columns, or a
    # humanoid's head camera and 26 joints (dzmodel/data/synth.py)
    synth_embodiment: Literal["libero_sim", "oxe_droid", "unitree_g1"] = "libero_sim"
    seed: int = field(default=0, metadata=SEED)
    retries: int = field(default=3, metadata={"min": 0, "max": 10})  # network fetches are retried with backoff
    retry_delay_s: float = field(default=10.0, metadata={"min": 0, "max": 3600})
    skip_missing: bool = False  # accept a source that lacks some video files (set train.skip_missing too)
    # source "libero" only: the recording's options, declared with `dz data record libero`'s (eval/record_params.py)
    record: RecordParams = field(default_factory=RecordParams)

    def __post_init__(self) -> None:
        if self.source in ("synthetic", "libero") or "/" not in self.source:
            return
        if self.source.startswith((".", "/", "~")) or Path(self.source).exists():  # a path, never a hub id
            if not Path(self.source).expanduser().exists():
                raise ValueError(f"fetch.source: {self.source!r} is a path (it starts with '{self.source[0]}') and "
                                 "does not exist; a hub dataset is named owner/name")
        elif not self.revision:
            raise ValueError(f"fetch.revision: hub dataset {self.source!r} needs a pinned revision (sha or tag)")


@dataclass
class MetadataParams:
    embodiment: str = field(default="libero_sim", metadata=PLAIN_NAME)
    embodiment_files: list[str] = field(default_factory=list)  # extra embodiment YAMLs (project-relative)
    max_episodes: int | None = field(default=None, metadata={"min": 1})


@dataclass
class VisionParams:
    """The vision stage (dzmodel/train/vision.py): the offline presets' seeded random VAE trained as an autoencoder
    on the dataset's frames before SFT; cache and train then use it (train.encoder_weights.vae). Off for presets
    with real WAN weights."""
    enabled: bool = False
    steps: int = field(default=2000, metadata={"min": 1})
    batch_size: int = field(default=8, metadata={"min": 1, "max": 1 << 16})
    lr: float = field(default=1e-3, metadata=LEARNING_RATE)
    clip_frames: int = field(default=5, metadata={"min": 1, "max": 1024})  # 1 + 4k frames of the SFT windows
    kl_weight: float = field(default=1e-5, metadata={"min": 0, "max": 10})  # KL to N(0, I); 0: a plain autoencoder
    # the reconstruction is measured on the last N episodes (never trained on; train.heldout_episodes' too)
    heldout_episodes: int = field(default=1, metadata={"min": 1})
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when there is one
    num_workers: int = field(default=0, metadata={"min": 0, "max": 256})
    frame_cache_mib: int = field(default=0, metadata={"min": 0, "max": 1 << 20})  # per loader process (dzmodel/data/dataset.py)
    # the recording decoded once onto the device, clips gathered and augmented there (no loader workers)
    data_on_device: bool = False
    # on CUDA, each step's forward and backward replay as CUDA graphs (the same kernels, launched at once)
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if (self.clip_frames - 1) % 4:
            raise ValueError(f"vision.clip_frames must be 1 + 4k (1, 5, 9, ...): the VAE encodes frame 0 alone, then "
                             f"4 frames per latent frame; got {self.clip_frames}")


@dataclass
class CacheParams:
    enabled: bool = False  # precompute the frozen encoders' outputs once; train reads them
    stride: int = field(default=1, metadata={"min": 1})
    batch_size: int = field(default=8, metadata={"min": 1, "max": 1 << 16})


@dataclass
class ConvertParams:
    max_shard_gib: float = field(default=5.0, metadata={"gt": 0, "max": 1024})
    # the optimizer's weights, or the EMA (a run with train.ema_decay > 0); eval and package take what convert wrote
    weights: str = field(default="raw", metadata={"choices": ("raw", "ema")})


@dataclass
class EvalParams(RolloutParams):
    enabled: bool = True
    # init states per task, after the `episodes` reported ones, that pick the checkpoint; the pick is then reported
    # on init states 0..episodes-1. 0: nothing is picked, the final number pools the last 3 checkpoints.
    select_episodes: int = field(default=0, metadata={"min": 0})
    # all: every converted step (or `steps`); last: only the newest, fixed before any evaluation, and the final number
    # is its own (nothing picked; a third of pooling's episodes)
    checkpoints: Literal["all", "last"] = "all"
    # with checkpoints: last, the success-vs-step curve: every earlier converted checkpoint on init states
    # 0..curve_episodes-1 per task (no videos, no perturbations); the last keeps all `episodes` and the final number.
    # 0: no curve (only the last checkpoint is evaluated)
    curve_episodes: int = field(default=0, metadata={"min": 0})
    steps: list[int] | None = field(default=None, metadata={"min": 1})  # checkpoint steps; null = every saved one
    solver_steps: int = field(default=16, metadata={"min": 1, "max": 1000})
    cfg_scale: float = field(default=5.0, metadata={"min": 0, "max": 100})
    dit_steps: str = ""  # solver steps that run the DiT (T) or reuse its velocity (F); "upstream"; "" = every step
    device: str = "cpu"
    # the held-out action error (dzmodel/eval/action_error.py) of every converted step, LIBERO or not (`enabled`
    # is the LIBERO rollouts); it needs train.heldout_episodes >= 1, else it is skipped and the stage says so
    action_error: bool = True
    action_error_stride: int = field(default=4, metadata={"min": 1})  # frames between the held-out windows' anchors
    action_error_windows: int | None = field(default=None, metadata={"min": 1})  # at most this many windows
    # world-model previews (dzmodel/eval/previews.py): decoded predicted video of this many held-out windows per
    # converted step, beside the real frames (mp4s and a PNG grid); 0: none. Needs train.heldout_episodes.
    previews: int = field(default=2, metadata={"min": 0, "max": 1000})

    def __post_init__(self) -> None:
        from .eval.perturb_spec import parse_perturbations
        from .model.sampler import SolverConfig

        check_suite_tasks(self.tasks, self.suite, "eval.tasks")
        parse_perturbations(self.perturb, "eval.perturb")
        init_states = self.episodes + self.select_episodes
        if init_states > LIBERO_INIT_STATES:
            raise ValueError(f"eval: episodes + select_episodes = {init_states} init states per task; LIBERO has "
                             f"{LIBERO_INIT_STATES} (init states 0..{LIBERO_INIT_STATES - 1})")
        if self.checkpoints == "last" and (self.select_episodes or self.steps):
            raise ValueError("eval.checkpoints: last evaluates the newest checkpoint only; it picks nothing, so "
                             "eval.select_episodes must be 0 and eval.steps null")
        if self.curve_episodes and self.checkpoints != "last":
            raise ValueError("eval.curve_episodes: needs eval.checkpoints: last (checkpoints: all evaluates every "
                             "checkpoint on all eval.episodes already)")
        if self.curve_episodes > self.episodes:
            raise ValueError(f"eval.curve_episodes: must be at most eval.episodes ({self.episodes}), "
                             f"got {self.curve_episodes}")
        try:
            SolverConfig(num_steps=self.solver_steps, cfg_scale=self.cfg_scale, dit_steps=self.dit_steps)
        except ValueError as exc:
            raise ValueError(f"eval.dit_steps: {exc}") from None


@dataclass
class PackageParams:
    version: str = field(default="0.1.0", metadata=PLAIN_NAME)  # the bundle is <name>-<version>
    name: str | None = field(default=None, metadata=PLAIN_NAME)  # default dreamzero-<embodiment>
    checkpoint: str = field(default="best", metadata={"choices": ("best", "last")})  # best = highest eval success
    # a Franka's site config (dzmodel.serve.package.RobotConfig fields); empty for an embodiment whose robot: block
    # describes another robot (a humanoid, another arm)
    robot: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from .serve.package import PackageError, RobotConfig

        if not self.robot:
            return
        try:
            RobotConfig.from_dict(self.robot, "package.robot")
        except PackageError as exc:
            raise ValueError(str(exc)) from None


@dataclass
class PromoteParams:
    registered_model: str = field(default="dreamzero", metadata=PLAIN_NAME)
    alias: str = field(default="production", metadata=PLAIN_NAME)
    # the gate on the packaged step: its LIBERO success (null: no success gate, e.g. no simulator can be passed) and
    # its held-out action error over the mean predictor's (null: not gated); each set check must pass
    min_success: float | None = field(default=0.5, metadata={"min": 0, "max": 1})
    max_action_error_ratio: float | None = field(default=None, metadata={"gt": 0, "max": 100})
    # head to head: the candidate and the model holding the alias, on the candidate's held-out episodes; the
    # candidate's action error may exceed the current one's by at most this fraction (null: not compared)
    max_regression: float | None = field(default=0.05, metadata={"min": 0, "max": 10})

    def __post_init__(self) -> None:
        if not MLFLOW_ALIAS.fullmatch(self.alias):
            raise ValueError(f"promote.alias: MLflow aliases take letters, digits, '_' and '-', got {self.alias!r}")
        if MLFLOW_RESERVED_ALIAS.fullmatch(self.alias):
            raise ValueError(f"promote.alias: {self.alias!r} is reserved by MLflow (latest, v<N>); pick another")
        if self.min_success is None and self.max_action_error_ratio is None:
            raise ValueError("min_success and max_action_error_ratio are both null: a gate that checks nothing "
                             "cannot refuse; set one")


@dataclass
class TrackingParams:
    # MLFLOW_TRACKING_URI in the environment wins (a team server); paths are relative to the project root.
    mlflow_uri: str = "sqlite:///mlruns/mlflow.db"
    artifact_root: str = "mlruns/artifacts"
    experiment: str | None = field(default=None, metadata=PLAIN_NAME)  # default dreamzero-<profile>
    # where people open this store's MLflow UI (the links in Prefect artifacts and the run summary); null: the
    # tracking URI itself when it is http(s), else http://127.0.0.1:5000 (`mlflow ui`'s default)
    ui_url: str | None = None

    def __post_init__(self) -> None:
        if self.ui_url is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", self.ui_url):
            raise ValueError(f"tracking.ui_url: an http(s) address such as https://mlflow.lab:5000, got "
                             f"{self.ui_url!r}")


@dataclass
class Profile:
    description: str = ""
    fetch: FetchParams = field(default_factory=FetchParams)
    metadata: MetadataParams = field(default_factory=MetadataParams)
    vision: VisionParams = field(default_factory=VisionParams)
    cache: CacheParams = field(default_factory=CacheParams)
    # launch (nproc_per_node, nnodes) + TrainConfig fields, checked as a TrainConfig by parse_params
    train: dict[str, Any] = field(default_factory=dict, metadata={"checked_by": "TrainConfig"})
    convert: ConvertParams = field(default_factory=ConvertParams)
    eval: EvalParams = field(default_factory=EvalParams)
    package: PackageParams = field(default_factory=PackageParams)
    promote: PromoteParams = field(default_factory=PromoteParams)
    tracking: TrackingParams = field(default_factory=TrackingParams)

    def __post_init__(self) -> None:
        from .model.args import OFFLINE_PRESETS

        weights = self.train.get("encoder_weights") if isinstance(self.train, dict) else None
        vae = weights.get("vae") if isinstance(weights, dict) else None
        if self.vision.enabled and vae:
            raise ValueError(f"vision.enabled: train.encoder_weights.vae is set ({vae}); vision pretraining replaces "
                             "a seeded random VAE, so set vision.enabled: false for real weights")
        preset_name = self.train.get("preset", "tiny") if isinstance(self.train, dict) else "tiny"
        if self.vision.enabled and preset_name not in OFFLINE_PRESETS:
            raise ValueError(f"vision.enabled: preset {bounded_repr(preset_name)} takes real WAN encoder weights; "
                             f"vision pretraining is for the offline presets ({', '.join(OFFLINE_PRESETS)})")
        if not self.package.robot and not self.metadata.embodiment_files:
            from .data.embodiments import load_embodiments

            builtin = load_embodiments().get(self.metadata.embodiment)  # a user file's robot is checked at package
            if builtin is not None and (builtin.robot is None or builtin.robot.kind == "franka"):
                raise ValueError(f"package.robot: embodiment {self.metadata.embodiment!r} drives a Franka arm: give "
                                 "its site config (robot_ip, camera_serials, target_ee_pose, workspace_min, "
                                 "workspace_max)")

    @property
    def launch(self) -> dict[str, int]:
        return {"nproc_per_node": int(self.train.get("nproc_per_node", 1)), "nnodes": int(self.train.get("nnodes", 1))}


@dataclass
class Params:
    profile: str
    profiles: dict[str, Profile]

    def __post_init__(self) -> None:
        bad = [n for n in self.profiles if not PROFILE_NAME.fullmatch(n)]
        if bad:
            raise ValueError(f"profiles: names must be lower_snake_case (at most 64 characters), got {bad}")
        if self.profile not in self.profiles:
            raise ValueError(f"profile: {self.profile!r} is not one of the profiles {sorted(self.profiles)}")

    def selected(self, name: str | None = None) -> Profile:
        name = name or self.profile
        if name not in self.profiles:
            raise ParamsError(f"profile {name!r} is not in params.yaml (profiles: {', '.join(sorted(self.profiles))})")
        return self.profiles[name]


# --- loading ------------------------------------------------------------------------------------------

def read_yaml(path: str | Path) -> Any:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: no such parameters file")
    try:  # read only as far as load_yaml's size cap
        return load_yaml(path, yaml12_numbers=True)
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    except OSError as exc:
        raise ParamsError(f"{path}: cannot read the parameters file ({exc.strerror or exc})") from None


def apply_overrides(raw: dict, overrides: list[str], profile: str, source: str = "params.yaml") -> dict:
    """`stage.key=value` (or `stage.key.sub=value`) overrides on one profile; values parse as YAML."""
    import yaml

    raw = copy.deepcopy(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        parts = key.split(".")
        if not sep or not all(parts):
            raise ParamsError(f"override {bounded_repr(item)}: expected stage.key=value, e.g. train.steps=20")
        profiles = raw.setdefault("profiles", {})
        if not isinstance(profiles, dict):
            raise ParamsError(f"{source}: profiles: expected a mapping of profiles, got {type(profiles).__name__}")
        node = profiles.setdefault(profile, {})
        walked = ["profiles", str(profile)]
        for part in parts[:-1]:
            if not isinstance(node, dict):
                break
            node = node.setdefault(part, {})
            walked.append(part)
        if not isinstance(node, dict):
            raise ParamsError(f"override {bounded_repr(item)}: {source}'s {'.'.join(walked)} is not a mapping")
        try:  # a one-line value needs no anchors or aliases
            node[parts[-1]] = load_yaml(value, yaml12_numbers=True, aliases=False)
        except yaml.YAMLError as exc:
            raise ParamsError(f"override {bounded_repr(item)}: the value is not valid YAML "
                              f"({str(exc).splitlines()[0]})") from None
    return raw


def _default_text(path: str) -> str:
    """': <default>' of a train or metadata field, for the message that asks to write it out."""

    from .train.config import TrainConfig

    section, _, name = path.partition(".")
    owner = {"train": TrainConfig, "metadata": MetadataParams}.get(section)
    fields = {f.name: f for f in dataclasses.fields(owner)} if owner and name else {}
    if name not in fields:
        return ""
    f = fields[name]
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return f": {json.dumps(value)}"


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    """Every problem in the file at once: the schema's, then each profile's train section (a TrainConfig)."""
    problems: list[str] = []
    params = None
    try:
        params = build(Params, raw, source="")
    except SchemaError as exc:
        problems.extend(exc.problems)
    profiles = raw.get("profiles") if isinstance(raw, dict) else None
    for name, prof in (profiles.items() if isinstance(profiles, dict) else ()):
        if isinstance(prof, dict):  # DVC refuses a stage whose params are missing: each must be written out
            from .stage_table import missing_params

            problems.extend(f"profiles.{name}.{path}: missing (dvc.yaml's {stage} stage depends on it; write it "
                            f"out, even as the default{_default_text(path)})" for path, stage in missing_params(prof))
        train = prof.get("train", {}) if isinstance(prof, dict) else None
        if isinstance(train, dict):
            try:
                _train_config(train, MetadataParams(), False, StagePaths(Path("."), str(name)))
            except ParamsError as exc:
                problems.extend(str(exc).splitlines())
    if problems:
        problems = list(dict.fromkeys(p.strip() for p in problems))
        raise ParamsError(f"{source}: {problems[0]}" if len(problems) == 1 else
                          f"{source}: {len(problems)} problems:\n  " + "\n  ".join(problems))
    assert params is not None
    return params


def load_params(path: str | Path = "params.yaml", overrides: list[str] | None = None,
                profile: str | None = None) -> Params:
    raw = read_yaml(path)
    if overrides:
        if not isinstance(raw, dict):
            raise ParamsError(f"{path}: expected a mapping at the top level")
        name = profile or raw.get("profile")
        if not isinstance(name, str):
            raise ParamsError(f"{path}: profile: expected the name of a profile, got {bounded_repr(name)}")
        original, raw = raw, apply_overrides(raw, overrides, name, str(path))
        try:
            params = parse_params(raw, str(path))
        except ParamsError as exc:
            raise _blame_overrides(exc, original, overrides, name, str(path)) from None
    else:
        params = parse_params(raw, str(path))
    params.selected(profile)
    return params


def _blame_overrides(exc: ParamsError, original: dict, overrides: list[str], profile: str,
                     path: str) -> ParamsError:
    """The error of a file that is valid without its `--set` overrides names the overrides, not the file: each
    problem under one override's key as `--set KEY=VALUE: problem`."""
    try:
        parse_params(original, path)
    except ParamsError:
        return exc  # the file itself has problems: they are reported as the file's
    text = str(exc).removeprefix(f"{path}: ")
    head, sep, rest = text.partition(" problems:\n  ")
    problems = rest.split("\n  ") if sep and head.isdigit() else [text]
    prefix = f"profiles.{profile}."
    blamed = []
    for problem in problems:
        where, _, what = problem.partition(": ")
        key = where.removeprefix(prefix)
        item = next((o for o in overrides if key == o.partition("=")[0]), None)
        inner = next((o for o in overrides if key.startswith((o.partition("=")[0] + ".", o.partition("=")[0] + "["))),
                     None)
        if where.startswith(prefix) and item:
            blamed.append(f"--set {item}: {what}")
        elif where.startswith(prefix) and inner:  # a part of the value: train.betas[1]
            blamed.append(f"--set {inner}: {key}: {what}")
        else:
            blamed.append(f"with --set {', '.join(overrides)}: {problem}")
    return ParamsError(blamed[0] if len(blamed) == 1 else f"{len(blamed)} problems:\n  " + "\n  ".join(blamed))


def train_config(prof: Profile, paths: StagePaths, vision_vae: bool = True):
    """The TrainConfig the train stage runs, from the profile's train section and the upstream outputs: with
    vision.enabled, the vision stage's VAE (vision_vae=False: the seeded random one it starts from)."""
    cfg = _train_config(prof.train, prof.metadata, prof.cache.enabled, paths)
    if vision_vae and prof.vision.enabled:
        cfg.encoder_weights = {**cfg.encoder_weights, "vae": str(paths.vision_vae)}
    return cfg


def _train_config(train: dict, metadata: MetadataParams, cache_enabled: bool, paths: StagePaths):
    from .train.config import TrainConfig

    where = f"profiles.{paths.profile}.train"
    owned = sorted(set(train) & set(PIPELINE_TRAIN_FIELDS))
    problems = [f"{where}.{k}: set by the pipeline from the upstream stages; remove it" for k in owned]
    for key in LAUNCH_FIELDS:
        value = train.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            problems.append(f"{where}.{key}: must be an integer in [1, 4096], got {bounded_repr(value)}")
    fields = {k: v for k, v in train.items() if k not in LAUNCH_FIELDS and k not in PIPELINE_TRAIN_FIELDS}
    fields.update(datasets=[str(paths.dataset)], metadata=str(paths.metadata), embodiment=metadata.embodiment,
                  embodiment_files=[str(paths.root / f) for f in metadata.embodiment_files],
                  out_dir=str(paths.stage("train")), progress=True)
    if cache_enabled:
        fields["cache"] = str(paths.stage("cache"))
        from .model.args import OFFLINE_PRESETS

        if not fields.get("tokenizer") and fields.get("preset", "tiny") in OFFLINE_PRESETS:
            # the offline tokenizer the cache stage built: training from the cache never builds one, and
            # `dz convert` must copy it beside the weights
            fields["tokenizer"] = str(paths.tokenizer)
    try:
        cfg = build(TrainConfig, fields, path=where)
    except SchemaError as exc:
        problems.extend(exc.problems)
    if problems:
        raise ParamsError("\n".join(problems))
    world = int(train.get("nproc_per_node", 1)) * int(train.get("nnodes", 1))
    try:
        cfg.accumulation(world)
    except ValueError as exc:
        raise ParamsError(f"{where}: {exc} (world size = nproc_per_node x nnodes)") from None
    return cfg


def profile_dict(prof: Profile) -> dict[str, Any]:
    """The profile as plain data (for MLflow params and artifacts, and the stages' cache keys)."""
    from dataclasses import asdict

    data = json.loads(json.dumps(asdict(prof), default=list, allow_nan=False))
    if not data["eval"].get("perturb"):  # absent by default: existing eval cache keys and digests stay valid
        data["eval"].pop("perturb", None)
    if not data["eval"].get("curve_episodes"):  # likewise: no curve keeps the keys of before
        data["eval"].pop("curve_episodes", None)
    return data


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def params_digest(profile: dict[str, Any]) -> str:
    """A short digest of a profile's resolved params (defaults filled in, overrides applied)."""
    return hashlib.sha256(json.dumps(profile, sort_keys=True, default=str).encode()).hexdigest()[:8]


PROJECT_PARAMS = "params.yaml"  # the file dvc.yaml reads (`vars: [params.yaml]`), in the project's root


def stages_params(resolved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The params each stage of the table reads (part of its cache key), from a profile's plain data."""
    return {s: stage_params(resolved, s) for s in STAGES}


@dataclass(frozen=True)
class RunParams:
    """One pipeline run's parameters, read, checked and resolved once (`load_run`): the selected profile and its
    plain data, from which its digest, its flat MLflow form and the params each stage reads follow; and, when first
    asked for, the params each stage reads in the project's own params.yaml as dvc.yaml runs it."""
    root: Path
    params_file: Path
    name: str
    params: Params
    prof: Profile
    resolved: dict[str, Any]
    overrides: tuple[str, ...]

    @property
    def digest(self) -> str:
        return params_digest(self.resolved)

    @property
    def flat(self) -> dict[str, Any]:
        return flatten(self.resolved)

    @property
    def stage_params(self) -> dict[str, dict[str, Any]]:
        return stages_params(self.resolved)

    @functools.cached_property
    def project_stage_params(self) -> dict[str, dict[str, Any]] | None:
        """None where the project's params.yaml is invalid or selects another profile (read once, when asked)."""
        same_file = not self.overrides and self.params_file.resolve() == (self.root / PROJECT_PARAMS).resolve()
        try:
            project = self.params if same_file else load_params(self.root / PROJECT_PARAMS)
        except (ValueError, OSError):  # a params.yaml DVC cannot run either
            return None
        return stages_params(profile_dict(project.selected(self.name))) if project.profile == self.name else None


def load_run(root: Path, params_path: str | Path = PROJECT_PARAMS, overrides: list[str] | None = None,
             profile: str | None = None) -> RunParams:
    """`load_params` plus the selected profile's plain data, once; bad params are refused before any work."""
    params = load_params(root / params_path, overrides or [], profile)
    name = profile or params.profile
    prof = params.selected(name)
    return RunParams(root=root, params_file=root / params_path, name=name, params=params, prof=prof,
                     resolved=profile_dict(prof), overrides=tuple(overrides or ()))
