"""Limits for every robot: a Franka bundle of joint-position actions (DROID's) carries the Franka Panda's published
joint limits and the gripper's range, and `dz serve` clips every chunk to them (logged), as it does a humanoid's;
a lab's robot config may tighten them (joint_min, joint_max), never loosen them. A Franka of end-effector actions
(LIBERO's) carries its workspace and no joint limits."""

import gc
import json
import logging

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dzmodel.serve.package import PackageError, RobotConfig, build_package, load_package

from .helpers import ROBOT
from .test_frame_sizes import droid_observation

TOKEN = "franka-token-1"
Q_MIN = [-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973]  # Franka's datasheet, rad
Q_MAX = [2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973]
TIGHT = {"joint_min": [-1.0, *Q_MIN[1:]], "joint_max": [1.0, *Q_MAX[1:]]}   # joint 1 within +-1 rad


def _hf(bundle):
    return bundle.parent.parent / "hf"  # helpers.tiny_bundle: <root>/hf, packaged into <root>/dist


def _served(bundle):
    """The bundle's policy behind `dz serve`'s safety, predicting a chunk with joints out of every range."""
    from dzmodel.policy.policy import load_policy
    from dzmodel.model.sampler import SolverConfig
    from dzmodel.serve.safety import ActionSafety
    from dzmodel.serve.server import BundlePolicy

    pkg = load_package(bundle)
    policy = BundlePolicy(load_policy(pkg.model_dir, solver=SolverConfig(num_steps=1, cfg_scale=1.0)),
                          safety=ActionSafety.from_robot(pkg.robot))
    chunk = np.zeros((24, 8), np.float32)
    chunk[:, 0], chunk[:, 3], chunk[:, 5], chunk[:, 7] = 3.5, 0.4, -0.5, 1.6  # above, above, below, gripper above
    policy.embodied.predict = lambda *args, **kwargs: chunk.copy()
    return policy


def _infer(policy):
    from dzmodel.serve.server import ServerThread

    with ServerThread(policy, TOKEN) as srv:
        return WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN).infer(droid_observation((180, 320)))


def test_a_droid_bundle_carries_the_franka_panda_joint_limits(droid_bundle):
    pkg = load_package(droid_bundle)
    robot = json.loads((pkg.root / "robot.json").read_text())
    assert robot["action_space"] == "joint"
    assert robot["action_min"] == Q_MIN + [0.0] and robot["action_max"] == Q_MAX + [1.0]  # gripper 0 open .. 1 closed
    assert pkg.robot.action_min == tuple(Q_MIN + [0.0])
    assert "every action is clipped to [-2.8973, -1.7628" in (pkg.root / "MODEL_CARD.md").read_text()


def test_served_chunks_are_clipped_to_the_franka_limits_and_logged(droid_bundle, caplog):
    with caplog.at_level(logging.WARNING, "dzmodel.serve"):
        actions = _infer(_served(droid_bundle))["actions"]
    assert actions.shape == (24, 8)
    np.testing.assert_allclose(actions[0], [Q_MAX[0], 0, 0, Q_MAX[3], 0, Q_MIN[5], 0, 1.0], rtol=1e-6)
    assert "clipped 96 of 192 action values to the robot's range (dims 0, 3, 5, 7)" in caplog.text


def test_dz_serve_enforces_the_bundles_franka_limits(droid_bundle, monkeypatch):
    from dzmodel.serve import server

    served = []
    monkeypatch.setattr(server, "run_server", lambda srv, *args, **kwargs: served.append(srv))
    monkeypatch.setattr(server, "configure_logging", lambda: None)  # leave the log to pytest's capture
    try:
        server.serve_bundle(str(droid_bundle), TOKEN, port=0)
    finally:
        gc.unfreeze()
    safety = served[0].policy.safety
    assert list(safety.action_max) == pytest.approx(Q_MAX + [1.0])
    assert safety.describe() == "non-finite chunks refused, actions clipped to the robot's range (8 dims)"


