"""The scripted expert on LIBERO-10 tasks that put two objects into one place, in the real simulator: both moka pots
onto the stove's 15 cm cook region (the first is set down where the second, taken by its handle, still has room
beside it), and the cream cheese and the butter into the basket (a movable object, which the open hand, coming down
on a slant from inside it to the butter beside it, would catch by its wall and drag along). Recorded with
`dz data record libero` at 64 px, one worker, standard init states from 0, with the recorder's seeds; LIBERO's own
`done` decides success."""

import numpy as np
import pytest

from tests.libero_expert_recording import record_expert

pytestmark = pytest.mark.slow  # minutes of simulation each: `make test-slow` and CI run them


def _record_libero_10(tmp_path, task: int, episodes: int) -> tuple[dict, dict]:
    return record_expert(tmp_path, "10", task, episodes)


def test_the_expert_puts_both_moka_pots_on_the_stove(tmp_path):
    # LIBERO-10 task 8: two moka pots, each about 8 cm across its body and taken by its handle, onto one cook region
    rec, cols = _record_libero_10(tmp_path, 8, episodes=1)
    assert rec["successes"] == 1, rec["failures"]
    pot, region = cols["observation.objects"][:, :3], cols["observation.objects"][:, 3:]
    assert pot[-1, 2] - pot[0, 2] > 0.02  # the first pot stands on the stove, above the table ...
    assert np.linalg.norm(pot[-1, :2] - region[-1, :2]) > 0.015  # ... off the region's centre, leaving the second room


def test_the_expert_puts_the_cream_cheese_and_the_butter_into_the_basket(tmp_path):
    # LIBERO-10 task 1, init states 0-2: on init state 2 the hand came down to the butter through the basket's wall
    rec, _ = _record_libero_10(tmp_path, 1, episodes=3)
    assert rec["successes"] == 3, rec["failures"]


def _tilt_deg(axis_angle: np.ndarray) -> float:
    """The angle (degrees) between the hand's pointing direction (its z axis) and straight down."""
    from dzmodel.eval.libero_expert import quat_to_matrix

    angle = float(np.linalg.norm(axis_angle))
    axis = axis_angle / angle if angle > 0 else np.array([1.0, 0.0, 0.0])
    rot = quat_to_matrix(np.array([*(axis * np.sin(angle / 2)), np.cos(angle / 2)]))
    return float(np.degrees(np.arccos(np.clip(-rot[2, 2], -1.0, 1.0))))


def test_the_expert_puts_the_mug_into_the_microwave_by_its_handle_and_closes_the_door(tmp_path):
    # LIBERO-10 task 9: the microwave's ceiling leaves no room for a hand pointing down above the mug, so the mug is
    # taken by its handle, set down as far in as the hand reaches, pushed the rest of the way by the tilted fingers,
    # and the door is pushed shut along its arc
    rec, cols = _record_libero_10(tmp_path, 9, episodes=1)
    assert rec["successes"] == 1, rec["failures"]
    action, state, mug = cols["action"], cols["observation.state"], cols["observation.objects"][:, :3]
    grasp = int(np.flatnonzero(action[:, 6] > 0)[0])
    assert np.linalg.norm(state[grasp, :2] - mug[grasp, :2]) > 0.045  # at the handle, away from the mug's body
    assert mug[:, 2].max() - mug[0, 2] > 0.03  # lifted over the microwave's floor, not dragged
    released = grasp + int(np.flatnonzero(action[grasp:, 6] < 0)[0])
    assert max(_tilt_deg(s) for s in state[released:, 3:6]) > 30  # the push: fingers tilted towards the inside
    assert mug[-1, 1] - mug[released, 1] > 0.03  # ... moved the mug further in after it was let go
