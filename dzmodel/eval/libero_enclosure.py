"""Scripted skills for a fixture that encloses its region from above and has a hinged door (LIBERO-10's microwave):
putting a mug inside by its handle, and closing the door. `libero_scripted.ScriptedExpert` runs them like the other
skills (`libero_skills`), and they keep the same properties: privileged simulator state in, LIBERO's standard 7-dim
OSC_POSE action out, the gripper at exactly -1 or +1, the same saturating position law.

* Into an enclosure (`EnclosurePlace`). The microwave's inside is 14 cm high and the mug 10 cm, so a hand pointing
  down cannot follow the mug in (the hand's body reaches 2.4-12.6 cm above its grip site and would meet the
  ceiling), and the mug's handle must end up inside too, or the door would hit it. The hand takes the mug from above
  by its handle (which must face the open side; the fingers close across it, and a pinch there holds the mug within
  about 2 degrees of upright), carries it in front of the opening with its bottom 1.5 cm above the enclosure's floor,
  moves it in as far as the hand can go without entering (the mug is then In, its handle still outside), sets it
  down and lets go. Then the closed fingers, tilted 45 degrees from pointing down towards the inside (so that the
  hand stays under the ceiling's front edge), push the handle low on its outer face until the whole mug is 1.2 cm
  behind the opening. Across the opening, the set-down point is the one whose hand keeps the most room from
  everything beside it (the open door, a control panel), searched along the opening.
* Closing a hinged door (`DoorSkill`). The door's panel turns about a vertical hinge; closing moves it away from
  one face (the "outer" face, where its handle is). The hand, pointing down, goes over the door if it is on the
  inner side, comes down beside the outer face with its fingertips on the panel's top edge (the hand's body above
  it: a hand lower down would have to stand further out, where the arm, folded close to its base, cannot reach),
  and pushes along the arc, its target a little ahead of the door, until LIBERO's Close holds. A push that stalls
  backs off and starts again.

Module-level imports are numpy and this package's expert modules only (see `libero_expert`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .libero_expert import (RELEASE_STEPS, ExpertUnsupported, _bodies_under, _distance_to_boxes,
                            _geom_oriented_boxes, _geom_world_boxes, colliding_geoms, cup_geometry, fingers_shut,
                            fixture_of, foreign_oriented_boxes, geom_box, hand_points)
from .libero_skills import TURN_GAIN, TURN_TOLERANCE, _move, _rot_error, _rotation_towards, _Skill

HANDLE_FACING_DEG = 30.0  # the mug's handle must point out of the opening within this angle
CARRY_ABOVE_FLOOR = 0.015  # m: the mug's bottom above the enclosure's floor while it moves in
BEHIND_OPENING = 0.012   # m: the whole mug (its handle too) this far inside the opening's plane at the end
PUSH_TILT = np.deg2rad(45.0)  # pushing: the closed fingers' tilt from pointing down towards the inside
DOOR_PUSH_RADIUS = 0.15   # m from the hinge where the door is pushed (clear of its handle near the free end)
DOOR_AHEAD = 0.3          # rad: the push's target, this far ahead of the door along its arc
DOOR_STALL_STEPS = 20     # steps of pushing after which a door that turned less than DOOR_STALL_TURN has stalled
DOOR_STALL_TURN = 0.01    # rad


def _rot_about(axis, angle: float) -> np.ndarray:
    """The rotation matrix by `angle` (rad) about `axis`."""
    axis = np.asarray(axis, dtype=np.float64) / np.linalg.norm(axis)
    k = np.array([[0.0, -axis[2], axis[1]], [axis[2], 0.0, -axis[0]], [-axis[1], axis[0], 0.0]])
    return np.eye(3) + np.sin(angle) * k + (1.0 - np.cos(angle)) * k @ k


@dataclass(frozen=True)
class Enclosure:
    """A region's enclosure, in world coordinates: `inward` (unit xy) is the way in through its one open side;
    `front` and `back` are the opening's plane and the back wall's inner face along inward; `side_lo` and
    `side_hi` its inner side walls along `across`; `floor` and `ceiling` the inner bottom and top heights."""

    inward: np.ndarray
    across: np.ndarray
    front: float
    back: float
    side_lo: float
    side_hi: float
    floor: float
    ceiling: float
    centre: np.ndarray


def enclosure(env, region: str) -> Enclosure | None:
    """The enclosure of a fixture's region site when the site is on the fixture's fixed part and the fixed parts
    (not a door) close it from above and below and on all horizontal sides but one, else None (a table region, a
    basket, a drawer's region, which moves with the drawer)."""
    sim = env.env.sim
    m = sim.model._model
    fx = fixture_of(env, region)
    if fx is None or region not in env.env.object_sites_dict:
        return None
    moving = {int(m.jnt_bodyid[j]) for j in range(m.njnt)}
    if int(m.site_bodyid[sim.model.site_name2id(region)]) in moving:
        return None  # a drawer's region moves with the drawer (the drawer skills handle it)
    fixed = {b for b in _bodies_under(m, sim.model.body_name2id(fx.root_body)) if b not in moving}
    boxes = [(lo, hi) for _, lo, hi in _geom_world_boxes(sim, fixed)]
    c = sim.data.get_site_xpos(region).copy()

    def hits(p) -> bool:
        return any(np.all(p >= lo) and np.all(p <= hi) for lo, hi in boxes)

    over = [(lo, hi) for lo, hi in boxes if np.all(c[:2] >= lo[:2]) and np.all(c[:2] <= hi[:2])]
    above = [lo[2] for lo, hi in over if lo[2] > c[2]]
    below = [hi[2] for lo, hi in over if hi[2] < c[2]]
    if not above or not below:
        return None
    ray = np.linspace(0.0, 0.4, 401)
    directions = [np.array(d, dtype=np.float64) for d in ((1, 0, 0), (-1, 0, 0), (0, 1, 0), (0, -1, 0))]
    open_sides = [d for d in directions if not any(hits(c + s * d) for s in ray)]
    if len(open_sides) != 1:
        return None
    inward = -open_sides[0][:2]
    across = np.array([-inward[1], inward[0]])

    def wall(d) -> float:  # the first fixed geom hit from the centre along d
        return float(next(s for s in ray if hits(c + s * np.r_[d, 0.0])))

    front = min(min(float(np.dot([x, y], inward)) for x in (lo[0], hi[0]) for y in (lo[1], hi[1])) for lo, hi in over)
    along, side = float(np.dot(c[:2], inward)), float(np.dot(c[:2], across))
    return Enclosure(inward=inward, across=across, front=front, back=along + wall(inward),
                     side_lo=side - wall(-across), side_hi=side + wall(across), floor=max(below), ceiling=min(above),
                     centre=c)


class EnclosurePlace(_Skill):
    """Put a mug into an enclosure closed from above (`enclosure`) by its handle (module docstring)."""

    def __init__(self, env, obj: str, region: str, ref_rot, recover=False, hold_orientation=False):
        super().__init__(env, ref_rot, recover, hold_orientation)
        inner, sim, m = env.env, self.sim, self.sim.model._model
        box = enclosure(env, region)
        if box is None:
            raise ExpertUnsupported(f"{region!r}: not an enclosure with one open side")
        if obj not in inner.objects_dict:
            raise ExpertUnsupported(f"{obj!r} is not a movable object")
        self.box = box
        self.obj_id = sim.model.body_name2id(inner.objects_dict[obj].root_body)
        axis, self.radius, handle = cup_geometry(sim, inner.objects_dict[obj].root_body)
        out = -box.inward
        if handle is None or float(np.dot(handle, out)) < np.cos(np.deg2rad(HANDLE_FACING_DEG)):
            raise ExpertUnsupported(f"{obj!r}: no handle facing {region!r}'s open side (the expert takes it by "
                                    "its handle)")
        boxes = [geom_box(sim, g) for g in colliding_geoms(m, self._own())]

        def reach(lo, hi) -> float:  # how far a geom's box reaches out of the opening from the axis
            return max(float(np.dot(np.array([x, y]) - axis, out)) for x in (lo[0], hi[0]) for y in (lo[1], hi[1]))

        handle_boxes = [(lo, hi) for lo, hi in boxes if reach(lo, hi) > self.radius + 0.01]
        self.handle_reach = max(reach(lo, hi) for lo, hi in handle_boxes)
        top = max(hi[2] for _, hi in handle_boxes)
        origin = sim.data.body_xpos[self.obj_id]
        # the grip: 5 mm inside the handle's outer end, 8 mm below its top (relative to the object's origin)
        self.grip_rel = np.r_[axis + out * (self.handle_reach - 0.005) - origin[:2], top - 0.008 - origin[2]]
        self.axis_rel = axis - origin[:2]
        self.grip_above_bottom = top - 0.008 - min(lo[2] for lo, _ in boxes)
        self.hand = hand_points(env, self.ref_rot)
        self.grasp_rot = self._grasp_yaw(boxes)
        # pushing: the grasp's hand, tilted from pointing down towards the inside
        self.push_rot = _rot_about(np.cross([0.0, 0.0, -1.0], np.r_[box.inward, 0.0]), PUSH_TILT) @ self.grasp_rot
        self.set_axis = self.goal_axis = None
        self.waypoints = []
        self.last_finger = 0.0
        self.release_at = None

    # -- geometry --

    def _own(self) -> set[int]:
        return _bodies_under(self.sim.model._model, self.obj_id)

    def _grasp_yaw(self, own_boxes) -> np.ndarray:
        """The world rotation from the hand's reset orientation to the grasp's: turned about the vertical so that
        the fingers close across the handle (along `across`); of the two such turns, the one whose hand body keeps
        more room from the mug's own body."""
        own = _geom_oriented_boxes(self.sim, self._own())
        body = self.hand[self.hand[:, 2] > 0.02]  # the hand above the fingers
        grip = self._grip_point()
        best, best_room = None, -np.inf
        base = float(np.arctan2(self.box.across[1], self.box.across[0])) - np.pi / 2  # fingers along across
        for yaw in (base, base + np.pi):
            rot = _rot_about([0.0, 0.0, 1.0], yaw)
            room = float(_distance_to_boxes(grip + body @ rot.T, own).min())
            if room > best_room:
                best, best_room = rot, room
        return best

    def _bottom(self) -> float:
        m = self.sim.model._model
        return min(geom_box(self.sim, g)[0][2] for g in colliding_geoms(m, self._own()))

    def _grip_point(self) -> np.ndarray:
        return self.sim.data.body_xpos[self.obj_id] + self.grip_rel

    def _axis(self) -> np.ndarray:
        return self.sim.data.body_xpos[self.obj_id][:2] + self.axis_rel

    def _depth(self, xy) -> float:
        return float(np.dot(xy, self.box.inward))

    def _plan(self) -> None:
        """The carry's waypoints for the mug's axis (`waypoints`, ending in front of the opening), where the hand
        sets the mug down (`set_axis`: as deep as the hand's body can go without entering) and where the push
        leaves it (`goal_axis`: the handle BEHIND_OPENING inside the opening, short of the back wall). The carry
        first moves across to a lane where the hand keeps the most room on its way towards the opening (an open
        door may lean into the way), then along it to the front of the opening, then across to the set-down point,
        the point along the opening where the hand keeps the most room there (from the door, a control panel)."""
        b = self.box
        handle = self._grip_point()[:2] - self._axis()
        hand = self.hand @ self.grasp_rot.T
        hand_front = max(float(np.dot(p[:2], b.inward)) for p in hand if p[2] > 0.02)
        set_depth = b.front - 0.006 - hand_front - float(np.dot(handle, b.inward))
        front_depth = b.front - self.radius - 0.02
        foreign = foreign_oriented_boxes(self.sim, self._own())
        z = b.floor + CARRY_ABOVE_FLOOR + self.grip_above_bottom
        mid = float(np.dot(b.centre[:2], b.across))

        def at(depth, across):
            return b.inward * depth + b.across * across

        def room(points) -> float:  # the hand's least room with the mug's axis at each of the points
            grips = [np.r_[p + handle, z] for p in points]
            return min(float(_distance_to_boxes(g + hand, foreign).min()) for g in grips)

        def leg(a, c, step=0.02):
            n = max(2, int(np.ceil(np.linalg.norm(c - a) / step)) + 1)
            return [a + (c - a) * t for t in np.linspace(0.0, 1.0, n)]

        lo, hi = b.side_lo + self.radius + 0.012, b.side_hi - self.radius - 0.012
        best, best_score = None, -np.inf
        for across in np.linspace(lo, hi, 9):  # the set-down point
            points = leg(at(front_depth, across), at(set_depth, across))
            score = min(room(points), 0.02) - 0.01 * abs(across - mid)  # room up to 2 cm, then the middle
            if score > best_score:
                best, best_score = across, score
        start_depth = self._depth(self._axis())
        start_across = float(np.dot(self._axis(), b.across))
        lane, lane_score = start_across, -np.inf
        for across in np.linspace(lo - 0.06, hi + 0.06, 15):  # the lane towards the opening
            points = leg(at(start_depth, start_across), at(start_depth, across)) \
                + leg(at(start_depth, across), at(front_depth, across)) \
                + leg(at(front_depth, across), at(front_depth, best))
            score = min(room(points), 0.02) - 0.01 * abs(across - start_across)
            if score > lane_score:
                lane, lane_score = across, score
        self.waypoints = [at(start_depth, lane), at(front_depth, lane), at(front_depth, best)]
        self.set_axis = at(set_depth, best)
        depth = min(b.front + self.handle_reach + BEHIND_OPENING, b.back - self.radius - 0.008)
        self.goal_axis = at(depth, best)

    def _held(self, eef) -> bool:
        return float(np.linalg.norm(self._grip_point() - eef)) < 0.03

    # -- control --

    def act(self, raw_obs: dict) -> np.ndarray:
        eef = np.asarray(raw_obs["robot0_eef_pos"], dtype=np.float64)
        quat = raw_obs["robot0_eef_quat"]
        self.phase_steps += 1
        b = self.box
        inward3 = np.r_[b.inward, 0.0]
        grip, move = -1.0, np.zeros(3)
        rot_goal = self.grasp_rot @ self.ref_rot
        if self.phase in ("lift", "carry", "enter", "lower") and not self._held(eef):
            self._fail("approach")  # the mug left the hand
        if self.phase == "approach":  # above the handle, turned
            target = self._grip_point() + [0.0, 0.0, 0.08]
            move = _move(eef, target)
            if np.linalg.norm(target - eef) < 0.015 and _rot_error(rot_goal, quat) < 0.05:
                self._set("descend")
        if self.phase == "descend":
            target = self._grip_point()
            move = _move(eef, target, 0.5 if np.linalg.norm(target - eef) < 0.04 else 1.0)
            if np.linalg.norm(target - eef) < 0.005 or self.phase_steps > 40:
                self._set("close")
        if self.phase == "close":
            grip = 1.0
            if fingers_shut(self, raw_obs):
                self._plan()
                self._set("lift")
        if self.phase == "lift":
            grip = 1.0
            rise = b.floor + CARRY_ABOVE_FLOOR + 0.005 - self._bottom()
            move = _move(eef, eef + [0.0, 0.0, max(rise, 0.0)], 0.6)
            if rise < 0.005:
                self._set("carry")
            elif self.phase_steps > 40:
                self._fail("approach")
        if self.phase in ("carry", "enter"):  # along the waypoints, then in, the bottom above the floor
            grip = 1.0
            goal = self.set_axis if self.phase == "enter" else self.waypoints[0]
            target = eef + np.r_[goal - self._axis(), b.floor + CARRY_ABOVE_FLOOR - self._bottom()]
            move = _move(eef, target, 1.0 if self.phase == "carry" else 0.5)
            if np.linalg.norm(goal - self._axis()) < (0.008 if self.phase == "enter" or len(self.waypoints) == 1
                                                      else 0.02):
                if self.phase == "enter":
                    self._set("lower")
                elif len(self.waypoints) > 1:
                    self.waypoints.pop(0)
                else:
                    self._set("enter")
        if self.phase == "lower":
            grip = 1.0
            target = eef + [0.0, 0.0, b.floor + 0.002 - self._bottom()]
            move = _move(eef, target, 0.3)
            if target[2] - eef[2] > -0.003 or self.phase_steps > 25:
                self._set("release")
        if self.phase == "release":
            if self.phase_steps >= RELEASE_STEPS:
                self.release_at = eef.copy()
                self._set("rise")
        if self.phase == "rise":  # straight up, out of the handle
            target = self.release_at + [0.0, 0.0, 0.06]
            move = _move(eef, target)
            if target[2] - eef[2] < 0.01:
                self._set("push_approach")
        if self.phase in ("push_approach", "push_descend", "push"):
            # the closed fingertips 1.5 cm out of the handle's outer end, low on it, the hand tilted
            rot_goal, grip = self.push_rot @ self.ref_rot, 1.0
            z = self._bottom() + 0.03
            start = np.r_[self._axis() - b.inward * (self.handle_reach + 0.015), z]
        if self.phase == "push_approach":
            target = start - inward3 * 0.04
            target[2] = max(target[2] + 0.05, min(eef[2], target[2] + 0.1))
            move = _move(eef, target)
            if np.linalg.norm(target - eef) < 0.02 and _rot_error(rot_goal, quat) < TURN_TOLERANCE:
                self._set("push_descend")
        if self.phase == "push_descend":
            target = start - inward3 * 0.01
            move = _move(eef, target, 0.5)
            if np.linalg.norm(target - eef) < 0.008 or self.phase_steps > 30:
                self._set("push")
        if self.phase == "push":
            left = self._depth(self.goal_axis) - self._depth(self._axis())
            target = np.r_[(eef + inward3 * (left + 0.003))[:2], z]
            move = _move(eef, target, 0.4)
            if left < 0.002 or self.phase_steps > 60:
                self.release_at = eef.copy()
                self._set("back_off")
        if self.phase == "back_off":  # out and up, turning back to the reset orientation
            rot_goal = self.ref_rot
            target = self.release_at - inward3 * 0.06 + [0.0, 0.0, 0.06]
            move = _move(eef, target)
            if (np.linalg.norm(target - eef) < 0.02 or self.phase_steps > 40) \
                    and _rot_error(rot_goal, quat) < TURN_TOLERANCE:
                self.finished = self._depth(self._axis()) - self.handle_reach > b.front
                if self.finished:
                    self._set("done")
                else:
                    self._fail("push_approach")
        if self.phase in ("done", "give_up"):
            rot_goal = self.ref_rot
            move = np.zeros(3) if self.phase == "done" else _move(eef, eef + [0.0, 0.0, 0.05])
        return self._action(move, _rotation_towards(rot_goal, quat, TURN_GAIN), grip)


class DoorSkill(_Skill):
    """Close a fixture's hinged door (a vertical hinge) by pushing its outer face along the arc (module docstring)."""

    def __init__(self, env, fixture: str, ref_rot, recover=False, hold_orientation=False):
        super().__init__(env, ref_rot, recover, hold_orientation)
        sim, m = self.sim, self.sim.model._model
        fx = env.env.fixtures_dict.get(fixture)
        if fx is None:
            raise ExpertUnsupported(f"{fixture!r} is not a fixture")
        hinges = [j for j in fx.joints if m.jnt_type[sim.model.joint_name2id(j)] == 3]
        if len(hinges) != 1:
            raise ExpertUnsupported(f"{fixture!r} has no single hinged door (joints {fx.joints})")
        jid = sim.model.joint_name2id(hinges[0])
        d = sim.data._data
        if abs(d.xaxis[jid][2]) < 0.9:
            raise ExpertUnsupported(f"{fixture!r}: the door's hinge is not vertical")
        self.qadr, door = int(m.jnt_qposadr[jid]), int(m.jnt_bodyid[jid])
        self.hinge = d.xanchor[jid][:2].copy()
        self.sign = 1.0 if d.xaxis[jid][2] > 0 else -1.0  # +qpos turns counter-clockwise seen from above if > 0
        # LIBERO: closed once every joint is above the close range's lower end
        self.close_target = min(fx.object_properties["articulation"]["default_close_ranges"]) + 0.002
        # the panel, its largest collision geom (not the handle), and its long horizontal axis from the hinge
        panel = max(colliding_geoms(m, {door}), key=lambda g: float(np.prod(m.geom_aabb[g, 3:])))
        lo, hi = geom_box(sim, panel)
        mat = d.geom_xmat[panel].reshape(3, 3)
        k = max((k for k in range(3) if abs(mat[2, k]) < 0.5), key=lambda k: m.geom_size[panel][k])
        direction = mat[:2, k] / np.linalg.norm(mat[:2, k])
        if np.dot(direction, (lo[:2] + hi[:2]) / 2 - self.hinge) < 0:
            direction = -direction
        q = self.qpos()
        self.phi0 = float(np.arctan2(direction[1], direction[0])) - self.sign * q
        n = self.outer(q)
        # how far the panel's outer face stands from the hinge line (its own box, turned with the door)
        centre = d.geom_xpos[panel][:2] + mat[:2] @ m.geom_aabb[panel, :3]
        half = m.geom_aabb[panel, 3:]
        self.face = float(np.dot(centre - self.hinge, n) + np.abs(mat[:2].T @ n) @ half)
        self.top = float(max(b[2][2] for b in _geom_world_boxes(sim, {door})))
        self.z = self.top - 0.018  # the fingertips on the panel's top edge, the hand's body (2.4 cm up) above it
        self.stall_q = q

    def qpos(self) -> float:
        return float(self.sim.data.qpos[self.qadr])

    def direction(self, q: float) -> np.ndarray:
        """The unit xy direction of the panel from the hinge at joint position q."""
        phi = self.phi0 + self.sign * q
        return np.array([np.cos(phi), np.sin(phi)])

    def outer(self, q: float) -> np.ndarray:
        """The unit normal of the face that closing pushes (the door turns away from it) at joint position q."""
        phi = self.phi0 + self.sign * q
        return -self.sign * np.array([-np.sin(phi), np.cos(phi)])

    def act(self, raw_obs: dict) -> np.ndarray:
        eef = np.asarray(raw_obs["robot0_eef_pos"], dtype=np.float64)
        quat = raw_obs["robot0_eef_quat"]
        self.phase_steps += 1
        q = self.qpos()
        shut = q >= self.close_target
        move = np.zeros(3)
        if self.phase in ("approach", "down", "push") and shut:
            self._set("back_off")
        n = self.outer(q)
        p = self.hinge + DOOR_PUSH_RADIUS * self.direction(q)
        high = self.top + 0.045
        beside = float(np.dot(eef[:2] - p, n)) > self.face + 0.011  # the fingertips clear of the outer face
        if self.phase == "approach":  # over the door (from its inner side), to beside its outer face
            stand = p + n * (self.face + 0.02)
            if not beside and eef[2] < high - 0.01:
                target = np.r_[eef[:2], high]
            else:
                target = np.r_[stand, max(high, eef[2]) if not beside else self.z]
            move = _move(eef, target)
            if beside and np.linalg.norm(stand - eef[:2]) < 0.02:
                self._set("down")
        if self.phase == "down":
            target = np.r_[p + n * (self.face + 0.018), self.z]
            move = _move(eef, target)
            if abs(eef[2] - self.z) < 0.008 or self.phase_steps > 30:
                self.stall_q = q
                self._set("push")
        if self.phase == "push":  # the fingertips along the arc, a little ahead of the door
            ahead = min(q + DOOR_AHEAD, 0.03)
            target = np.r_[self.hinge + DOOR_PUSH_RADIUS * self.direction(ahead) + self.outer(ahead) * self.face,
                           self.z]
            move = _move(eef, target, 0.6)
            if self.phase_steps > 0 and self.phase_steps % DOOR_STALL_STEPS == 0:
                if q - self.stall_q < DOOR_STALL_TURN:
                    self._fail("back_off")
                self.stall_q = q
        if self.phase == "back_off":  # out from the face and up
            target = np.r_[p + n * (self.face + 0.05), self.z + 0.05]
            move = _move(eef, target)
            if np.linalg.norm(target - eef) < 0.02 or self.phase_steps > 30:
                self.finished = shut
                self._set("done" if shut else "approach")
        if self.phase == "give_up":
            move = _move(eef, [eef[0], eef[1], eef[2] + 0.05])
        return self._action(move, _rotation_towards(self.ref_rot, quat, TURN_GAIN), 1.0)
