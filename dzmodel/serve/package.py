"""`dz package`: a versioned, checksummed deployment bundle for a Franka arm, or for the robot an embodiment
describes (`robot:`: a humanoid, another arm), with the action limits `dz serve` enforces.

    <out>/<name>-<version>/
        model/            the converted model (config.json, safetensors, experiment_cfg/, tokenizer/) and
                          model/encoders/ (the run's frozen encoders, so the bundle needs nothing else)
        config.json       the model config (a copy of model/config.json)
        metadata.json     the normalisation statistics
        embodiment.json   the embodiment: views, layout, action horizon, gripper threshold
        robot.json        the robot config (validated by RobotConfig)
        eval/             the evaluation results that justified the release
        MODEL_CARD.md
        MANIFEST          "sha256  size  path" of every other file
        MANIFEST.sig      with `--sign KEY`: the lab's ed25519 signature over MANIFEST (`bundles.py`)
    <out>/<name>-<version>.tar.gz

Both are built under fresh temporary names in <out> (never a fixed name, so never through a link planted
there), one `dz package` at a time per folder, and put in place only when complete, never over an existing
version. Loading verifies every file against MANIFEST and refuses a missing, extra or modified file; a tarball
is verified while it is extracted into the bundle cache, never beside itself, and its cached copy again on every
later load (`bundles.py`). Given a trusted public key (`trust`, or DZ_TRUST_KEY), loading also refuses a bundle
whose MANIFEST.sig is missing or not by that key. `dz serve` verifies by copying each file once into a private
folder and loads from that copy (`verified_copy`): what it serves is what was verified.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import json
import logging
import math
import os
import shutil
import stat
import tarfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_bytes, atomic_write_text, temp_file
from ..data.embodiments import BUILTIN_YAML, finite_numbers, get_embodiment, load_embodiments, robot_limits_problem
from ..data.errors import DataError
from ..dirlock import directory_lock
from ..outputs import OWNER_MARKER, check_output_dir, claim_dir, new_temp_dir
from ..schema import bounded_repr, load_yaml
from . import franka
from .bundles import (MANIFEST, MAX_MANIFEST_BYTES, SIGNATURE, TRUST_ENV, BundleError, ExtractLimits, cached_bundle,
                      check_signature, evict, file_sha256, load_signing_key, open_regular, parse_manifest,
                      shown, sign_manifest, tarball_manifest)

log = logging.getLogger(__name__)

EVAL_FILES = ("results.csv", "episodes.csv", "summary.json", "success_vs_step.png")
MAX_JSON_BYTES = 16 << 20   # robot.json, embodiment.json as a loader reads them
MAX_FOLDERS = 1000          # folders of a bundle folder, beyond its files (a bundle uses under 20)


class PackageError(ValueError):
    """A bundle or robot config that must not be used; the message names the file or field."""


@dataclass(frozen=True)
class RobotConfig:
    robot_ip: str
    camera_serials: tuple[str, ...]
    target_ee_pose: tuple[float, ...]        # x y z (m) rx ry rz (rad), base frame
    workspace_min: tuple[float, float, float]
    workspace_max: tuple[float, float, float]
    control_rate_hz: float = 15.0
    gripper_threshold: float = 0.5           # gripper command above it closes (reference §6.2)
    joint_min: tuple[float, ...] | None = None   # rad per joint: tighter than the Panda's published limits (franka.py)
    joint_max: tuple[float, ...] | None = None
    # written by `dz package` (`for_embodiment`): the actions' space and the range `dz serve` clips them to
    action_space: str | None = None          # joint | end_effector
    action_min: tuple[float, ...] | None = None
    action_max: tuple[float, ...] | None = None

    @classmethod
    def from_dict(cls, raw: Any, source: str = "robot config") -> "RobotConfig":
        if not isinstance(raw, dict):
            raise PackageError(f"{source}: expected a mapping of robot fields, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise PackageError(f"{source}: unknown field(s) {unknown}; known: {sorted(known)}")
        required = ("robot_ip", "camera_serials", "target_ee_pose", "workspace_min", "workspace_max")
        missing = [name for name in required if name not in raw]
        if missing:
            raise PackageError(f"{source}: missing field(s) {missing}")

        def numbers(name, n):
            v = raw[name]
            if not isinstance(v, (list, tuple)) or len(v) != n or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
                raise PackageError(f"{source}: {name} must be {n} finite numbers, got {bounded_repr(v)}")
            return tuple(float(x) for x in v)

        try:
            ip = str(ipaddress.ip_address(raw["robot_ip"] if isinstance(raw["robot_ip"], str) else ""))
        except ValueError:
            raise PackageError(f"{source}: robot_ip must be an IPv4 or IPv6 address, got {bounded_repr(raw['robot_ip'])}") from None
        serials = raw["camera_serials"]
        if not isinstance(serials, (list, tuple)) or not serials or not all(isinstance(s, str) and s.strip() for s in serials):
            raise PackageError(f"{source}: camera_serials must be a non-empty list of non-empty strings, got {bounded_repr(serials)}")
        pose, lo, hi = numbers("target_ee_pose", 6), numbers("workspace_min", 3), numbers("workspace_max", 3)
        if not all(a < b for a, b in zip(lo, hi)):
            raise PackageError(f"{source}: workspace_min {lo} must be below workspace_max {hi} on every axis")
        if not all(a <= p <= b for a, p, b in zip(lo, pose[:3], hi)):
            raise PackageError(f"{source}: target_ee_pose position {pose[:3]} is outside the workspace {lo}..{hi}")
        rate = raw.get("control_rate_hz", cls.control_rate_hz)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1000:
            raise PackageError(f"{source}: control_rate_hz must be in (0, 1000], got {bounded_repr(rate)}")
        thr = raw.get("gripper_threshold", cls.gripper_threshold)
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 <= thr <= 1:
            raise PackageError(f"{source}: gripper_threshold must be in [0, 1], got {bounded_repr(thr)}")
        return cls(ip, tuple(s.strip() for s in serials), pose, lo, hi, float(rate), float(thr),
                   *_joint_limits(raw, source), *_served_limits(raw, source))

    @classmethod
    def load(cls, path: str | Path) -> "RobotConfig":
        path = Path(path)
        if not path.is_file():
            raise PackageError(f"{path}: robot config not found")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                raw = load_yaml(text)
            else:
                raw = json.loads(text)
        except Exception as exc:
            raise PackageError(f"{path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {exc}") from None
        return cls.from_dict(raw, str(path))

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def for_embodiment(self, emb, action_dim: int) -> "RobotConfig":
        """This site config with the action limits `dz serve` enforces for `emb`'s actions (franka.py): for joint
        positions, the Panda's published joint limits (or the tighter joint_min/joint_max) and the gripper's
        range; for end-effector actions none (the workspace is for the robot's own controller)."""
        if self.action_space is not None or self.action_min is not None:
            raise PackageError("robot config: action_space, action_min and action_max are written by dz package; "
                               "give joint_min and joint_max to tighten the joint limits")
        space = franka.action_space(emb)
        if space != "joint":
            if self.joint_min is not None:
                raise PackageError(f"robot config: joint_min and joint_max apply to joint-position actions; "
                                   f"embodiment {emb.tag!r} sends end-effector actions")
            return replace(self, action_space=space)
        try:
            lo, hi = franka.action_limits(emb, action_dim, self.joint_min, self.joint_max)
        except franka.FrankaLimitsError as exc:
            raise PackageError(str(exc)) from None
        return replace(self, action_space=space, action_min=tuple(lo), action_max=tuple(hi))


def _optional_numbers(raw: dict, name: str, source: str) -> tuple[float, ...] | None:
    if raw.get(name) is None:
        return None
    numbers = finite_numbers(raw[name])
    if numbers is None:
        raise PackageError(f"{source}: {name} must be a list of finite numbers, got {bounded_repr(raw[name])}")
    return numbers


def _joint_limits(raw: dict, source: str) -> tuple:
    """(joint_min, joint_max): both or neither, inside the Franka Panda's published limits."""
    lo, hi = _optional_numbers(raw, "joint_min", source), _optional_numbers(raw, "joint_max", source)
    if (lo is None) != (hi is None):
        raise PackageError(f"{source}: joint_min and joint_max come together")
    problem = franka.tightened_problem(lo, hi) if lo is not None else None
    if problem:
        raise PackageError(f"{source}: {problem}")
    return lo, hi


def _served_limits(raw: dict, source: str) -> tuple:
    """(action_space, action_min, action_max) as `dz package` wrote them into robot.json."""
    space = raw.get("action_space")
    if space not in (None, "joint", "end_effector"):
        raise PackageError(f"{source}: action_space must be joint or end_effector, got {bounded_repr(space)}")
    lo, hi = _optional_numbers(raw, "action_min", source), _optional_numbers(raw, "action_max", source)
    problem = robot_limits_problem(lo, hi, None, None)
    if problem:
        raise PackageError(f"{source}: {problem}")
    return space, lo, hi


# --- building -----------------------------------------------------------------------------------


def _manifest_lines(root: Path) -> list[str]:
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and p.relative_to(root).as_posix() not in (MANIFEST, SIGNATURE))
    return [f"{file_sha256(p)}  {p.stat().st_size}  {p.relative_to(root).as_posix()}" for p in files]


