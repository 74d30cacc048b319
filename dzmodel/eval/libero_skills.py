"""Scripted skills beyond pick-and-place for the LIBERO expert (`libero_scripted.ScriptedExpert` runs them in
sequence): opening and closing a drawer by its handle, turning the stove's knob, pushing an object across the table.

Like the pick-and-place skill, each acts only through LIBERO's standard 7-dim OSC_POSE action from privileged
simulator state (joint positions, handle and knob geometry, object poses), keeps the gripper at exactly -1 or +1,
and moves with the same saturating position law (`libero_expert.PickPlace._move`'s GAIN and NEG_X_CAP):

* Drawer (`DrawerSkill`): the hand is turned (through the rotation dims) until its fingers point horizontally into
  the cabinet, against the drawer's opening direction, and close along world z, so they straddle the handle bar from
  the front (pointing down, the hand's palm would meet the handles above, and an open finger would not fit the
  1.6 cm gap behind the bar). It grips the bar and pulls along the drawer's slide axis, then lets go, backs off and
  turns the hand back to its reset orientation. Closing turns the hand differently: the closed fingers point 45
  degrees down from the horizontal into the cabinet and close along the bar (the hand's 20 cm length lies along the
  cabinet's front), and their tips push the bar's front along the slide axis until the drawer is shut. Pointing
  straight down, the arm's forearm would meet the cabinet's top before an open bottom drawer is shut; horizontal,
  the wrist would reach back 30 cm at the bar's height, into what stands in front of the cabinet. An object in the
  drawer that stands higher than the drawer's front (a bowl let go onto the front wall, tilted) would catch on the
  cabinet above the opening: the fingertips first press its highest point down and towards the drawer's back (a bowl
  leaning on the front wall from inside), or push it off the front towards the back (one perched on the front), so
  that it settles flat on the drawer's floor, and rise straight out of it again.
* Knob (`KnobSkill`): the fingers, pointing down, grip the knob's grip bar over its axis, and the hand turns about
  the vertical (through the rotation dims) until the joint passes the on (or off) threshold with a margin.
* Push (`PushSkill`, a dish such as a plate): closed fingers, pointing down, go down onto the dish's flat centre and
  push the inside of its rim towards the goal; the aim is re-computed from the dish's measured position every step,
  and the rim keeps the fingers in line (behind the dish there may be no room for the hand: on LIBERO-Goal the plate
  starts 3 cm from the cabinet's handles). A hand that came out of the dish lines up again from above.

Rotation: the drawer and knob skills command the rotation dims while they turn the hand (and turn it back); the push
skill keeps them exactly 0 unless `hold_orientation` (then it holds the reset orientation, as pick-and-place does).
`recover` (DAgger): each phase machine re-plans from the state when it no longer fits (the handle or the object left
the hand); without it, a skill that failed MAX_TRIES times retreats with `label_valid` False.

Module-level imports are numpy and stdlib only (see `libero_expert`).
"""

from __future__ import annotations

import numpy as np

from .libero_expert import (GAIN, MAX_GRIPPER_OPENING, NEG_X_CAP, RELEASE_STEPS, ROT_OUTPUT_MAX,
                            ExpertUnsupported, _bodies_under, _body_box, _geom_world_boxes, colliding_geoms,
                            fingers_shut, fixture_of, matrix_to_rotvec, quat_to_matrix)

MAX_TRIES = 3
TURN_GAIN = 1.0            # fraction of the orientation error commanded per step while the hand turns
TURN_TOLERANCE = 0.08      # rad: the hand's orientation error under which it may move onto the handle
DRAWER_STANDOFF = 0.07     # m in front of the handle where the hand turns and lines up before it moves in
DRAWER_OPEN_MARGIN = 0.012  # m beyond LIBERO's open threshold the drawer is pulled (it must stay open after release)
DRAWER_PUSH_TILT = np.deg2rad(45.0)  # closing: the fingers' tilt from pointing straight down towards the cabinet
DRAWER_PUSH_STANDOFF = 0.04  # m in front of the bar's axis where the tilted fingers go down before pushing it in
DRAWER_CLOSE_MARGIN = 0.001  # m past LIBERO's close threshold (closed: qpos > 0) a drawer is pushed; a shut
                            # drawer stops at about 0.002, short of its joint range
DRAWER_STALL_STEPS = 15    # steps of pushing after which a drawer that moved less than DRAWER_STALL_MOVE has stalled
DRAWER_STALL_MOVE = 0.002  # m
DRAWER_SETTLE_PUSH = 0.05  # m an object standing higher than the drawer's front is pressed down, or pushed back
DRAWER_MAX_SETTLES = 3
KNOB_MARGIN = 0.25         # rad beyond LIBERO's on / off threshold the knob is turned
FINGER_HALF = 0.011        # m: half the closed fingers' thickness, pointing down (either horizontal axis)
PUSH_SPEED = 0.5           # action units along the push (2.5 cm per step at most)


