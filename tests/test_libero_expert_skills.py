"""The scripted expert in the real simulator. Its grasp yaw: LIBERO-Spatial task 4's black bowl sits in an open drawer
whose front and back walls leave no room for a finger beside the rim along the reset finger axis (world y), so the
expert turns the hand through the rotation dims of the standard 7-dim action before it grasps. One episode recorded
with `dz data record libero` at 64 px (about 30 s on 2 CPU cores); the libero_spatial profile is libero_object's
recipe on the other suite. The LIBERO-Goal skills (a drawer, the stove's knob, a push, a drawer then a place, a
place on a tilted fixture region), one recorded episode each, LIBERO's own `done` deciding success."""

from pathlib import Path

import numpy as np

from dzmodel.config import load_params
from tests.libero_expert_recording import record_expert

ROOT = Path(__file__).resolve().parents[1]


def _yaw(axis_angle: np.ndarray) -> float:
    """The yaw (rad, about world z) of the hand's x axis, from an axis-angle orientation."""
    from dzmodel.eval.libero_expert import quat_to_matrix

    angle = float(np.linalg.norm(axis_angle))
    axis = axis_angle / angle if angle > 0 else np.array([1.0, 0.0, 0.0])
    quat = np.array([*(axis * np.sin(angle / 2)), np.cos(angle / 2)])
    rot = quat_to_matrix(quat)
    return float(np.arctan2(rot[1, 0], rot[0, 0]))


def test_the_expert_turns_the_hand_to_take_the_bowl_out_of_the_open_drawer(tmp_path):
    rec, cols = record_expert(tmp_path, "spatial", 4)
    assert rec["successes"] == 1, rec["failures"]  # the bowl is on the plate within the suite's 220 steps
    action, state = np.asarray(cols["action"]), np.asarray(cols["observation.state"])
    assert np.any(action[:, 5] != 0)  # the yaw dim is commanded ...
    assert np.all(np.abs(action[:, 3:6]) <= 1)
    grasp = int(np.argmax(action[:, 6] > 0))  # the first closing step
    turned = np.angle(np.exp(1j * (_yaw(state[grasp, 3:6]) - _yaw(state[0, 3:6]))))
    assert abs(np.rad2deg(turned)) > 20  # ... and the hand is turned when the fingers close


def test_libero_spatial_is_the_libero_object_recipe_on_the_spatial_suite():
    """The same recipe, except that a failed start is retried with less noise and, on that larger recording,
    training makes fewer passes."""
    params = load_params(ROOT / "params.yaml")
    obj, spatial = params.selected("libero_object"), params.selected("libero_spatial")
    assert spatial.fetch.record.suite == "spatial" and spatial.eval.suite == "spatial"
    rec = spatial.fetch.record
    assert rec.tasks == list(range(10)) and rec.episodes == 50 and rec.init == "perturbed" and rec.min_shift_m > 0
    assert rec.retries == 3 and rec.retry_noise_scale == 0.5 and rec.noise_pilot == 10 and obj.fetch.record.retries == 0
    assert spatial.train["epochs"] == 15 < obj.train["epochs"]
    assert {**spatial.train, "epochs": obj.train["epochs"]} == obj.train
    assert spatial.vision == obj.vision and spatial.metadata == obj.metadata
    differ = {"suite", "retries", "retry_noise_scale", "noise_pilot"}
    assert {k: v for k, v in vars(rec).items() if k not in differ} == \
        {k: v for k, v in vars(obj.fetch.record).items() if k not in differ}
    assert spatial.eval.tasks == obj.eval.tasks and spatial.eval.episodes == obj.eval.episodes
    assert spatial.promote.registered_model != obj.promote.registered_model
    assert spatial.package.version != obj.package.version


# --- LIBERO-Goal: the skills beyond pick-and-place, one recorded episode each (64 px, one worker) ----------------


def _record_goal_task(tmp_path, task: int, suite: str = "goal") -> tuple[dict, dict]:
    """One expert episode of task `task` of a suite (LIBERO-Goal by default): (its recording summary, its columns:
    action, observation.state, observation.objects)."""
    return record_expert(tmp_path, suite, task)


def test_the_expert_opens_a_drawer_by_its_handle(tmp_path):
    rec, cols = _record_goal_task(tmp_path, 0)  # open the middle drawer of the cabinet
    assert rec["successes"] == 1, rec["failures"]
    handle = cols["observation.objects"][:, :3]  # the middle drawer's handle bar
    assert handle[-1, 1] - handle[0, 1] > 0.12  # pulled out along the slide (+y): open past 0.14 after the last row
    action = cols["action"]
    assert np.all(np.abs(action) <= 1) and set(np.unique(action[:, 6])) == {-1.0, 1.0}
    assert np.any(action[:, 3] != 0)  # the hand was turned to grip the bar from the front