def _robot_lines(robot: "RobotConfig | dict") -> tuple[str, list[str]]:
    """(what the bundle is packaged for, the model card's robot section)."""
    if isinstance(robot, RobotConfig):
        return "a Franka arm", [f"- robot {robot.robot_ip}, cameras {', '.join(robot.camera_serials)}, "
                                f"{robot.control_rate_hz:g} Hz, gripper threshold {robot.gripper_threshold:g}",
                                f"- workspace {list(robot.workspace_min)} .. {list(robot.workspace_max)} m",
                                _franka_limits_line(robot)]
    space = robot["action_space"].replace("_", "-")
    lines = [f"- {robot['name']} ({robot['kind'].replace('_', ' ')}): {robot['action_dim']} {space}-space actions, "
             f"{robot['action_mode']}, at {robot['control_rate_hz']:g} Hz",
             f"- every action is clipped to [{', '.join(f'{v:g}' for v in robot['action_min'])}] .. "
             f"[{', '.join(f'{v:g}' for v in robot['action_max'])}] by `dz serve`, and a chunk with a NaN is refused"]
    if robot.get("joint_names"):
        lines.append(f"- action dims, in order: {', '.join(robot['joint_names'])}")
    if robot.get("max_step_change"):
        lines.append(f"- at most [{', '.join(f'{v:g}' for v in robot['max_step_change'])}] of change from one row "
                     "of a chunk to the next (`dz serve` limits it; a chunk's first row only by the range)")
    return f"a {robot['name']}", lines


