"""The task-level scripted expert for LIBERO: a task's goal terms as a sequence of skills, pick-and-place
(`libero_expert.PickPlace`), the skills of `libero_skills` (drawers, the stove's knob, pushes) and of
`libero_enclosure` (a mug into the microwave, its door closed), each acting until LIBERO's predicate for its term
holds. `ScriptedExpert` is what `dz data record libero` and the env workers run.

Module-level imports are numpy and this package's expert modules only: it is imported where LIBERO may not be
installed."""

from __future__ import annotations

import numpy as np

from .libero_enclosure import DoorSkill, EnclosurePlace, enclosure
from .libero_expert import (PLACE_PREDICATES, ExpertUnsupported, PickPlace, _goal_of, goal_terms, quat_to_matrix,
                            unsupported_term)
from .libero_skills import DrawerSkill, KnobSkill, PushSkill, clearing_goal, moving_part, predicate_holds, push_goal


def goal_positions(env) -> np.ndarray:
    """Privileged (6,) float64, from the current simulator state: for a goal with an In/On term, the world xyz of
    its (first such term's) object (root body) and of its target (the region site, or the target's root body); for
    an articulation-only goal, the xyz of the moving part (the drawer's handle bar, the knob) and of its fixture's
    root body."""
    inner = env.env
    sim = inner.sim
    terms = goal_terms(env)
    if any(t[0] in PLACE_PREDICATES and len(t) == 3 for t in terms):
        pred, obj, target = _goal_of(env)
        obj_xyz = sim.data.body_xpos[sim.model.body_name2id(inner.objects_dict[obj].root_body)]
        if target in inner.object_sites_dict:
            tgt_xyz = sim.data.get_site_xpos(target)
        else:
            owner = inner.objects_dict.get(target) or inner.fixtures_dict[target]
            tgt_xyz = sim.data.body_xpos[sim.model.body_name2id(owner.root_body)]
        return np.concatenate([obj_xyz, tgt_xyz]).astype(np.float64)
    part, root = moving_part(env, terms[0])
    return np.concatenate([part, root]).astype(np.float64)


# --- the task-level expert: goal terms as a sequence of skills ---------------------------------------------------


def plan_terms(env) -> list[tuple[str, ...]]:
    """The goal terms in the order the expert works on them, with the steps the goal leaves implicit: drawers are
    opened first (and an In into a closed drawer's region opens that drawer), knobs turned, objects placed, drawers
    closed last (after what goes into them). ExpertUnsupported names a term without a skill."""
    terms = goal_terms(env)
    for term in terms:
        why = unsupported_term(term)
        if why:
            raise ExpertUnsupported(f"goal {terms}: {why}")
    rank = {"open": 0, "turnon": 1, "turnoff": 1, "in": 2, "on": 2, "close": 3}
    ordered = sorted(terms, key=lambda t: rank[t[0]])
    out: list[tuple[str, ...]] = []
    for term in ordered:
        if term[0] == "in" and "cabinet" in term[2] and ("open", term[2]) not in out \
                and ("close", term[2]) not in terms:
            # an In into a closed drawer: first set the object down away from under where the opened drawer will be
            # (if it is there), then open it
            out += [("clear", term[1], term[2]), ("open", term[2])]
        out.append(term)
    return out