def _move(eef, target, speed: float = 1.0) -> np.ndarray:
    """Saturating P-control of the eef position, -x capped (as pick-and-place)."""
    low = np.array([-min(speed, NEG_X_CAP), -speed, -speed])
    return np.clip(GAIN * (np.asarray(target, dtype=np.float64) - eef), low, speed)


def _rotation_towards(target: np.ndarray, quat, gain: float) -> np.ndarray:
    err = matrix_to_rotvec(target @ quat_to_matrix(quat).T)
    return np.clip(gain * err / ROT_OUTPUT_MAX, -1.0, 1.0)


def _rot_error(target: np.ndarray, quat) -> float:
    return float(np.linalg.norm(matrix_to_rotvec(target @ quat_to_matrix(quat).T)))


def predicate_holds(env, term) -> bool:
    """LIBERO's own predicate for one goal term ((name, *arguments), lower-case), on the current state."""
    from libero.libero.envs.predicates import eval_predicate_fn

    inner = env.env
    return bool(eval_predicate_fn(term[0], *[inner.object_states_dict[a] for a in term[1:]]))


class _Skill:
    """Shared bookkeeping: phase, steps in it, tries, the reset orientation, and the finished / valid flags."""

    def __init__(self, env, ref_rot, recover: bool, hold_orientation: bool):
        self.env, self.sim = env, env.env.sim
        self.ref_rot = ref_rot
        self.recover, self.hold_orientation = bool(recover), bool(hold_orientation)
        self.phase, self.phase_steps, self.tries = "approach", 0, 0
        self.gave_up = False
        self.finished = False   # the skill's work is done and the hand is free for the next one

    def _set(self, phase: str) -> None:
        self.phase, self.phase_steps = phase, 0

    def _fail(self, restart: str) -> None:
        self.tries += 1
        if self.recover or self.tries < MAX_TRIES:
            self._set(restart)
        else:
            self.gave_up = True
            self._set("give_up")

    @property
    def label_valid(self) -> bool:
        return not self.gave_up

    def _reset_rotation(self, quat) -> np.ndarray:
        """Rotation dims: exactly 0, or with hold_orientation back to the reset orientation."""
        if not self.hold_orientation:
            return np.zeros(3)
        return _rotation_towards(self.ref_rot, quat, 0.5)

    def _action(self, move, rot, gripper: float) -> np.ndarray:
        a = np.zeros(7)
        a[:3], a[3:6], a[6] = move, rot, gripper
        return a


# --- drawers ----------------------------------------------------------------------------------------------------


def drawer_joint(env, region: str) -> tuple[str, int]:
    """(joint name, body id) of the slide joint that moves a drawer's region site (ExpertUnsupported otherwise)."""
    sim = env.env.sim
    m = sim.model._model
    if region not in env.env.object_sites_dict:
        raise ExpertUnsupported(f"{region!r} is not a region of an articulated fixture")
    body = int(m.site_bodyid[sim.model.site_name2id(region)])
    for j in range(m.njnt):
        if int(m.jnt_bodyid[j]) == body and m.jnt_type[j] == 2:  # mjJNT_SLIDE
            return sim.model.joint_id2name(j), body
    raise ExpertUnsupported(f"{region!r} does not move on a slide joint (only drawers are opened and closed)")