def _franka_limits_line(robot: RobotConfig) -> str:
    if robot.action_min is None:
        return ("- end-effector actions: `dz serve` refuses a chunk with a NaN; the workspace above is for the "
                "robot's own controller")
    source = ("the robot config's joint_min/joint_max" if robot.joint_min
              else f"the {franka.ROBOT_NAME}'s published limits")
    return (f"- every action is clipped to [{', '.join(f'{v:g}' for v in robot.action_min)}] .. "
            f"[{', '.join(f'{v:g}' for v in robot.action_max)}] (joint positions in rad, {source}; gripper 0..1) "
            "by `dz serve`, and a chunk with a NaN is refused")


def _model_card(name: str, version: str, train: dict, emb: dict, robot: "RobotConfig | dict",
                eval_rows: list[dict]) -> str:
    target, robot_lines = _robot_lines(robot)
    lines = [f"# {name} {version}", "",
             f"A DreamZero world action model fine-tuned with dzmodel, packaged for {target}.", "",
             "## Model", f"- preset: `{train.get('preset')}`, trained {train.get('step')} steps "
             f"(lr {train.get('lr')}, global batch {train.get('global_batch')})",
             f"- data: {', '.join(train.get('datasets', [])) or 'n/a'}",
             f"- embodiment: `{emb['name']}`, action horizon {emb['action_horizon']}, views {', '.join(emb['views'])}", "",
             "## Evaluation"]
    if eval_rows:
        lines += ["| step | task | episodes | successes | rate |", "|---|---|---|---|---|"]
        lines += [f"| {r.get('step')} | {r.get('task')} | {r.get('episodes')} | {r.get('successes')} | {r.get('rate')} |"
                  for r in eval_rows]
    else:
        lines.append("No evaluation results were packaged.")
    lines += ["", "## Robot", *robot_lines, "",
              "## Intended use and limits",
              "- Research use on the robot and scene family it was trained on; supervise every run and keep the "
              "workspace limits and an emergency stop active.",
              "- Success rates above come from simulation or the listed evaluation and do not transfer as-is.", "",
              "## Serving (docs/deploy.md)", "```", "export DZ_SERVE_TOKEN=...   # the shared secret",
              f"dz serve {name}-{version}.tar.gz --port 8000", "dz client ws://HOST:8000 --dry-run", "```", ""]
    return "\n".join(lines)


def robot_description(emb, robot: RobotConfig | None, action_dim: int) -> "RobotConfig | dict":
    """What robot.json holds: a Franka's site config (a franka `robot:` block, or none on a built-in embodiment or
    with a site config given), or the embodiment's robot description with its action limits and joint names,
    checked against the model's action dims. A user's embodiment without a `robot:` block and no site config is
    refused: what it drives is not known, and it is not asked for a Franka's fields."""
    spec = emb.robot
    source = getattr(emb, "source", "")
    if spec is None and robot is None and source != str(BUILTIN_YAML):
        raise PackageError(f"embodiment {emb.tag!r} ({source}) has no robot: block, so what it drives is not "
                           "known: add one to the embodiment's YAML (kind humanoid, arm or mobile_manipulator with "
                           "its name, action_space, action_mode, control_rate_hz, action_min and action_max; "
                           "`dz embodiment init` drafts it) and give that file to `dz package --embodiments FILE`; "
                           "for a Franka arm, give its site config with --robot instead")
    if spec is None or spec.kind == "franka":
        if robot is None:
            raise PackageError(f"embodiment {emb.tag!r} drives a Franka arm: give its robot config (robot_ip, "
                               "camera_serials, target_ee_pose, workspace_min, workspace_max)")
        return robot.for_embodiment(emb, action_dim)
    if robot is not None:
        raise PackageError(f"embodiment {emb.tag!r} drives a {spec.kind} ({spec.name}): its robot description is "
                           "the embodiment's `robot:` block; a Franka robot config does not apply to it")
    problem = robot_limits_problem(spec.action_min, spec.action_max, spec.max_step_change, action_dim)
    if spec.joint_names is not None and len(spec.joint_names) != action_dim:
        problem = problem or f"joint_names has {len(spec.joint_names)} names"
    if problem:
        raise PackageError(f"embodiment {emb.tag!r}, robot: against the model's {action_dim} action dims, {problem}")
    return {**spec.to_dict(), "embodiment": emb.tag, "action_dim": action_dim}


