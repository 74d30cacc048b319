"""A new robot from the documentation alone: a humanoid's dataset goes `dz embodiment init --preset tiny` ->
`dz data check` -> `dz data metadata` -> `dz train --config` (relative paths) -> `dz convert` -> `dz package
--embodiments` with the draft as written, and the bundle's robot.json names the joints beside their limits. A robot:
block added after training is packaged with --embodiments; a humanoid without one is told to add it, not asked for a
Franka's fields."""

import json
import re
import shutil

import pytest

from dzmodel.cli import main
from dzmodel.data.embodiments import load_embodiments
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.serve.package import PackageError, build_package, load_package

JOINTS = [f"joint_{i}" for i in range(26)]
CONFIG = """preset: tiny
datasets: [g1_walk]
embodiment: g1
embodiment_files: [g1.yaml]
metadata: meta.json
steps: 2
save_every: 2
out_dir: runs/g1
progress: false
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The documented path, run from the project folder; returns (project folder, converted model)."""
    root = tmp_path_factory.mktemp("new_robot")
    make_synthetic_dataset(root / "g1_walk", num_episodes=2, episode_length=40, codec="libx264",
                           embodiment="unitree_g1")
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    try:
        assert main(["embodiment", "init", "g1_walk", "--preset", "tiny", "--tag", "g1", "--out", "g1.yaml"]) == 0
        assert main(["data", "check", "g1_walk", "--embodiment", "g1", "--embodiments", "g1.yaml"]) == 0
        assert main(["data", "metadata", "g1_walk", "--embodiment", "g1", "--embodiments", "g1.yaml", "--out",
                     "meta.json"]) == 0
        (root / "cfg.yaml").write_text(CONFIG)
        assert main(["train", "--config", "cfg.yaml"]) == 0
    finally:
        mp.undo()
    assert main(["convert", str(root / "runs" / "g1"), "--out", str(root / "hf")]) == 0  # from elsewhere
    return root, root / "hf"


def test_the_drafted_humanoid_packages_as_drafted_with_named_joints_and_limits(project, tmp_path):
    root, hf = project
    draft = load_embodiments([root / "g1.yaml"])["g1"].robot
    assert draft.kind == "humanoid"
    assert main(["package", str(hf), "--embodiments", str(root / "g1.yaml"), "--version", "0.1.0", "--out",
                 str(tmp_path / "dist")]) == 0
    bundle = tmp_path / "dist" / "dreamzero-g1-0.1.0"
    robot = json.loads((bundle / "robot.json").read_text())
    assert robot["kind"] == "humanoid" and robot["action_dim"] == 26 and robot["joint_names"] == JOINTS
    assert robot["action_min"] == list(draft.action_min) and robot["action_max"] == list(draft.action_max)
    pkg = load_package(bundle)
    assert pkg.robot["joint_names"] == JOINTS
    card = (bundle / "MODEL_CARD.md").read_text()
    assert "Franka" not in card and "joint_0" in card


@pytest.fixture
def trained_without_robot(project, tmp_path):
    """The converted model of a run whose embodiment had no robot: block (trained before it was added)."""
    root, hf = project
    copy = tmp_path / "hf_no_robot"
    shutil.copytree(hf, copy)
    emb_file = next((copy / "experiment_cfg" / "embodiments").glob("*.yaml"))
    text = emb_file.read_text()
    emb_file.write_text(re.sub(r"\n  robot:\n(    .*\n)+", "\n", text))
    assert load_embodiments([emb_file])["g1"].robot is None
    return copy, emb_file


def test_a_humanoid_without_a_robot_block_is_told_to_add_one_not_asked_for_franka_fields(trained_without_robot,
                                                                                       tmp_path, capsys):
    model, emb_file = trained_without_robot
    assert main(["package", str(model), "--version", "0.1.0", "--out", str(tmp_path / "dist")]) == 2
    err = capsys.readouterr().err
    assert "robot:" in err and "--embodiments" in err and emb_file.name in err
    assert "robot_ip" not in err and "Franka" not in err.split("for a Franka")[0]


def test_a_robot_block_added_after_training_is_packaged_with_embodiments(project, trained_without_robot, tmp_path):
    root, _ = project
    model, _ = trained_without_robot
    bundle, _ = build_package(model, tmp_path / "dist", None, "0.2.0", embodiment_files=[root / "g1.yaml"])
    robot = json.loads((bundle / "robot.json").read_text())
    assert robot["kind"] == "humanoid" and robot["joint_names"] == JOINTS
    # the bundle's model carries the reviewed definition, so `dz serve` loads the embodiment it was packaged with
    from dzmodel.policy.policy import model_embodiment, read_train_config

    served = model_embodiment(bundle / "model", read_train_config(bundle / "model")[0])
    assert served.robot is not None and served.robot.kind == "humanoid"


def test_embodiments_may_change_only_the_robot_and_serve_blocks(project, tmp_path):
    root, hf = project
    changed = tmp_path / "g1_h8.yaml"
    changed.write_text((root / "g1.yaml").read_text().replace("action_horizon: 4", "action_horizon: 8"))
    with pytest.raises(PackageError, match="action_horizon.*8.*trained with 4"):
        build_package(hf, tmp_path / "dist", None, "0.1.0", embodiment_files=[changed])
    assert not (tmp_path / "dist" / "dreamzero-g1-0.1.0").exists()