class ScriptedExpert:
    """The scripted expert for a LIBERO task: its goal terms as a sequence of skills (`plan_terms`): pick-and-place
    (`PickPlace`), drawers, the stove's knob and pushes (`libero_skills`), a mug into the microwave and its door
    closed (`libero_enclosure`). Each skill acts until LIBERO's predicate for its term holds and its hand is free;
    the last one acts until the episode ends. A term that already holds when its turn comes is skipped. Call
    `act(raw_obs)` once per env step; it returns the next (7,) action."""

    def __init__(self, env, seed: int = 0, recover: bool = False, hold_orientation: bool = False):
        self.env = env
        self.seed, self.recover, self.hold_orientation = seed, bool(recover), bool(hold_orientation)
        self.terms = plan_terms(env)
        self.index = 0
        self.skill = None
        self.ref_rot = None
        if len(self.terms) == 1 and self.terms[0][0] in PLACE_PREDICATES and not self._is_push(self.terms[0]):
            self.skill = PickPlace(env, seed=seed, recover=recover, hold_orientation=hold_orientation,
                                   term=self.terms[0])  # checked now: an unsupported target fails here

    def _is_push(self, term) -> bool:

        return push_goal(self.env, term) is not None

    def _make(self, term):

        common = dict(recover=self.recover, hold_orientation=self.hold_orientation)
        seed = self.seed + 1000 * self.index
        if term[0] == "close" and term[1] in self.env.env.fixtures_dict:  # a fixture's hinged door
            return DoorSkill(self.env, term[1], self.ref_rot, **common)
        if term[0] in ("open", "close"):
            skill = DrawerSkill(self.env, term[1], term[0] == "open", self.ref_rot, **common)
            later = self.terms[self.index + 1] if self.index + 1 < len(self.terms) else None
            if later is not None and later[0] in PLACE_PREDICATES and later[1] in self.env.env.objects_dict:
                body = self.env.env.objects_dict[later[1]].root_body  # the next object to pick
                skill.next_xy = self.env.env.sim.data.body_xpos[self.env.env.sim.model.body_name2id(body)][:2].copy()
            return skill
        if term[0] in ("turnon", "turnoff"):
            return KnobSkill(self.env, term[1], term[0] == "turnon", self.ref_rot, **common)
        if term[0] == "clear":
            return PickPlace(self.env, seed=seed, ref_rot=self.ref_rot,
                             set_down_at=(term[1], clearing_goal(self.env, term[1], term[2])), **common)
        if term[0] == "in" and enclosure(self.env, term[2]) is not None:  # closed from above: by the handle
            return EnclosurePlace(self.env, term[1], term[2], self.ref_rot, **common)
        goal = push_goal(self.env, term)
        if goal is not None:
            return PushSkill(self.env, term[1], goal, term, self.ref_rot, **common)
        # after a drawer was opened, the approach stays high until it is over the grasp (the drawer overhangs)
        opened = any(t[0] == "open" for t in self.terms[:self.index])
        return PickPlace(self.env, seed=seed, term=term, ref_rot=self.ref_rot, descend_within=0.02 if opened else 0.1,
                         **common)

    @property
    def phase(self) -> str:
        return f"{self.index}:{getattr(self.skill, 'phase', '-')}"

    def _skill_done(self) -> bool:
        if self.skill is None:
            return True
        if isinstance(self.skill, PickPlace):  # its hand is free once it let go and rose after a successful place
            return self.skill.phase == "retreat" and self.skill.phase_steps >= 4 \
                and (self.terms[self.index][0] == "clear" or self._holds(self.terms[self.index]))
        return bool(self.skill.finished)

    def _holds(self, term) -> bool:

        if term[0] == "clear":
            return clearing_goal(self.env, term[1], term[2], margin=0.0) is None
        return predicate_holds(self.env, term)

    def act(self, raw_obs: dict) -> np.ndarray:
        if self.ref_rot is None:
            self.ref_rot = quat_to_matrix(raw_obs["robot0_eef_quat"])
            if isinstance(self.skill, PickPlace):
                self.skill.ref_rot = self.ref_rot if self.skill.ref_rot is None else self.skill.ref_rot
        while self.skill is None or (self.index < len(self.terms) - 1 and self._skill_done()):
            if self.skill is not None:
                self.index += 1
            # a term that already holds is skipped (unless it is the last: the episode would have ended)
            while self.index < len(self.terms) - 1 and self._holds(self.terms[self.index]):
                self.index += 1
            self.skill = self._make(self.terms[self.index])
        return self.skill.act(raw_obs)

    @property
    def label_valid(self) -> bool:
        return self.skill is None or self.skill.label_valid