# what training fixed: a reviewed embodiment (`dz package --embodiments`) may change only its robot: and serve: blocks
TRAINED_FIELDS = ("tag_id", "views", "view_size", "layout", "state", "action", "action_horizon",
                  "relative_action_keys", "layout_sentence", "prompt_template", "crop_scale", "color_jitter",
                  "sampling")


def packaged_embodiment(model_dir: Path, cfg, embodiment_files) -> Any:
    """The embodiment a bundle serves: the converted model's copy, or its definition in the reviewed
    `embodiment_files` (which may add or change only the robot: and serve: blocks)."""
    from ..policy.policy import model_embodiment

    hint = "; give its YAML with `dz package --embodiments FILE`"
    try:
        trained = model_embodiment(model_dir, cfg)
    except DataError as exc:
        if not embodiment_files:
            raise PackageError(f"{model_dir}: {exc}{hint}") from None
        trained = None  # a model converted without its embodiment file: the reviewed one is all there is
    if not embodiment_files:
        return trained
    copies = sorted(str(p) for p in (model_dir / "experiment_cfg" / "embodiments").glob("*.yaml"))
    try:
        emb = get_embodiment(cfg.embodiment, load_embodiments([*copies, *map(str, embodiment_files)]))
    except DataError as exc:
        raise PackageError(str(exc)) from None
    for name in TRAINED_FIELDS if trained is not None else ():
        if getattr(emb, name) != getattr(trained, name):
            raise PackageError(f"{emb.source}: embodiment {emb.tag!r}, field {name!r} is {getattr(emb, name)!r:.200}; "
                               f"the model was trained with {getattr(trained, name)!r:.200}. --embodiments may "
                               "change only the robot: and serve: blocks: set it back (or train again with it)")
    return emb


def _carry_embodiments(folder: Path, files) -> None:
    """Copy the reviewed embodiment files into a bundle's model, named to sort after its own copies: the policy
    loads them in name order (`model_embodiment`), so the reviewed definitions win, as they did when packaging."""
    folder.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name.split("_", 1)[0]) for p in folder.glob("*.yaml") if p.name.split("_", 1)[0].isdigit()]
    start = max(taken, default=-1) + 1
    for i, f in enumerate(files):
        shutil.copyfile(f, folder / f"{start + i:02d}_{Path(f).name}")


