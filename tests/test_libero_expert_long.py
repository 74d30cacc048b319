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