class DrawerSkill(_Skill):
    """Open (pull) or close (push) the drawer that carries `region`, by its handle (module docstring)."""

    def __init__(self, env, region: str, opening: bool, ref_rot, recover=False, hold_orientation=False):
        super().__init__(env, ref_rot, recover, hold_orientation)
        self.opening = bool(opening)
        sim, m = self.sim, self.sim.model._model
        self.joint, self.body = drawer_joint(env, region)
        jid = sim.model.joint_name2id(self.joint)
        self.qadr = int(m.jnt_qposadr[jid])
        lo, hi = m.jnt_range[jid]
        axis = sim.data._data.xmat[self.body].reshape(3, 3) @ m.jnt_axis[jid]
        # LIBERO's drawers open towards negative qpos: the opening direction is -axis (horizontal)
        out = -axis
        out[2] = 0.0
        self.out = out / np.linalg.norm(out)
        fixture = fixture_of(env, region)
        thresholds = fixture.object_properties["articulation"] if fixture is not None else {}
        open_below = max(thresholds.get("default_open_ranges", [lo + 0.02]))
        self.open_target = max(float(lo) + 0.003, open_below - DRAWER_OPEN_MARGIN)
        close_above = min(thresholds.get("default_close_ranges", [0.0]))
        self.close_target = min(float(hi) - 0.002, close_above + DRAWER_CLOSE_MARGIN)
        self.handle_geom = self._handle_geom()
        # the hand's goal orientation: fingers pointing into the cabinet (-out), closing along world z
        approach, fingers = -self.out, np.array([0.0, 0.0, -1.0])
        side = np.cross(approach, fingers)
        # at reset the hand approaches along -z with its fingers along +y: the world rotation that maps e_x, e_y,
        # e_z to side, fingers, -approach turns it from there
        self.turned_rot = np.stack([side, fingers, -approach], axis=1) @ self.ref_rot
        # closing: the fingers point down and into the cabinet, DRAWER_PUSH_TILT from straight down, and close along
        # the cabinet's front (horizontal); the hand's reset x axis then points down and out of the cabinet, so that
        # the wrist's offset from the fingers' axis (along reset -x, towards the robot at reset) points up: the
        # forearm stays above the hand, leaning out of the cabinet along the fingers' axis
        closing = np.cross(-self.out, [0.0, 0.0, 1.0])
        tilt = np.sin(DRAWER_PUSH_TILT) * -self.out + np.cos(DRAWER_PUSH_TILT) * np.array([0.0, 0.0, -1.0])
        self.push_rot = np.stack([np.cross(tilt, closing), closing, -tilt], axis=1) @ self.ref_rot
        self.drawer_top = max(hi[2] for _, _, hi in _geom_world_boxes(sim, {self.body}))
        self.drawer_bottom = min(lo[2] for _, lo, _ in _geom_world_boxes(sim, {self.body}))
        self.settles = 0
        self.settle_from, self.settle_push = None, False
        self.stall_q = 0.0
        self.last_finger = 0.0
        self.next_xy = None  # where the next skill begins (set by the caller): turning back, the hand heads there

    def _load_to_settle(self):
        """Closing: (its highest point: the top centre of its highest collision box, its world box lo, hi) for an
        object resting in the drawer that stands higher than the drawer's front (it would catch on the cabinet above
        the opening), or None."""
        inner, sim = self.env.env, self.sim
        boxes = _geom_world_boxes(sim, {self.body})
        lo, hi = np.min([b[1] for b in boxes], axis=0), np.max([b[2] for b in boxes], axis=0)
        for obj in inner.objects_dict.values():
            root = sim.model.body_name2id(obj.root_body)
            origin = sim.data.body_xpos[root]
            if np.all(origin[:2] > lo[:2]) and np.all(origin[:2] < hi[:2]) and lo[2] - 0.01 < origin[2] < hi[2]:
                own = _geom_world_boxes(sim, _bodies_under(sim.model._model, root))
                _, blo, bhi = max(own, key=lambda b: float(b[2][2]))
                if bhi[2] > self.drawer_top + 0.003:
                    top = np.array([(blo[0] + bhi[0]) / 2, (blo[1] + bhi[1]) / 2, bhi[2]])
                    return top, np.min([b[1] for b in own], axis=0), np.max([b[2] for b in own], axis=0)
        return None

    def _handle_geom(self) -> int:
        """The drawer body's colliding geom that stands out furthest along the opening direction (the bar)."""
        d = self.sim.data._data
        return max(colliding_geoms(self.sim.model._model, {self.body}),
                   key=lambda g: float(np.dot(d.geom_xpos[g], self.out)))

    def qpos(self) -> float:
        return float(self.sim.data.qpos[self.qadr])

    def _handle(self) -> np.ndarray:
        return self.sim.data._data.geom_xpos[self.handle_geom].copy()

    def _act_close(self, raw_obs: dict) -> np.ndarray:
        """Closing (module docstring): the hand turns to the tilted push orientation on its way to the front of the
        bar; an object standing higher than the drawer's front is first settled (pressed down at its highest point,
        or pushed off the drawer's front); then the fingertips go down in front of the bar and push it in; a push
        that stalls backs off and starts again (settling again if the object still stands too high)."""
        eef = np.asarray(raw_obs["robot0_eef_pos"], dtype=np.float64)
        quat = raw_obs["robot0_eef_quat"]
        self.phase_steps += 1
        handle = self._handle()
        q = self.qpos()
        shut = q >= self.close_target
        move, rot_goal = np.zeros(3), self.push_rot
        if self.phase in ("approach", "settle_approach", "settle", "settle_rise", "descend", "push") and shut:
            self._set("back_off")
        standoff = handle + self.out * DRAWER_PUSH_STANDOFF
        # over the drawer's front: the tilted closed fingers, reaching about 2 cm below the eef, pass 1 cm above it
        above = max(handle[2] + 0.06, self.drawer_top + 0.03)
        if self.phase == "approach":
            load = self._load_to_settle() if self.settles < DRAWER_MAX_SETTLES else None
            if load is not None:
                top, olo, ohi = load
                # an object perched on the drawer's front (its bottom well above the drawer's floor) is pushed off it
                # towards the drawer's back from in front, just above the front; one leaning on the front from inside
                # (a bowl resting on its floor, tilted) has its high side pressed down, from 1.5 cm above it
                self.settle_push = olo[2] > self.drawer_bottom + 0.025
                if self.settle_push:
                    centre = (olo + ohi) / 2
                    front = max(float(np.dot([x, y], self.out[:2]))
                                for x in (olo[0], ohi[0]) for y in (olo[1], ohi[1]))
                    self.settle_from = centre + self.out * (front - float(np.dot(centre[:2], self.out[:2])) + 0.015)
                    self.settle_from[2] = self.drawer_top + 0.025
                else:
                    self.settle_from = top + [0.0, 0.0, 0.025]
                self._set("settle_approach")
            else:
                target = np.array([standoff[0], standoff[1], above])
                if np.linalg.norm((standoff - eef)[:2]) > 0.02:
                    target[2] = max(above, eef[2])
                move = _move(eef, target)
                if np.linalg.norm(target - eef) < 0.02 and _rot_error(rot_goal, quat) < TURN_TOLERANCE:
                    self._set("descend")
        if self.phase == "settle_approach":  # above the object's highest point, turned
            target = self.settle_from.copy()
            if np.linalg.norm((target - eef)[:2]) > 0.02 or _rot_error(rot_goal, quat) > TURN_TOLERANCE:
                target[2] = max(target[2] + 0.04, eef[2])
            move = _move(eef, target)
            if np.linalg.norm(self.settle_from - eef) < 0.01:
                self._set("settle")
            elif self.phase_steps > 60:
                self.settles += 1
                self._set("approach")
        if self.phase == "settle":  # the fingertips push it towards the drawer's back, or press its high side down
            target = self.settle_from - self.out * DRAWER_SETTLE_PUSH if self.settle_push \
                else self.settle_from - self.out * 0.02 - [0.0, 0.0, DRAWER_SETTLE_PUSH + 0.025]
            move = _move(eef, target, 0.3)
            if np.linalg.norm(target - eef) < 0.01 or self.phase_steps > 40:
                self.settles += 1
                self._set("settle_rise")
        if self.phase == "settle_rise":  # straight up, out of the object (moving out, the fingers would drag it)
            target = np.array([eef[0], eef[1], max(above, self.settle_from[2] + 0.02)])
            move = _move(eef, target)
            if target[2] - eef[2] < 0.01 or self.phase_steps > 30:
                self._set("approach")
        if self.phase == "descend":
            move = _move(eef, standoff)
            if np.linalg.norm(standoff - eef) < 0.01 or self.phase_steps > 30:
                self.stall_q = q
                self._set("push")
        if self.phase == "push":
            move = _move(eef, handle - self.out * 0.08, 0.6)
            if self.phase_steps > 0 and self.phase_steps % DRAWER_STALL_STEPS == 0:
                if q - self.stall_q < DRAWER_STALL_MOVE:  # stalled: back off and start again
                    self._fail("back_off")
                self.stall_q = q
        if self.phase == "back_off":  # out along the slide axis and up, still turned
            target = handle + self.out * (DRAWER_PUSH_STANDOFF + 0.04) + [0.0, 0.0, 0.04]
            move = _move(eef, target)
            if np.linalg.norm(target - eef) < 0.02 or self.phase_steps > 30:
                self._set("restore" if shut else "approach")
        if self.phase == "restore":  # up, turning back to the reset orientation
            rot_goal = self.ref_rot
            target = handle + self.out * (DRAWER_PUSH_STANDOFF + 0.04) + [0.0, 0.0, 0.1]
            move = _move(eef, target)
            if _rot_error(rot_goal, quat) < TURN_TOLERANCE and np.linalg.norm(target - eef) < 0.02:
                self.finished = shut
                self._set("done")
        if self.phase == "give_up":
            rot_goal = self.ref_rot
            move = _move(eef, [eef[0], eef[1], eef[2] + 0.05])
        return self._action(move, _rotation_towards(rot_goal, quat, TURN_GAIN), 1.0)

    def act(self, raw_obs: dict) -> np.ndarray:
        if not self.opening:
            return self._act_close(raw_obs)
        eef = np.asarray(raw_obs["robot0_eef_pos"], dtype=np.float64)
        quat = raw_obs["robot0_eef_quat"]
        self.phase_steps += 1
        handle = self._handle()
        q = self.qpos()
        goal_reached = q <= self.open_target
        standoff = handle + self.out * DRAWER_STANDOFF
        grip = -1.0
        move, rot_goal = np.zeros(3), self.turned_rot

        if self.recover and self.phase in ("pull", "close") and np.linalg.norm(eef - handle) > 0.04:
            self._set("approach")
        if self.phase in ("approach", "insert", "close", "pull") and goal_reached:
            self._set("release")
        if self.phase == "approach":
            # to the standoff point in front of the handle, turning on the way; drop height only when close in xy
            xy_err = np.linalg.norm((standoff - eef)[:2])
            target = standoff.copy()
            if xy_err > 0.08:
                target[2] = max(target[2], eef[2])
            move = _move(eef, target)
            if np.linalg.norm(standoff - eef) < 0.025 and _rot_error(rot_goal, quat) < TURN_TOLERANCE:
                self._set("insert")
        if self.phase == "insert":
            move = _move(eef, handle, 1.0 if np.linalg.norm(handle - eef) > 0.03 else 0.5)
            if np.linalg.norm(handle - eef) < 0.01 or self.phase_steps > 25:
                self._set("close")
        if self.phase == "close":  # the fingers shut on the bar
            grip = 1.0
            move = _move(eef, handle, 0.3)
            if fingers_shut(self, raw_obs):
                self._set("pull")
        if self.phase == "pull":
            grip = 1.0
            move = _move(eef, handle + self.out * 0.08)
            if np.linalg.norm(eef - handle) > 0.04:  # the bar slipped out of the fingers
                self._fail("approach")
            elif self.phase_steps > 120:
                self._fail("release")
        if self.phase == "release":
            grip = -1.0
            move = np.zeros(3)
            if self.phase_steps >= RELEASE_STEPS:
                self._set("back_off")
        if self.phase == "back_off":  # straight out along the opening direction, still turned
            grip = -1.0
            target = handle + self.out * 0.05
            move = _move(eef, target)
            if np.linalg.norm(target - eef) < 0.02 or self.phase_steps > 30:
                self._set("restore")
        if self.phase == "restore":  # up, turning back to the reset orientation
            grip = -1.0
            rot_goal = self.ref_rot
            goal_xy = eef[:2] if self.next_xy is None else self.next_xy
            move = _move(eef, [goal_xy[0], goal_xy[1], handle[2] + 0.06])
            if _rot_error(rot_goal, quat) < TURN_TOLERANCE and handle[2] + 0.06 - eef[2] < 0.02:
                self.finished = goal_reached
                if not goal_reached:
                    self._fail("approach")
        if self.phase == "give_up":
            grip, rot_goal = -1.0, self.ref_rot
            move = _move(eef, [eef[0], eef[1], eef[2] + 0.05])
        return self._action(move, _rotation_towards(rot_goal, quat, TURN_GAIN), grip)