def build_package(model_dir: str | Path, out_dir: str | Path, robot: RobotConfig | None, version: str,
                  eval_dir: str | Path | None = None, name: str | None = None,
                  overwrite: bool = False, sign_key: str | Path | None = None,
                  embodiment_files: list[str | Path] | None = None) -> tuple[Path, Path]:
    """Bundle directory and tarball from a converted model directory (`dz convert`); sign_key: an ed25519
    private key file that signs the MANIFEST (MANIFEST.sig); embodiment_files: reviewed embodiment YAML that
    overrides the model's copies (a robot: or serve: block added after training), carried into the bundle."""
    import csv

    from ..policy.policy import policy_statistics, read_train_config
    from ..model.state_dict import read_config
    from ..train.encoders import frozen_encoders, save_encoders

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise PackageError(f"{model_dir}: not a converted model directory (no config.json); run `dz convert` first")
    if not version or any(c in version for c in "/\\ ") or version.startswith("."):
        raise PackageError(f"version must be a plain string like 1.0.0, got {version!r}")
    key = _signing_key(sign_key) if sign_key is not None else None  # a bad key fails before any work
    cfg, step = read_train_config(model_dir)
    emb = packaged_embodiment(model_dir, cfg, embodiment_files or [])
    per_block = getattr(read_config(model_dir), "num_action_per_block", emb.action_horizon)
    if per_block != emb.action_horizon:
        raise PackageError(f"{model_dir}: " + emb.horizon_mismatch(per_block, "the model", trained=True))
    meta = model_dir / "experiment_cfg" / "metadata.json"
    if not meta.is_file():
        raise PackageError(f"{model_dir}: no experiment_cfg/metadata.json (normalisation statistics)")
    robot = robot_description(emb, robot, len(policy_statistics(emb, meta)[1].q01))
    name = name or f"dreamzero-{emb.tag}"
    out = check_output_dir(out_dir)  # a folder, or nothing yet: made by the lock, claimed under it
    final, tarball = out / f"{name}-{version}", out / f"{name}-{version}.tar.gz"
    locked = contextlib.ExitStack()
    locked.enter_context(_release_lock(out))
    tmp = tar_tmp = tar_file = None
    try:
        claim_dir(out, "package", overwrite=overwrite)  # a releases folder of dz's own (or empty, or --overwrite)
        if os.path.lexists(final) or os.path.lexists(tarball):
            raise PackageError(f"{final} already exists: versions are immutable, pick a new --version")
        # built under names no one could have planted a link at, in this folder (so publishing is a rename)
        tmp = new_temp_dir(final)
        tar_fd, tar_tmp = temp_file(tarball)
        tar_file = os.fdopen(tar_fd, "wb")
        _copy_plain_tree(model_dir, tmp / "model", Path(os.path.realpath(model_dir)))
        if embodiment_files:
            _carry_embodiments(tmp / "model" / "experiment_cfg" / "embodiments", embodiment_files)
        if not (tmp / "model" / "encoders").is_dir():
            save_encoders(frozen_encoders(cfg), tmp / "model" / "encoders")
        shutil.copyfile(tmp / "model" / "config.json", tmp / "config.json")  # the copies checked just now
        shutil.copyfile(tmp / "model" / "experiment_cfg" / "metadata.json", tmp / "metadata.json")
        gripper = robot.gripper_threshold if isinstance(robot, RobotConfig) else None
        emb_json = {"name": emb.tag, "action_horizon": emb.action_horizon, "gripper_threshold": gripper,
                    "views": dict(emb.views), "view_size": list(emb.view_size),
                    "layout": [[c.view for c in row] for row in emb.layout],
                    "state": [k.name for k in emb.state], "action": [k.name for k in emb.action]}
        atomic_write_text(tmp / "embodiment.json", json.dumps(emb_json, indent=1))
        atomic_write_text(tmp / "robot.json", json.dumps(robot.to_dict() if isinstance(robot, RobotConfig)
                                                         else robot, indent=1))
        rows = []
        if eval_dir is not None:
            eval_dir = Path(eval_dir)
            found = [f for f in EVAL_FILES if (eval_dir / f).is_file()]
            if not found:
                raise PackageError(f"{eval_dir}: no evaluation results ({', '.join(EVAL_FILES)})")
            (tmp / "eval").mkdir()
            for f in found:
                _copy_plain_file(eval_dir / f, tmp / "eval" / f, Path(os.path.realpath(eval_dir)))
            if (tmp / "eval" / "results.csv").is_file():
                with (tmp / "eval" / "results.csv").open() as f:
                    rows = [r for r in csv.DictReader(f) if r.get("task") == "all"]
        atomic_write_text(tmp / "MODEL_CARD.md", _model_card(name, version, {**cfg.to_dict(), "step": step},
                                                             emb_json, robot, rows))
        atomic_write_text(tmp / MANIFEST, "\n".join(_manifest_lines(tmp)) + "\n")
        if key is not None:
            sign_bundle(tmp, key)
        with tarfile.open(fileobj=tar_file, mode="w:gz") as tar:
            # MANIFEST first, so that loading checks every later member against it as it is extracted
            tar.add(tmp, arcname=f"{name}-{version}", recursive=False)
            tar.add(tmp / MANIFEST, arcname=f"{name}-{version}/{MANIFEST}")
            if (tmp / SIGNATURE).is_file():  # right after MANIFEST: a trusting loader checks it before the rest
                tar.add(tmp / SIGNATURE, arcname=f"{name}-{version}/{SIGNATURE}")
            for child in sorted(tmp.iterdir()):
                if child.name not in (MANIFEST, SIGNATURE):
                    tar.add(child, arcname=f"{name}-{version}/{child.name}")
        _synced(tar_file)
        _publish(tmp, tar_tmp, final, tarball)
    except BaseException:
        if tar_file is not None:
            tar_file.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if tar_tmp is not None:
            tar_tmp.unlink(missing_ok=True)
        raise
    finally:
        locked.close()
    return final, tarball