def test_the_expert_turns_the_stoves_knob(tmp_path):
    rec, cols = _record_goal_task(tmp_path, 7)  # turn on the stove
    assert rec["successes"] == 1, rec["failures"]
    action, state = cols["action"], cols["observation.state"]
    closed = np.flatnonzero(action[:, 6] > 0)
    assert len(closed) > 0
    turned = np.angle(np.exp(1j * (_yaw(state[-1, 3:6]) - _yaw(state[closed[0], 3:6]))))
    assert np.rad2deg(turned) > 20  # the hand, gripping the knob, turned counter-clockwise about the vertical


def test_the_expert_pushes_the_plate_to_the_front_of_the_stove(tmp_path):
    rec, cols = _record_goal_task(tmp_path, 5)  # push the plate to the front of the stove
    assert rec["successes"] == 1, rec["failures"]
    plate = cols["observation.objects"][:, :3]
    assert plate[-1, 1] - plate[0, 1] > 0.15  # pushed across the table towards the stove (+y)
    assert np.all(cols["action"][:, 6] == 1.0)  # closed fingers push; the plate is never grasped
    assert np.all(np.abs(plate[:, 2] - plate[0, 2]) < 0.02)  # it stays on the table


def test_the_expert_opens_the_drawer_then_puts_the_bowl_inside(tmp_path):
    rec, cols = _record_goal_task(tmp_path, 3)  # open the top drawer and put the bowl inside (goal: only the In)
    assert rec["successes"] == 1, rec["failures"]
    bowl, region = cols["observation.objects"][:, :3], cols["observation.objects"][:, 3:]
    assert region[-1, 1] - region[0, 1] > 0.12  # the drawer's region moved out with the opened drawer ...
    assert bowl[-1, 2] - bowl[0, 2] > 0.15  # ... and the bowl went up into it
    assert np.any(cols["action"][:, 3] != 0)


def test_the_expert_places_the_wine_bottle_on_the_rack(tmp_path):
    rec, cols = _record_goal_task(tmp_path, 9)  # put the wine bottle on the rack (a tilted region of a fixture)
    assert rec["successes"] == 1, rec["failures"]
    bottle = cols["observation.objects"][:, :3]
    assert bottle[-1, 2] - bottle[0, 2] > 0.15  # lifted onto the rack


def _first_grasp(action: np.ndarray, after: int = 0) -> int:
    """The first step from `after` on at which the fingers close."""
    return after + int(np.argmax(action[after:, 6] > 0))


def test_the_expert_takes_a_mug_by_its_rim_away_from_its_handle(tmp_path):
    # LIBERO-10 task 4: the white mug onto the left plate, then the yellow and white mug onto the right one
    rec, cols = _record_goal_task(tmp_path, 4, suite="10")
    assert rec["successes"] == 1, rec["failures"]
    action, state, mug = cols["action"], cols["observation.state"], cols["observation.objects"][:, :3]
    grasp = _first_grasp(action)
    assert np.linalg.norm(state[grasp, :2] - mug[grasp, :2]) > 0.025  # at the rim, not over the middle
    assert mug[:, 2].max() - mug[0, 2] > 0.03  # lifted, not dragged


def test_the_expert_takes_the_moka_pot_by_its_handle(tmp_path):
    # LIBERO-10 task 2: turn on the stove (the knob), then the moka pot onto it
    rec, cols = _record_goal_task(tmp_path, 2, suite="10")
    assert rec["successes"] == 1, rec["failures"]
    action, state, pot = cols["action"], cols["observation.state"], cols["observation.objects"][:, :3]
    knob_released = int(np.flatnonzero(np.diff(action[:, 6]) < 0)[0]) + 1  # the knob let go
    grasp = _first_grasp(action, knob_released)
    assert np.linalg.norm(state[grasp, :2] - pot[grasp, :2]) > 0.05  # at the handle, away from the pot's body
    turned = np.angle(np.exp(1j * (_yaw(state[grasp, 3:6]) - _yaw(state[0, 3:6]))))
    assert abs(np.rad2deg(turned)) > 45  # the hand turned so that the fingers close across the handle


def test_libero_goal_and_libero_10_are_the_spatial_recipe_on_their_suites():
    """One profile per suite, the same recipe, each recording and evaluating all ten of its tasks. Each LIBERO
    profile draws success across its checkpoints."""
    params = load_params(ROOT / "params.yaml")
    spatial = params.selected("libero_spatial")
    for name, suite in (("libero_goal", "goal"), ("libero_10", "10")):
        prof = params.selected(name)
        assert prof.fetch.record.suite == suite and prof.eval.suite == suite
        assert prof.fetch.record.tasks == list(range(10)) and prof.eval.tasks == list(range(10))
        assert {k: v for k, v in vars(prof.fetch.record).items() if k not in ("suite", "tasks")} == \
            {k: v for k, v in vars(spatial.fetch.record).items() if k not in ("suite", "tasks")}
        assert prof.train == spatial.train and prof.vision == spatial.vision and prof.metadata == spatial.metadata
        assert prof.eval.episodes == 50 and prof.eval.checkpoints == "last"
        assert prof.promote.registered_model != spatial.promote.registered_model
        assert prof.package.version != spatial.package.version
    for name in ("libero_object", "libero_spatial", "libero_goal", "libero_10"):
        assert 0 < params.selected(name).eval.curve_episodes < params.selected(name).eval.episodes