# --- the stove's knob -------------------------------------------------------------------------------------------


class KnobSkill(_Skill):
    """Turn a fixture's knob (a hinge about a vertical axis) on, past LIBERO's on threshold, or off: grip its grip
    bar from above over the axis (the fingers close across the bar), turn the hand about the vertical through the
    rotation dims until the joint is past the threshold with a margin, let go, rise and turn the hand back."""

    def __init__(self, env, fixture: str, on: bool, ref_rot, recover=False, hold_orientation=False):
        super().__init__(env, ref_rot, recover, hold_orientation)
        inner = env.env
        if fixture not in inner.fixtures_dict:
            raise ExpertUnsupported(f"{fixture!r} is not a fixture")
        fx = inner.fixtures_dict[fixture]
        sim, m, d = self.sim, self.sim.model._model, self.sim.data._data
        hinges = [j for j in fx.joints if m.jnt_type[sim.model.joint_name2id(j)] == 3]
        if len(hinges) != 1:
            raise ExpertUnsupported(f"{fixture!r} has no single knob joint to turn (joints {fx.joints})")
        jid = sim.model.joint_name2id(hinges[0])
        self.qadr, self.body = int(m.jnt_qposadr[jid]), int(m.jnt_bodyid[jid])
        axis = d.xmat[self.body].reshape(3, 3) @ m.jnt_axis[jid]
        if abs(axis[2]) < 0.9:
            raise ExpertUnsupported(f"{fixture!r}: the knob's axis is not vertical")
        self.sign = 1.0 if axis[2] > 0 else -1.0  # +qpos turns counter-clockwise seen from above when sign > 0
        anchor = d.xanchor[jid] if hasattr(d, "xanchor") else d.xpos[self.body]
        self.centre = np.asarray(anchor[:2], dtype=np.float64).copy()
        art = fx.object_properties["articulation"]
        self.on = bool(on)
        # LIBERO: on at qpos >= min(turnon range), off at qpos < max(turnoff range)
        self.q_goal = min(art.get("default_turnon_ranges", [0.5])) + KNOB_MARGIN if self.on \
            else max(art.get("default_turnoff_ranges", [0.0])) - 0.02
        boxes = _geom_world_boxes(sim, {self.body})
        self.bar_top = max(hi[2] for _, lo, hi in boxes)
        self.grasp_z = self.bar_top - 0.016
        self.hover = 0.06
        self.last_finger = 0.0
        self.twist_rot = None

    def qpos(self) -> float:
        return float(self.sim.data.qpos[self.qadr])

    def _reached(self) -> bool:
        return self.qpos() >= self.q_goal if self.on else self.qpos() <= self.q_goal

    def act(self, raw_obs: dict) -> np.ndarray:
        eef = np.asarray(raw_obs["robot0_eef_pos"], dtype=np.float64)
        quat = raw_obs["robot0_eef_quat"]
        self.phase_steps += 1
        grasp = np.array([self.centre[0], self.centre[1], self.grasp_z])
        move, grip, rot = np.zeros(3), -1.0, self._reset_rotation(quat)
        if self.phase == "approach":
            target = grasp + [0.0, 0.0, self.hover]
            xy_err = np.linalg.norm(target[:2] - eef[:2])
            if xy_err > 0.05:
                target[2] = max(target[2], eef[2])
            move = _move(eef, target)
            if xy_err < 0.008 and abs(target[2] - eef[2]) < 0.02:
                self._set("descend")
        if self.phase == "descend":
            move = _move(eef, grasp, 0.5)
            if np.linalg.norm(grasp - eef) < 0.006 or self.phase_steps > 30:
                self._set("close")
        if self.phase == "close":
            grip = 1.0
            move = _move(eef, grasp, 0.3)
            if fingers_shut(self, raw_obs):
                # the hand's goal: turned about the vertical by what the knob still has to turn, and a little more
                turn = self.sign * (self.q_goal - self.qpos() + (0.15 if self.on else -0.15))
                c, s = np.cos(turn), np.sin(turn)
                self.twist_rot = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]]) @ quat_to_matrix(quat)
                self._set("twist")
        if self.phase == "twist":
            grip = 1.0
            move = _move(eef, grasp, 0.3)
            rot = _rotation_towards(self.twist_rot, quat, TURN_GAIN)
            if self._reached():
                self._set("release")
            elif self.phase_steps > 40:
                self._fail("release")
        if self.phase == "release":
            grip = -1.0
            move = np.zeros(3)
            rot = np.zeros(3)
            if self.phase_steps >= RELEASE_STEPS:
                self._set("restore")
        if self.phase == "restore":  # up, turning back to the reset orientation
            target = grasp + [0.0, 0.0, self.hover]
            move = _move(eef, target)
            rot = _rotation_towards(self.ref_rot, quat, TURN_GAIN)
            if _rot_error(self.ref_rot, quat) < TURN_TOLERANCE and target[2] - eef[2] < 0.02:
                self.finished = self._reached()
                if not self.finished:
                    self._fail("approach")
        if self.phase == "give_up":
            move = _move(eef, [eef[0], eef[1], eef[2] + 0.05])
        return self._action(move, rot, grip)