def _copy_plain_tree(src: Path, dest: Path, base: Path) -> None:
    """Copy the folder `src` (inside `base`, the real path of the folder being packaged) to the new folder
    `dest`: its folders and regular files, each link copied as the file it leads to (`_copy_plain_file`); the
    output folder's owner marker is left out."""
    dest.mkdir()
    with os.scandir(src) as entries:
        names = sorted((entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries)
    for name, is_dir in names:
        if name == OWNER_MARKER:
            continue
        if is_dir:
            _copy_plain_tree(src / name, dest / name, base)
        else:
            _copy_plain_file(src / name, dest / name, base)


def _copy_plain_file(src: Path, dest: Path, base: Path) -> None:
    """Copy the regular file `src` to the new file `dest`. A link is copied as the file it leads to only when
    that is a regular file inside `base`: a bundle carries the packaged folder's own files, never one from
    elsewhere on the machine (a private key, /dev/zero). A FIFO, socket or device is refused, never read or
    waited on."""
    follow = src.is_symlink()
    if follow:
        target = os.path.realpath(src)
        if not Path(target).is_relative_to(base):
            raise PackageError(f"{shown(src)}: a link to {shown(target)}, outside {shown(base)}: a bundle carries only "
                               "the files of the folder it packages; put the file itself there (or copy the folder "
                               "with `cp -rL`); refused")
        if not os.path.lexists(target):
            raise PackageError(f"{shown(src)}: a link to {shown(target)}, which does not exist; refused")
    try:
        with open_regular(src, follow=follow) as f, open(dest, "xb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
    except BundleError as exc:  # a FIFO, socket, device or folder
        raise PackageError(str(exc)) from None


@contextlib.contextmanager
def _release_lock(out: Path):
    """One `dz package` at a time writes into a releases folder: an flock on the folder itself, so there is no
    lock file to plant a link at or to leave behind. Another run waits for it, then finds its version there
    (and says so in one line) or builds its own."""
    with directory_lock(out, waiting=lambda: log.info(f"waiting for another dz package writing into {out}")):
        yield


def _synced(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def _publish(tmp: Path, tar_tmp: Path, final: Path, tarball: Path) -> None:
    """Put a finished bundle and its tarball in place, never over anything: the tarball is hard-linked to its
    name (which fails if that name exists), then the folder renamed to its own. A version is thus complete or
    absent, and an existing one, or a file someone put at its name, is never replaced."""
    taken = PackageError(f"{final} already exists: versions are immutable, pick a new --version")
    try:
        os.link(tar_tmp, tarball)
    except FileExistsError:
        raise taken from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        if os.path.lexists(tarball):  # a filesystem without hard links: the lock keeps the name free meanwhile
            raise taken from None
        os.rename(tar_tmp, tarball)
    try:
        if os.path.lexists(final):
            raise taken
        os.rename(tmp, final)
    except BaseException:
        tarball.unlink()  # linked above by this run: the version stays absent
        raise
    tar_tmp.unlink(missing_ok=True)


# --- signing ------------------------------------------------------------------------------------


def _signing_key(path: str | Path):
    try:
        return load_signing_key(path)
    except BundleError as exc:
        raise PackageError(str(exc)) from None


def sign_bundle(root: str | Path, key) -> Path:
    """Write root/MANIFEST.sig: the signature of root/MANIFEST by `key` (a private key file, or a loaded key)."""
    root = Path(root)
    if isinstance(key, (str, Path)):
        key = _signing_key(key)
    if not (root / MANIFEST).is_file():
        raise PackageError(f"{root}: no {MANIFEST} to sign")
    sig = root / SIGNATURE
    atomic_write_bytes(sig, sign_manifest((root / MANIFEST).read_bytes(), key))
    return sig


# --- loading ------------------------------------------------------------------------------------


@dataclass
class Package:
    root: Path
    robot: RobotConfig | dict   # a Franka's site config, or another robot's description (`robot_description`)
    embodiment: dict
    files: int

    @property
    def model_dir(self) -> Path:
        return self.root / "model"


def _authentic_manifest(root: Path, trust: str | Path | None = None,
                        *pins: str) -> tuple[bytes, dict[str, tuple[str, int]]]:
    """root's MANIFEST, read once (its bytes and its entries): checked against each expected sha256 in `pins`
    and the trusted key's signature."""
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise PackageError(f"{root}: no {MANIFEST} (not a dz package)")
    with _open_listed(manifest) as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise PackageError(f"{manifest}: over the limit of {MAX_MANIFEST_BYTES} bytes for a {MANIFEST}; refused")
    digest = hashlib.sha256(data).hexdigest()
    for pin in pins:
        if digest != pin:
            raise PackageError(f"{manifest}: sha256 {digest} does not match the expected {pin} "
                               "(the bundle was changed)")
    try:
        if trust:
            check_signature(root, data, trust)
        return data, parse_manifest(data.decode("utf-8", errors="replace"), str(manifest))
    except BundleError as exc:
        raise PackageError(str(exc)) from None


def _open_listed(path: Path):
    """A bundle file opened for reading: a regular file, never a link, and never waited on (a FIFO or device
    put at its name is refused)."""
    try:
        return open_regular(path, follow=False)
    except BundleError as exc:
        raise PackageError(str(exc)) from None


def _read_listed(path: Path, limit: int) -> bytes:
    with _open_listed(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise PackageError(f"{shown(path)}: over the limit of {limit} bytes; refused")
    return data


def _check_size(f, path: Path, size: int) -> None:
    """Refuse an open bundle file whose size is not its MANIFEST size, before any of it is read."""
    actual = os.fstat(f.fileno()).st_size
    if actual != size:
        raise PackageError(f"{shown(path)}: {actual} bytes, {MANIFEST} says {size} (the file was modified)")


def _present_files(root: Path, limit: int = ExtractLimits.max_members) -> set[str]:
    """The files under root, relative to it; a symbolic link or anything but a folder or regular file there is
    refused (a bundle holds plain files: a link could point anywhere, a FIFO would block its reader), and so is
    a folder of more than `limit` entries, as soon as they are counted (a bundle's MANIFEST lists at most that
    many files)."""
    present, folders, seen = set(), [root], 0
    while folders:
        folder = folders.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                seen += 1
                if seen > limit + MAX_FOLDERS:
                    raise PackageError(f"{shown(root)}: more than {limit + MAX_FOLDERS} files and folders; a bundle "
                                       f"holds at most {limit} files; refused")
                path = Path(entry.path)  # the entry's kind comes with its name: no stat call per file
                if entry.is_symlink():
                    raise PackageError(f"{shown(path)}: a symbolic link inside the bundle folder; a bundle holds "
                                       "plain files only (copy it with `cp -rL` to resolve its links); refused")
                if entry.is_file(follow_symlinks=False):
                    present.add(path.relative_to(root).as_posix())
                elif entry.is_dir(follow_symlinks=False):
                    folders.append(path)
                else:
                    raise PackageError(f"{shown(path)}: not a regular file inside the bundle folder; refused")
    return present - {MANIFEST, SIGNATURE}


def _listed_files(root: Path, trust: str | Path | None, pins: tuple[str, ...]) -> tuple[bytes, dict]:
    """root's authentic MANIFEST (bytes, entries), refusing a listed file that is missing or a file not listed."""
    data, expected = _authentic_manifest(root, trust, *pins)
    if not expected:
        raise PackageError(f"{root / MANIFEST}: lists no files (not a dz package)")
    try:
        present = _present_files(root)
    except OSError as exc:
        raise PackageError(f"{root}: could not list its files ({exc.strerror or exc}: {exc.filename})") from None
    for rel in sorted(set(expected) - present):
        raise PackageError(f"{shown(root / rel)}: listed in {MANIFEST} but missing")
    for rel in sorted(present - set(expected)):
        raise PackageError(f"{shown(root / rel)}: not listed in {MANIFEST} (an added file)")
    return data, expected


def verify_package(root: str | Path, trust: str | Path | None = None, manifest_sha256: str | None = None) -> int:
    """Check every file against MANIFEST; returns the number of files. Raises PackageError naming the file.

    trust: an ed25519 public key file; MANIFEST.sig must then be its valid signature of MANIFEST.
    manifest_sha256: the sha256 MANIFEST must have (a registry's record, or the tarball's own MANIFEST).
    The files stay where they are: to use what was checked, whatever happens to root later, `verified_copy`."""
    root = Path(root)
    _, expected = _listed_files(root, trust, (manifest_sha256,) if manifest_sha256 else ())
    for rel, (digest, size) in sorted(expected.items()):
        path = root / rel
        h = hashlib.sha256()
        with _open_listed(path) as f:
            _check_size(f, path, size)
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != digest:
            raise PackageError(f"{shown(path)}: checksum mismatch against {MANIFEST} (the file was modified)")
    return len(expected)


def _copy_checked(src: Path, dest: Path, digest: str, size: int) -> None:
    """Read `src` once, hashing each block as it is written to `dest` (a new file); refuse a copy that does not
    match its MANIFEST entry. What `dest` holds is then exactly what was checked."""
    h, n = hashlib.sha256(), 0
    with _open_listed(src) as f:
        _check_size(f, src, size)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "xb") as out:
            while n <= size and (block := f.read(min(1 << 20, size + 1 - n))):  # one byte past `size` is enough
                h.update(block)
                out.write(block)
                n += len(block)
    if n != size or h.hexdigest() != digest:
        dest.unlink()
        raise PackageError(f"{shown(src)}: checksum mismatch against {MANIFEST} (the file was modified)")


def _check_room(root: Path, dest: Path, expected: dict[str, tuple[str, int]], limits: ExtractLimits) -> None:
    """Refuse a copy over the caps of an extraction, or one that would leave dest's disk with less than
    limits.keep_free_bytes free, before anything is written."""
    total = sum(size for _, size in expected.values())
    largest = max((size for _, size in expected.values()), default=0)
    if len(expected) > limits.max_members:
        raise PackageError(f"{root}: {MANIFEST} lists {len(expected)} files, over the limit of {limits.max_members}")
    if total > limits.max_total_bytes or largest > limits.max_member_bytes:
        raise PackageError(f"{root}: {MANIFEST} lists {total} bytes (the largest file {largest}), over the copy cap "
                           f"({limits.max_total_bytes} bytes in all, {limits.max_member_bytes} per file); refused")
    free = shutil.disk_usage(dest.parent).free
    if total + limits.keep_free_bytes > free:
        raise PackageError(f"{root}: its {total} bytes do not fit in {dest.parent} ({free} bytes free, "
                           f"{limits.keep_free_bytes} kept free); free that space or set TMPDIR to a folder with "
                           "room for the bundle")


def verified_copy(root: str | Path, dest: str | Path, trust: str | Path | None = None, *pins: str,
                  limits: ExtractLimits = ExtractLimits()) -> int:
    """Verify root against its MANIFEST by copying it: each listed file is read once and hashed as it is written
    under `dest` (a new folder in a private one, such as a fresh mkdtemp), and MANIFEST is written there as the
    bytes that were checked. Whatever loads from `dest` then gets exactly what was verified: a file renamed over
    or rewritten in root after its check is never read. Returns the number of files.

    trust: an ed25519 public key file (MANIFEST.sig must be its valid signature of MANIFEST); pins: the sha256s
    MANIFEST must have (a registry's record, the tarball's own MANIFEST). limits: the caps of a tarball's
    extraction, checked against MANIFEST's sizes (and the free space under dest) before anything is copied;
    each file's size is checked before it is read."""
    root, dest = Path(root), Path(dest)
    data, expected = _listed_files(root, trust, pins)
    try:
        _check_room(root, dest, expected, limits)
        dest.mkdir()
        for rel, (digest, size) in sorted(expected.items()):
            _copy_checked(root / rel, dest / rel, digest, size)
        (dest / MANIFEST).write_bytes(data)
    except OSError as exc:  # a full disk, an unreadable file: one line naming both places
        where = f" ({exc.filename})" if exc.filename else ""
        raise PackageError(f"{root}: could not copy it to {dest.parent} to verify it: {exc.strerror or exc}{where}; "
                           "free that space or set TMPDIR to a folder with room for the bundle") from None
    return len(expected)


def load_package(path: str | Path, cache_dir: str | Path | None = None, trust: str | Path | None = None,
                 manifest_sha256: str | None = None, copy_to: str | Path | None = None) -> Package:
    """A bundle directory, or its .tar.gz extracted into the bundle cache (`bundles.cached_bundle`); verified
    against MANIFEST either way. A cached copy is checked against the tarball's own MANIFEST on every load;
    one that no longer matches is logged, dropped and extracted again.

    trust: an ed25519 public key file (default: the DZ_TRUST_KEY variable); the bundle must then carry a valid
    MANIFEST.sig by that key. manifest_sha256: the sha256 its MANIFEST must have.
    copy_to: a private folder (the caller's fresh mkdtemp, which it removes once the model is loaded): the
    bundle is verified by copying it there (`verified_copy`) and the Package is that copy, so what is loaded
    from it is exactly what was verified, even if the bundle or the cache is changed meanwhile."""
    path = Path(path)
    trust = trust or os.environ.get(TRUST_ENV) or None
    pins = (manifest_sha256,) if manifest_sha256 else ()
    if path.name.endswith(".tar.gz"):
        tarball = path
        try:
            path, files = _cached_package(path, cache_dir, trust)
        except BundleError as exc:
            raise PackageError(str(exc)) from None
        if copy_to is not None:  # the cached files are read again: they must still be the tarball's
            pins += (_tarball_manifest_sha256(tarball),)
        elif pins or trust:
            _authentic_manifest(path, trust, *pins)
    elif path.is_dir():
        if copy_to is None:
            files = verify_package(path, trust, manifest_sha256)
    else:
        raise PackageError(f"{path}: no such bundle directory or .tar.gz")
    if copy_to is not None:
        files = verified_copy(path, Path(copy_to) / path.name, trust, *pins)
        path = Path(copy_to) / path.name
    raw = _bundle_json(path / "robot.json")
    franka = not isinstance(raw, dict) or raw.get("kind", "franka") == "franka"  # a non-dict: RobotConfig says so
    robot = RobotConfig.from_dict(raw, str(path / "robot.json")) if franka else _checked_robot(raw, path / "robot.json")
    return Package(path, robot, _bundle_json(path / "embodiment.json"), files)


def _bundle_json(path: Path) -> Any:
    if not path.is_file():
        raise PackageError(f"{path}: missing (not a dz package)")
    data = _read_listed(path, MAX_JSON_BYTES)
    try:
        return json.loads(data)
    except ValueError as exc:  # not UTF-8, or not JSON
        raise PackageError(f"{path}: not valid JSON ({exc})") from None


def _tarball_manifest_sha256(tarball: Path) -> str:
    try:
        return hashlib.sha256(tarball_manifest(tarball)).hexdigest()
    except BundleError as exc:
        raise PackageError(str(exc)) from None


def _checked_robot(raw: dict, source: Path) -> dict:
    """A non-Franka robot.json: the action limits `dz serve` enforces must be there and usable (finite numbers,
    min < max, positive steps, one per action dim)."""
    n = raw.get("action_dim")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PackageError(f"{source}: action_dim must be a positive integer, got {bounded_repr(n)}")
    lo, hi = finite_numbers(raw.get("action_min")), finite_numbers(raw.get("action_max"))
    step = None if raw.get("max_step_change") is None else finite_numbers(raw["max_step_change"])
    if lo is None or hi is None or (raw.get("max_step_change") is not None and step is None):
        raise PackageError(f"{source}: a {raw.get('kind')} robot needs action_min and action_max (and "
                           "max_step_change, if any) as lists of finite numbers")
    problem = robot_limits_problem(lo, hi, step, n)
    names = raw.get("joint_names")
    if names is not None and not (isinstance(names, list) and len(names) == n and all(isinstance(x, str) for x in names)):
        problem = problem or f"joint_names must be {n} names, one per action dim"
    if problem:
        raise PackageError(f"{source}: {problem}")
    return raw


def _cached_package(tarball: Path, cache_dir: str | Path | None,
                    trust: str | Path | None = None) -> tuple[Path, int]:
    """The tarball's bundle directory in the cache and its number of files. Whoever can write the cache can
    rewrite a cached file and its MANIFEST together, so a cached copy must match the tarball's own MANIFEST.
    trust: a fresh extraction checks MANIFEST.sig by this key before it writes any other file."""
    root, fresh = cached_bundle(tarball, cache_dir, trusted_key=trust)
    if not fresh:
        expected = hashlib.sha256(tarball_manifest(tarball)).hexdigest()
        seen = os.stat(root.parent)
        try:
            return root, verify_package(root, manifest_sha256=expected)
        except PackageError as exc:
            log.warning(f"refused the cached copy of {tarball}: {exc}; extracting the tarball again")
            evict(root.parent, seen)
        root, _ = cached_bundle(tarball, cache_dir, trusted_key=trust)
    text = _read_listed(root / MANIFEST, MAX_MANIFEST_BYTES).decode("utf-8", errors="replace")
    return root, len(parse_manifest(text, str(root / MANIFEST)))
