"""A humanoid end to end, as a lab adds one: a Unitree G1-shaped dataset (one head camera, 26 joint positions as
state and absolute joint targets as action) goes `dz embodiment init` -> (the lab's review narrows the drafted
robot: block's limits) -> `dz data check` -> `dz data metadata` -> train -> convert -> `dz package` (no Franka
config) -> serve, and openpi's client gets (chunk, 26) actions inside the robot's limits, the clipping logged."""

import json
import logging
import re

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dzmodel.cli import main
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.serve.package import PackageError, RobotConfig, build_package, load_package
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.train.trainer import train

from .helpers import ROBOT as FRANKA

TOKEN = "humanoid-token-1"
LIMIT = 0.05  # narrower than what the barely trained model predicts: every chunk gets clipped

ROBOT_BLOCK = f"""  robot:
    kind: humanoid
    name: Unitree G1
    action_space: joint
    action_mode: absolute
    control_rate_hz: 50
    action_min: {-LIMIT}
    action_max: {LIMIT}
    max_step_change: 0.5
"""


@pytest.fixture(scope="module")
def g1(tmp_path_factory):
    root = tmp_path_factory.mktemp("g1")
    ds = make_synthetic_dataset(root / "g1_walk", num_episodes=2, episode_length=60, codec="libx264",
                                embodiment="unitree_g1")
    yaml_file = root / "g1.yaml"
    assert main(["embodiment", "init", str(ds), "--out", str(yaml_file), "--tag", "g1", "--action-horizon",
                 "16"]) == 0
    drafted = yaml_file.read_text()
    assert "\n  robot:\n    kind: humanoid\n" in drafted  # drafted as a humanoid, with the data's range
    # the lab's review: what robot, what limits
    yaml_file.write_text(re.sub(r"  robot:\n(    .*\n)+", lambda _: ROBOT_BLOCK, drafted))
    assert main(["data", "check", str(ds), "--embodiment", "g1", "--embodiments", str(yaml_file), "--chunks",
                 "2"]) == 0
    assert main(["data", "metadata", str(ds), "--embodiment", "g1", "--embodiments", str(yaml_file), "--out",
                 str(root / "meta.json")]) == 0
    train(TrainConfig(preset="tiny", model_overrides={"num_action_per_block": 16}, datasets=[str(ds)],
                      embodiment="g1", embodiment_files=[str(yaml_file)], metadata=str(root / "meta.json"),
                      steps=1, save_every=1, out_dir=str(root / "run"), progress=False))
    return convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf"), root


def test_the_humanoid_bundle_describes_the_robot_not_a_franka(g1):
    model, root = g1
    assert main(["package", str(model), "--version", "0.1.0", "--out", str(root / "dist")]) == 0
    bundle = root / "dist" / "dreamzero-g1-0.1.0"
    card = (bundle / "MODEL_CARD.md").read_text()
    assert "packaged for a Unitree G1" in card and "Franka" not in card
    assert "26 joint-space actions, absolute, at 50 Hz" in card
    robot = json.loads((bundle / "robot.json").read_text())
    assert robot["kind"] == "humanoid" and robot["action_dim"] == 26 and robot["action_min"] == [-LIMIT] * 26
    assert isinstance(load_package(bundle).robot, dict)
    # a Franka site config does not apply to it, and a Franka embodiment still needs one
    with pytest.raises(PackageError, match="drives a humanoid \\(Unitree G1\\).*does not apply"):
        build_package(model, root / "dist2", RobotConfig.from_dict(FRANKA), "0.1.0")


def test_openpi_client_gets_26_dim_chunks_inside_the_limits_and_the_clipping_is_logged(g1, caplog):
    from dzmodel.policy.policy import load_policy
    from dzmodel.model.sampler import SolverConfig
    from dzmodel.serve.safety import ActionSafety
    from dzmodel.serve.server import BundlePolicy, ServerThread

    model, root = g1
    _, tarball = build_package(model, root / "dist3", None, "0.2.0")
    pkg = load_package(tarball)
    policy = BundlePolicy(load_policy(pkg.model_dir, solver=SolverConfig(num_steps=2, cfg_scale=1.0)),
                          safety=ActionSafety.from_robot(pkg.robot))
    rng = np.random.default_rng(0)
    obs = {"observation/head": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
           "observation/state": np.zeros(26), "prompt": "walk to the red block"}
    with caplog.at_level(logging.WARNING, "dzmodel.serve"), ServerThread(policy, TOKEN) as srv:
        client = WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN)
        assert client.get_server_metadata()["action_dim"] == 26
        actions = client.infer(obs)["actions"]
    assert actions.shape == (16, 26) and np.isfinite(actions).all()
    assert np.abs(actions).max() <= LIMIT + 1e-7
    assert "clipped" in caplog.text and "to the robot's range" in caplog.text
