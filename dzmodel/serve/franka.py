"""A Franka Panda's published limits, which a Franka bundle of joint-position actions carries and `dz serve`
enforces on every chunk (as it enforces a humanoid's `robot:` limits).

- Joint positions: Franka's datasheet limits, q_min..q_max in rad per joint. A lab may tighten them in its robot
  config (`joint_min`, `joint_max`), never loosen them.
- Gripper: DROID's `gripper_position`, 0 (open) .. 1 (closed).

Which bundles: an embodiment whose actions are DROID's absolute `joint_position` (7) and `gripper_position` (1)
keys (oxe_droid and its variants; the served chunk is absolute even where training made the joints relative),
or one whose franka `robot:` block says `action_space: joint`, `action_mode: absolute`. A Franka of end-effector
actions (LIBERO's relative end-effector poses) has no joint limits to clip to: its bundle carries its workspace
(`workspace_min`, `workspace_max`) for the robot's own controller.
"""

from __future__ import annotations

ROBOT_NAME = "Franka Panda"
JOINT_MIN = (-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973)   # rad, Franka's datasheet
JOINT_MAX = (2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973)
GRIPPER_MIN, GRIPPER_MAX = 0.0, 1.0          # DROID's gripper_position: 0 open .. 1 closed
JOINT_KEY, GRIPPER_KEY = "joint_position", "gripper_position"   # DROID's action keys
JOINTS = len(JOINT_MIN)


class FrankaLimitsError(ValueError):
    """Joint limits that loosen the published ones, or an action layout the limits cannot be laid onto."""


def tightened_problem(joint_min, joint_max) -> str | None:
    """Why a lab's joint_min/joint_max are unusable (None if fine): 7 each, min < max, inside the published limits."""
    for name, values in (("joint_min", joint_min), ("joint_max", joint_max)):
        if len(values) != JOINTS:
            return f"{name} must be {JOINTS} numbers (rad, joints 1..7), got {len(values)}"
    for i, (lo, hi) in enumerate(zip(joint_min, joint_max)):
        if lo < JOINT_MIN[i]:
            return (f"joint_min[{i}] = {lo:g} is below the {ROBOT_NAME}'s published limit {JOINT_MIN[i]:g} rad; "
                    "joint_min and joint_max may tighten the published limits, not loosen them")
        if hi > JOINT_MAX[i]:
            return (f"joint_max[{i}] = {hi:g} is above the {ROBOT_NAME}'s published limit {JOINT_MAX[i]:g} rad; "
                    "joint_min and joint_max may tighten the published limits, not loosen them")
        if not lo < hi:
            return f"joint_min[{i}] = {lo:g} must be below joint_max[{i}] = {hi:g}"
    return None


def action_space(emb) -> str:
    """'joint' when the embodiment's actions are a Franka's absolute joint positions (its franka `robot:` block
    says so, or it has no block and DROID's action keys), else 'end_effector'."""
    spec = emb.robot
    if spec is not None:
        joint = spec.action_space == "joint" and spec.action_mode == "absolute"
    else:
        joint = [(k.name, k.dim) for k in emb.action] in ([(JOINT_KEY, JOINTS), (GRIPPER_KEY, 1)],
                                                          [(JOINT_KEY, JOINTS)])
    return "joint" if joint else "end_effector"


def action_limits(emb, action_dim: int, joint_min=None, joint_max=None) -> tuple[list[float], list[float]]:
    """[action_min, action_max] per action dim of a joint-position Franka embodiment: the published joint limits
    (or the lab's tighter joint_min/joint_max) on the joint_position key, [0, 1] on the gripper_position key."""
    joint_min = JOINT_MIN if joint_min is None else tuple(joint_min)
    joint_max = JOINT_MAX if joint_max is None else tuple(joint_max)
    lo: list[float] = []
    hi: list[float] = []
    for key in emb.action:
        if key.name == JOINT_KEY and key.dim == JOINTS:
            lo, hi = lo + list(joint_min), hi + list(joint_max)
        elif key.name == GRIPPER_KEY and key.dim == 1:
            lo, hi = lo + [GRIPPER_MIN], hi + [GRIPPER_MAX]
        else:
            raise FrankaLimitsError(
                f"embodiment {emb.tag!r}: action key {key.name!r} ({key.dim or '?'} dims) is not one the "
                f"{ROBOT_NAME}'s limits apply to; a Franka's joint-position actions are {JOINT_KEY!r} ({JOINTS} "
                f"dims) and optionally {GRIPPER_KEY!r} (1), as DROID's")
    if len(lo) != action_dim:
        raise FrankaLimitsError(f"embodiment {emb.tag!r}: its action keys give {len(lo)} dims, the model predicts "
                                f"{action_dim}")
    return lo, hi