# --- pushing ----------------------------------------------------------------------------------------------------


class PushSkill(_Skill):
    """Push a dish-like `obj` (a plate) across the table until its origin is near `goal_xy`; `term` is LIBERO's
    goal term that the push must make true. The closed fingertips go down onto the dish's flat centre and push the
    inside of its rim, so the rim keeps them in line (module docstring)."""

    def __init__(self, env, obj: str, goal_xy, term, ref_rot, recover=False, hold_orientation=False):
        """`term` None: a push that makes room for another skill (`clearing_goal`); it is done at `goal_xy`."""
        super().__init__(env, ref_rot, recover, hold_orientation)
        inner = env.env
        self.obj, self.term = obj, term
        self.goal_xy = np.asarray(goal_xy, dtype=np.float64)
        body = inner.objects_dict[obj].root_body
        self.body_id = self.sim.model.body_name2id(body)
        boxes = _geom_world_boxes(self.sim, _bodies_under(self.sim.model._model, self.body_id))
        lo = np.min([b[1] for b in boxes], axis=0)
        hi = np.max([b[2] for b in boxes], axis=0)
        origin = self.sim.data.body_xpos[self.body_id].copy()
        self.radius = float(np.max(hi[:2] - lo[:2]) / 2)
        # the flat centre: the colliding boxes around the origin (inside the rim)
        centre = [(blo, bhi) for _, blo, bhi in boxes
                  if np.linalg.norm((blo[:2] + bhi[:2]) / 2 - origin[:2]) < 0.006 and np.all(bhi[:2] - blo[:2] < 0.1)]
        self.inner_r = float(min(min(bhi[:2] - blo[:2]) / 2 for blo, bhi in centre)) if centre else 0.4 * self.radius
        floor_above_origin = (max(bhi[2] for _, bhi in centre) if centre else lo[2] + 0.006) - origin[2]
        self.floor_above_origin = float(floor_above_origin)
        self.top_above_origin = float(hi[2] - origin[2])
        # the finger pads end 5 mm below the grip site: just above the dish's floor (the fingers rest on it), unless
        # the hand's palm (2.4 cm above the grip site) would meet a deep dish's rim first (a bowl: the pads then
        # push its wall)
        self.push_above_origin = max(self.floor_above_origin + 0.006, self.top_above_origin - 0.021)
        self.safe_above_origin = self.top_above_origin + 0.013 + 0.03

    def act(self, raw_obs: dict) -> np.ndarray:
        eef = np.asarray(raw_obs["robot0_eef_pos"], dtype=np.float64)
        quat = raw_obs["robot0_eef_quat"]
        self.phase_steps += 1
        origin = self.sim.data.body_xpos[self.body_id].copy()
        obj = origin[:2]
        to_goal = self.goal_xy - obj
        dist = float(np.linalg.norm(to_goal))
        u = to_goal / max(dist, 1e-9)
        start = obj + u * (self.inner_r - FINGER_HALF - 0.004)  # on the floor, the rim just ahead
        push_z, safe_z = origin[2] + self.push_above_origin, origin[2] + self.safe_above_origin
        move = np.zeros(3)
        if self.phase in ("approach", "descend", "push") and dist < 0.012:
            self._set("retreat")
        if self.phase == "approach":
            target = np.array([start[0], start[1], safe_z])
            xy_err = np.linalg.norm(target[:2] - eef[:2])
            if xy_err > 0.04:
                target[2] = max(target[2], eef[2])
            move = _move(eef, target)
            if xy_err < 0.008 and abs(eef[2] - safe_z) < 0.02:
                self._set("descend")
        if self.phase == "descend":
            target = np.array([start[0], start[1], push_z])
            move = _move(eef, target, 0.6)
            if abs(eef[2] - push_z) < 0.005 or self.phase_steps > 30:
                self._set("push")
        if self.phase == "push":
            # along the line object -> goal
            ahead = obj + u * (self.radius + min(0.03, dist + 0.004))  # beyond the far rim: the push saturates
            move = _move(eef, [ahead[0], ahead[1], push_z], PUSH_SPEED)
            if self.phase_steps % 8 in (0, 1) and self.phase_steps < 8:
                self.checkpoint = obj.copy()  # the dish's position 8 steps ago: it must have moved since
            stalled = self.phase_steps >= 8 and self.phase_steps % 8 == 0 \
                and np.linalg.norm(obj - self.checkpoint) < 0.004
            if self.phase_steps % 8 == 0:
                self.checkpoint = obj.copy()
            if np.linalg.norm(eef[:2] - obj) > self.radius or eef[2] > push_z + 0.03 or stalled:
                self._set("lift")  # the hand came out of the dish or slid over its rim: line up again from above
            elif self.phase_steps > 150:
                self._fail("lift")
        if self.phase == "lift":
            move = _move(eef, [eef[0], eef[1], safe_z])
            if safe_z - eef[2] < 0.01:
                self._set("approach")
        if self.phase == "retreat":
            move = _move(eef, [eef[0], eef[1], safe_z])
            if safe_z - eef[2] < 0.01:
                self.finished = predicate_holds(self.env, self.term) if self.term is not None else dist < 0.015
                if not self.finished:
                    self._fail("approach")
        if self.phase == "give_up":
            move = _move(eef, [eef[0], eef[1], eef[2] + 0.05])
        return self._action(move, self._reset_rotation(quat), 1.0)


