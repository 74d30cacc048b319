"""The limits `dz serve` enforces on every action chunk before it leaves the server, from the bundle's robot.json:

- a chunk with a NaN or an infinity is refused: nothing is sent (`UnsafeActions`);
- every action is clipped to the robot's [action_min, action_max] per dim;
- with `max_step_change`, no dim moves more than that from one row of a chunk to the next. A chunk's first row
  is limited by the range alone: clients execute only part of a chunk before they ask again (openpi's LIBERO
  example 5 rows, RoboArena 8), so the server does not know which row the robot last reached. With delta actions
  the limit bounds the change between consecutive deltas.

Each clip or rate limit is one log line with the session, how many values and which dims. A Franka bundle's
robot.json describes its site (IP, cameras, workspace) and, for joint-position actions (DROID's), the Franka Panda's
published joint limits and the gripper's range as action_min/action_max (`franka.py`), clipped to as a humanoid's;
a Franka of end-effector actions has no action-space limits: only the NaN refusal applies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("dzmodel.serve")


class UnsafeActions(RuntimeError):
    """The policy produced a chunk that must not reach a robot."""


def _dims(mask: np.ndarray) -> str:
    dims = np.flatnonzero(mask.any(axis=0))
    return ", ".join(str(d) for d in dims[:8]) + (" ..." if len(dims) > 8 else "")


@dataclass
class ActionSafety:
    action_min: np.ndarray | None = None
    action_max: np.ndarray | None = None
    max_step_change: np.ndarray | None = None

    def check(self, action_dim: int) -> None:
        """The limits must cover exactly the model's action dims (checked when serving starts)."""
        for name in ("action_min", "action_max", "max_step_change"):
            value = getattr(self, name)
            if value is not None and len(value) != action_dim:
                raise UnsafeActions(f"the bundle's robot.json {name} has {len(value)} numbers, the model predicts "
                                    f"{action_dim} action dims")

    @classmethod
    def from_robot(cls, robot) -> "ActionSafety":
        """From a package's robot (`package.Package.robot`): a dict with limits, or a Franka's site config (with
        the limits `dz package` wrote for joint-position actions, or none)."""
        if not isinstance(robot, dict):
            robot = {"action_min": getattr(robot, "action_min", None), "action_max": getattr(robot, "action_max", None)}
        arr = lambda key: None if robot.get(key) is None else np.asarray(robot[key], np.float32)  # noqa: E731
        return cls(arr("action_min"), arr("action_max"), arr("max_step_change"))

    def describe(self) -> str:
        parts = ["non-finite chunks refused"]
        if self.action_min is not None:
            parts.append(f"actions clipped to the robot's range ({len(self.action_min)} dims)")
        if self.max_step_change is not None:
            parts.append("change per step limited")
        return ", ".join(parts)

    def apply(self, actions: np.ndarray, session: str) -> np.ndarray:
        """The chunk [T, D] as it may be sent."""
        actions = np.asarray(actions, np.float32)
        bad = ~np.isfinite(actions)
        if bad.any():
            rows = sorted(set(np.flatnonzero(bad.any(axis=1)).tolist()))
            log.warning(f"session {session}: refused a chunk with non-finite actions (rows {rows[:8]}, dims "
                        f"{_dims(bad)}): nothing sent")
            raise UnsafeActions(f"the policy's chunk holds non-finite actions (rows {rows[:8]}); nothing was sent")
        out = actions.copy()
        if self.action_min is not None:
            if out.shape[-1] != len(self.action_min):
                raise UnsafeActions(f"the chunk has {out.shape[-1]} action dims, the robot's limits "
                                    f"{len(self.action_min)}")
            outside = (out < self.action_min) | (out > self.action_max)
            if outside.any():
                out = np.clip(out, self.action_min, self.action_max)
                log.warning(f"session {session}: clipped {int(outside.sum())} of {out.size} action values to the "
                            f"robot's range (dims {_dims(outside)})")
        if self.max_step_change is not None:
            limited = np.zeros_like(out, dtype=bool)
            for t in range(1, len(out)):
                step = out[t] - out[t - 1]
                over = np.abs(step) > self.max_step_change
                if over.any():
                    out[t] = out[t - 1] + np.clip(step, -self.max_step_change, self.max_step_change)
                    limited[t] = over
            if limited.any():
                log.warning(f"session {session}: limited {int(limited.sum())} action values to the robot's "
                            f"max_step_change (dims {_dims(limited)})")
            if self.action_min is not None:  # the limited rows stay inside the range (rounding aside)
                out = np.clip(out, self.action_min, self.action_max)
        return out
