"""The limits `dz serve` puts on every chunk (dzmodel/serve/safety.py): NaN refused, range clipped, change per
step limited within a chunk, each logged; limits that would not protect are refused where they are read."""

import logging

import numpy as np
import pytest

from dzmodel.serve.package import RobotConfig
from dzmodel.serve.safety import ActionSafety, UnsafeActions

ROBOT = {"kind": "humanoid", "name": "Unitree G1", "action_space": "joint", "action_mode": "absolute",
         "control_rate_hz": 50.0, "action_dim": 3, "action_min": [-1.0, -1.0, 0.0], "action_max": [1.0, 1.0, 0.5],
         "max_step_change": [0.1, 0.1, 0.1]}


def test_a_chunk_with_a_nan_is_refused_and_logged(caplog):
    safety = ActionSafety.from_robot(ROBOT)
    chunk = np.zeros((4, 3), np.float32)
    chunk[2, 1] = np.nan
    with caplog.at_level(logging.WARNING, "dzmodel.serve"), pytest.raises(UnsafeActions, match="rows \\[2\\]"):
        safety.apply(chunk, "s1")
    assert "refused a chunk with non-finite actions (rows [2], dims 1)" in caplog.text
    franka = ActionSafety.from_robot(RobotConfig.from_dict(
        {"robot_ip": "127.0.0.1", "camera_serials": ["a"], "target_ee_pose": [0.5, 0, 0.3, 3.14, 0, 0],
         "workspace_min": [0.2, -0.4, 0.05], "workspace_max": [0.8, 0.4, 0.6]}))
    with pytest.raises(UnsafeActions):  # a Franka bundle: no action limits, but never a NaN
        franka.apply(chunk, "s1")
    chunk[2, 1] = 7.0
    assert np.array_equal(franka.apply(chunk, "s1"), chunk)


def test_actions_are_clipped_to_the_robots_range_with_a_log_line(caplog):
    safety = ActionSafety.from_robot({**ROBOT, "max_step_change": None})
    chunk = np.array([[0.5, -3.0, 0.2], [2.0, 0.0, 0.9]], np.float32)
    with caplog.at_level(logging.WARNING, "dzmodel.serve"):
        out = safety.apply(chunk, "s1")
    assert np.allclose(out, [[0.5, -1.0, 0.2], [1.0, 0.0, 0.5]])
    assert "session s1: clipped 3 of 6 action values to the robot's range (dims 0, 1, 2)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "dzmodel.serve"):
        safety.apply(out, "s1")  # inside the range: nothing changes, nothing logged
    assert caplog.text == ""


def test_change_per_step_is_limited_within_a_chunk_and_stays_in_range(caplog):
    """Rows after the first move at most max_step_change from the row before. A chunk's first row is limited by the
    range alone: clients execute part of a chunk before asking again, so the server does not know where the robot
    is (anchoring to the last row sent made a 7x jump for a client that replans after 8 of 16 rows)."""
    safety = ActionSafety.from_robot(ROBOT)
    with caplog.at_level(logging.WARNING, "dzmodel.serve"):
        out = safety.apply(np.array([[0.0, 0.0, 0.0], [0.05, 0.5, 0.0], [0.05, 0.9, 0.45]], np.float32), "s1")
    assert np.allclose(out, [[0.0, 0.0, 0.0], [0.05, 0.1, 0.0], [0.05, 0.2, 0.1]])
    assert "limited 3 action values to the robot's max_step_change (dims 1, 2)" in caplog.text
    second = safety.apply(np.array([[0.9, 0.9, 0.4]], np.float32), "s1")  # a new chunk: only the range applies
    assert np.allclose(second, [[0.9, 0.9, 0.4]])


@pytest.mark.parametrize("change, message", [
    (dict(max_step_change=[-0.1, 0.1, 0.1]), "max_step_change must be positive"),
    (dict(max_step_change=[0.0, 0.1, 0.1]), "max_step_change must be positive"),
    (dict(action_min=["10", "-1", "0"], action_max=["9", "1", "1"]), "lists of finite numbers"),
    (dict(action_min=[None, -1, 0]), "lists of finite numbers"),
    (dict(action_max=[1.0, float("nan"), 0.5]), "lists of finite numbers"),
    (dict(action_min=[2.0, -1.0, 0.0]), "action_min must be below action_max"),
    (dict(action_dim=True), "action_dim must be a positive integer"),
    (dict(action_dim=4), "has 3 numbers; the action has 4 dims"),
])
def test_a_robot_json_whose_limits_would_not_protect_is_refused(tmp_path, change, message):
    from dzmodel.serve.package import PackageError, _checked_robot

    with pytest.raises(PackageError, match=message):
        _checked_robot({**ROBOT, **change}, tmp_path / "robot.json")
    assert _checked_robot(dict(ROBOT), tmp_path / "robot.json")["name"] == "Unitree G1"


def test_limits_that_do_not_fit_the_model_stop_the_server_before_it_serves():
    """BundlePolicy checks them at start (a ServeError, one line from `dz serve`), not at every request."""
    with pytest.raises(UnsafeActions, match="action_min has 3 numbers, the model predicts 26"):
        ActionSafety.from_robot(ROBOT).check(26)
    ActionSafety.from_robot(ROBOT).check(3)
