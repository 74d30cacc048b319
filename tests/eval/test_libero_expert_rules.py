"""The pick-and-place expert's decision rules that need no simulator: how a rim grasp is scored, and when a failed
grasp is planned again. (Their effect in LIBERO scenes: test_libero_expert_plans.py.)"""

import numpy as np

from dzmodel.eval import libero_expert as le


def test_a_grasp_whose_way_down_is_blocked_ranks_below_every_grasp_whose_way_is_clear():
    # the unturned grasp: 9 mm at the grasp, but the hand meets a crossbar on the way down
    blocked_default = le._grasp_score([0.009, 0.004, 0.0, 0.002], le.BOWL_RIM_INSET, 0.0)
    # a turned, deeper grasp with little room but a clear way
    turned = le._grasp_score([0.003, 0.004, 0.006, 0.008], le.RIM_INSETS[-1], np.deg2rad(90))
    assert turned > blocked_default


def test_room_beyond_enough_does_not_count_and_then_the_smaller_turn_and_shallower_inset_win():
    roomy = [le.ROOM_ENOUGH + 0.02] * 6
    enough = [le.ROOM_ENOUGH] * 6
    assert le._grasp_score(roomy, le.BOWL_RIM_INSET, 0.3) == le._grasp_score(enough, le.BOWL_RIM_INSET, 0.3)
    assert le._grasp_score(enough, le.BOWL_RIM_INSET, 0.0) > le._grasp_score(enough, le.BOWL_RIM_INSET, 0.3)
    assert le._grasp_score(enough, le.BOWL_RIM_INSET, 0.3) > le._grasp_score(enough, le.RIM_INSETS[1], 0.3)
    # below enough, more room wins over a smaller turn
    assert le._grasp_score([0.006] * 6, le.BOWL_RIM_INSET, 1.0) > le._grasp_score([0.003] * 6, le.BOWL_RIM_INSET, 0.0)


def test_the_room_that_counts_is_the_least_on_the_way_down_not_only_at_the_grasp():
    # the unturned grasp with room at the grasp but a tight way down (above the 1 mm of a blocked one) loses to a
    # turned grasp with a roomier way: the score is judged as the search is triggered, by the least room
    tight_way = le._grasp_score([0.009, 0.005, 0.003, 0.004], le.BOWL_RIM_INSET, 0.0)
    roomy_turn = le._grasp_score([0.008, 0.007, 0.007, 0.008], le.BOWL_RIM_INSET, np.deg2rad(30))
    assert roomy_turn > tight_way


class _Planned:
    """A PickPlace with its planning calls counted instead of run (no simulator)."""

    def __init__(self):
        self.skill = le.PickPlace.__new__(le.PickPlace)
        self.calls = []
        self.skill._plan_grasp = lambda: self.calls.append("plan")
        self.skill._mind_the_place = lambda: self.calls.append("side")
        self.skill.replan_pending, self.skill.descend_from, self.skill.phase_steps = True, 0.1, 0


def test_a_failed_grasp_is_planned_again_only_once_the_object_has_come_to_rest():
    p = _Planned()
    s = p.skill
    s._obj_prev = np.array([0.10, 0.0, 0.9])
    s._replan_when_settled(np.array([0.10 + 3 * le.SETTLED_SPEED, 0.0, 0.9]))  # still sliding
    assert p.calls == [] and s.replan_pending
    s._obj_prev, s.phase_steps = np.array([0.12, 0.0, 0.9]), 3
    s._replan_when_settled(np.array([0.12 + 0.2 * le.SETTLED_SPEED, 0.0, 0.9]))  # at rest
    assert p.calls == ["plan", "side"] and not s.replan_pending and s.descend_from is None


def test_an_object_that_keeps_moving_is_planned_for_as_it_is_after_the_wait():
    p = _Planned()
    s = p.skill
    s._obj_prev, s.phase_steps = np.zeros(3), le.SETTLE_WAIT_STEPS
    s._replan_when_settled(np.array([0.01, 0.0, 0.0]))
    assert p.calls == ["plan", "side"] and not s.replan_pending