def test_a_franka_bundle_packaged_without_the_limits_is_served_with_them(droid_bundle, tmp_path, monkeypatch, caplog):
    """A DROID bundle whose robot.json predates the limits: `dz serve` takes them from its embodiment."""
    import shutil

    from dzmodel.serve import server
    from dzmodel.serve.package import MANIFEST, _manifest_lines

    old = tmp_path / "dreamzero-oxe_droid_tiny-0.0.9"
    shutil.copytree(load_package(droid_bundle).root, old)
    site = {k: v for k, v in json.loads((old / "robot.json").read_text()).items() if k in ROBOT}
    (old / "robot.json").write_text(json.dumps(site))
    (old / MANIFEST).write_text("\n".join(_manifest_lines(old)) + "\n")
    served = []
    monkeypatch.setattr(server, "run_server", lambda srv, *args, **kwargs: served.append(srv))
    monkeypatch.setattr(server, "configure_logging", lambda: None)
    try:
        with caplog.at_level(logging.INFO, "dzmodel.serve"):
            server.serve_bundle(str(old), TOKEN, port=0)
    finally:
        gc.unfreeze()
    assert list(served[0].policy.safety.action_min) == pytest.approx(Q_MIN + [0.0])
    assert "was packaged without its Franka's joint limits; serving with the Franka Panda's" in caplog.text


def test_a_tightened_robot_config_clips_tighter(droid_bundle, tmp_path, caplog):
    _, tarball = build_package(_hf(droid_bundle), tmp_path, RobotConfig.from_dict({**ROBOT, **TIGHT}), "0.2.0")
    assert "the robot config's joint_min/joint_max" in (tmp_path / "dreamzero-oxe_droid_tiny-0.2.0" /
                                                       "MODEL_CARD.md").read_text()
    with caplog.at_level(logging.WARNING, "dzmodel.serve"):
        actions = _infer(_served(tarball))["actions"]
    assert actions[0, 0] == pytest.approx(1.0) and actions[0, 3] == pytest.approx(Q_MAX[3])
    assert "to the robot's range" in caplog.text


@pytest.mark.parametrize("change, error", [
    ({"joint_max": [*Q_MAX[:3], 0.1, *Q_MAX[4:]]},
     r"joint_max\[3\] = 0.1 is above the Franka Panda's published limit -0.0698 rad; .* not loosen them"),
    ({"joint_min": [-3.0, *Q_MIN[1:]]}, r"joint_min\[0\] = -3 is below the Franka Panda's published limit -2.8973"),
    ({"joint_min": [0.5, *Q_MIN[1:]], "joint_max": [0.4, *Q_MAX[1:]]}, r"joint_min\[0\] = 0.5 must be below"),
    ({"joint_min": Q_MIN[:6]}, "must be 7 numbers"),
    ({"joint_min": [*Q_MIN[:6], "x"]}, "joint_min must be a list of finite numbers"),
])
def test_a_robot_config_may_tighten_the_joint_limits_never_loosen_them(change, error):
    with pytest.raises(PackageError, match=error):
        RobotConfig.from_dict({**ROBOT, **TIGHT, **change}, "robot.yaml")
    with pytest.raises(PackageError, match="joint_min and joint_max come together"):
        RobotConfig.from_dict({**ROBOT, "joint_min": Q_MIN}, "robot.yaml")


def test_an_end_effector_bundle_carries_its_workspace_and_no_joint_limits(libero_bundle, tmp_path):
    pkg = load_package(libero_bundle)
    assert pkg.robot.action_space == "end_effector" and pkg.robot.action_min is None
    assert pkg.robot.workspace_min == tuple(ROBOT["workspace_min"])
    with pytest.raises(PackageError, match="joint_min and joint_max apply to joint-position actions; embodiment "
                                           "'libero_sim_tiny' sends end-effector actions"):
        build_package(_hf(libero_bundle), tmp_path, RobotConfig.from_dict({**ROBOT, **TIGHT}), "0.2.0")