def clearing_goal(env, obj: str, region: str, margin: float = 0.008) -> np.ndarray | None:
    """Where to set `obj` down before the drawer that carries `region` is opened, so that the opened drawer does not
    hang over it (the hand, pointing down, could not reach its grasp): its xy moved sideways (across the opening
    direction) until the hand at a rim grasp clears the opened drawer's footprint by `margin`; None if it already
    does (with margin 0)."""
    sim = env.env.sim
    joint, body = drawer_joint(env, region)
    m = sim.model._model
    jid = sim.model.joint_name2id(joint)
    out = -(sim.data._data.xmat[body].reshape(3, 3) @ m.jnt_axis[jid])
    out[2] = 0.0
    out /= np.linalg.norm(out)
    travel = float(sim.data.qpos[int(m.jnt_qposadr[jid])] - m.jnt_range[jid][0])
    boxes = _geom_world_boxes(sim, {body})
    lo = np.min([b[1] for b in boxes], axis=0)[:2] + np.minimum(out[:2] * travel, 0)
    hi = np.max([b[2] for b in boxes], axis=0)[:2] + np.maximum(out[:2] * travel, 0)
    olo, ohi = _body_box(sim, env.env.objects_dict[obj].root_body)
    centre = (olo[:2] + ohi[:2]) / 2
    origin = sim.data.body_xpos[sim.model.body_name2id(env.env.objects_dict[obj].root_body)][:2]
    side = np.array([abs(out[1]), abs(out[0])])  # the horizontal axis across the opening direction (x or y)
    k = int(np.argmax(side))
    reach_along = (ohi - olo)[1 - k] / 2 + 0.105    # a rim grasp's hand: the radius plus the hand's half length
    reach_across = 0.045                            # the hand's half width
    if centre[1 - k] + reach_along < lo[1 - k] or centre[1 - k] - reach_along > hi[1 - k] \
            or centre[k] + reach_across + margin < lo[k] or centre[k] - reach_across - margin > hi[k]:
        return None
    low_goal, high_goal = lo[k] - reach_across - margin, hi[k] + reach_across + margin
    goal = origin.copy()
    goal[k] += (low_goal - centre[k]) if abs(low_goal - centre[k]) <= abs(high_goal - centre[k]) \
        else (high_goal - centre[k])
    return goal


