"""The scripted expert closes a drawer in the real simulator: LIBERO-10 task 3 puts the black bowl into the cabinet's
open bottom drawer and shuts it. The fingertips, the hand tilted 45 degrees down into the cabinet, push the drawer's
handle bar (pointing straight down, the forearm met the cabinet's top before the drawer was shut). One episode
recorded with `dz data record libero` at 64 px (about a minute on 2 CPU cores), LIBERO's own `done` deciding
success."""

import numpy as np
import pytest

from tests.libero_expert_recording import record_expert

pytestmark = pytest.mark.slow  # minutes of simulation each: `make test-slow` and CI run them


def test_the_expert_puts_the_bowl_into_the_bottom_drawer_and_closes_it(tmp_path):
    rec, cols = record_expert(tmp_path, "10", 3)
    assert rec["successes"] == 1, rec["failures"]  # the bowl In the drawer's region and the drawer Close(d)
    action, objects = np.asarray(cols["action"]), np.asarray(cols["observation.objects"])
    bowl, region = objects[:, :3], objects[:, 3:]
    # the drawer's region moved into the cabinet (+y) with the drawer, by its whole travel (it starts 14.4 cm open)
    assert region[-1, 1] - region[0, 1] > 0.13
    assert np.linalg.norm(bowl[-1, :2] - region[-1, :2]) < 0.08  # the bowl went in with it
    assert np.all(np.abs(action) <= 1) and np.any(action[:, 3:6] != 0)  # the hand was turned to push
