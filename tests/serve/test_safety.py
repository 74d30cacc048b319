"""The limits `dz serve` puts on every chunk (dzmodel/serve/safety.py): NaN refused, range clipped, change per
step limited across chunks, each logged."""

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
        safety.apply(chunk, None, "s1")
    assert "refused a chunk with non-finite actions (rows [2], dims 1)" in caplog.text
    franka = ActionSafety.from_robot(RobotConfig.from_dict(
        {"robot_ip": "127.0.0.1", "camera_serials": ["a"], "target_ee_pose": [0.5, 0, 0.3, 3.14, 0, 0],
         "workspace_min": [0.2, -0.4, 0.05], "workspace_max": [0.8, 0.4, 0.6]}))
    with pytest.raises(UnsafeActions):  # a Franka bundle: no action limits, but never a NaN
        franka.apply(chunk, None, "s1")
    chunk[2, 1] = 7.0
    assert np.array_equal(franka.apply(chunk, None, "s1"), chunk)


def test_actions_are_clipped_to_the_robots_range_with_a_log_line(caplog):
    safety = ActionSafety.from_robot({**ROBOT, "max_step_change": None})
    chunk = np.array([[0.5, -3.0, 0.2], [2.0, 0.0, 0.9]], np.float32)
    with caplog.at_level(logging.WARNING, "dzmodel.serve"):
        out = safety.apply(chunk, None, "s1")
    assert np.allclose(out, [[0.5, -1.0, 0.2], [1.0, 0.0, 0.5]])
    assert "session s1: clipped 3 of 6 action values to the robot's range (dims 0, 1, 2)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "dzmodel.serve"):
        safety.apply(out, None, "s1")  # inside the range: nothing changes, nothing logged
    assert caplog.text == ""


def test_change_per_step_is_limited_across_chunks_of_a_session(caplog):
    safety = ActionSafety.from_robot(ROBOT)
    first = safety.apply(np.array([[0.0, 0.0, 0.0], [0.05, 0.5, 0.0]], np.float32), None, "s1")
    assert np.allclose(first, [[0.0, 0.0, 0.0], [0.05, 0.1, 0.0]])
    with caplog.at_level(logging.WARNING, "dzmodel.serve"):
        second = safety.apply(np.array([[0.05, 0.9, 0.0]], np.float32), first[-1], "s1")
    assert np.allclose(second, [[0.05, 0.2, 0.0]])  # from the last action sent, not from the new chunk
    assert "limited 1 action values to the robot's max_step_change (dims 1)" in caplog.text
    assert np.allclose(np.diff(np.concatenate([first, second]), axis=0).max(), 0.1)