# --- which skill, and what it moves ------------------------------------------------------------------------------


def push_goal(env, term) -> np.ndarray | None:
    """The table xy an On term's object is pushed to, or None when it is picked and placed: the object is pushed
    when it is flat and too wide for the open gripper both ways (a plate) and the target is a region of the table."""
    inner = env.env
    if term[0] != "on" or len(term) != 3 or term[2] not in inner.object_sites_dict or term[1] not in inner.objects_dict:
        return None
    sim = inner.sim
    site_body = int(sim.model._model.site_bodyid[sim.model.site_name2id(term[2])])
    if "table" not in (sim.model.body_id2name(site_body) or ""):
        return None
    lo, hi = _body_box(sim, inner.objects_dict[term[1]].root_body)
    size = hi - lo
    if min(size[0], size[1]) <= MAX_GRIPPER_OPENING or size[2] > 0.04:
        return None
    return sim.data.get_site_xpos(term[2])[:2].copy()


def moving_part(env, term) -> tuple[np.ndarray, np.ndarray]:
    """(world xyz of the part an articulation term moves: a drawer's handle bar or a knob's body, world xyz of its
    fixture's root body)."""
    inner = env.env
    sim = inner.sim
    name = term[1]
    fixture = next((fx for n, fx in inner.fixtures_dict.items() if name == n or name.startswith(n + "_")), None)
    root = sim.data.body_xpos[sim.model.body_name2id(fixture.root_body)].copy() if fixture is not None \
        else np.zeros(3)
    if term[0] in ("open", "close"):
        skill = DrawerSkill.__new__(DrawerSkill)
        skill.sim, skill.env = sim, env
        skill.joint, skill.body = drawer_joint(env, name)
        m = sim.model._model
        jid = sim.model.joint_name2id(skill.joint)
        out = -(sim.data._data.xmat[skill.body].reshape(3, 3) @ m.jnt_axis[jid])
        out[2] = 0.0
        skill.out = out / np.linalg.norm(out)
        skill.handle_geom = skill._handle_geom()
        return skill._handle(), root
    fx = inner.fixtures_dict[name]
    hinge = next(j for j in fx.joints if sim.model._model.jnt_type[sim.model.joint_name2id(j)] == 3)
    body = int(sim.model._model.jnt_bodyid[sim.model.joint_name2id(hinge)])
    return sim.data.body_xpos[body].copy(), root
