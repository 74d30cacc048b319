"""The scripted expert's grasp yaw, in the real simulator: LIBERO-Spatial task 4's black bowl sits in an open drawer
whose front and back walls leave no room for a finger beside the rim along the reset finger axis (world y), so the
expert turns the hand through the rotation dims of the standard 7-dim action before it grasps. One episode recorded
with `dz data record libero` at 64 px (about 30 s on 2 CPU cores); the libero_spatial profile is libero_object's
recipe on the other suite."""

import json
from pathlib import Path

import numpy as np
import pytest

from dzmodel.cli import main
from dzmodel.config import load_params

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
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from dzmodel.eval.libero_env import check_libero

    check_libero()
    out = tmp_path / "spatial_t4"
    rc = main(["data", "record", "libero", "--suite", "spatial", "--tasks", "4", "--episodes", "1",
               "--image-size", "64", "--workers", "1", "--keep", "all", "--out", str(out), "--no-progress"])
    assert rc == 0
    rec = json.loads((out / "meta" / "dz_recording.json").read_text())
    assert rec["successes"] == 1, rec["failures"]  # the bowl is on the plate within the suite's 220 steps

    from dzmodel.data.lerobot_format import open_dataset

    cols = open_dataset(out).read_columns(0, ["action", "observation.state"])
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
    assert rec.retries == 3 and rec.retry_noise_scale == 0.5 and obj.fetch.record.retries == 0
    assert spatial.train["epochs"] == 15 < obj.train["epochs"]
    assert {**spatial.train, "epochs": obj.train["epochs"]} == obj.train
    assert spatial.vision == obj.vision and spatial.metadata == obj.metadata
    differ = {"suite", "retries", "retry_noise_scale"}
    assert {k: v for k, v in vars(rec).items() if k not in differ} == \
        {k: v for k, v in vars(obj.fetch.record).items() if k not in differ}
    assert spatial.eval.tasks == obj.eval.tasks and spatial.eval.episodes == obj.eval.episodes
    assert spatial.promote.registered_model != obj.promote.registered_model
    assert spatial.package.version != obj.package.version
