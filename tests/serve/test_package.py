"""`dz package`: a verified bundle from a tiny run; tampering, traversal and bad robot configs are refused."""

import io
import json
import tarfile

import pytest

from dzmodel.cli import main
from dzmodel.policy.policy import load_policy
from dzmodel.model.sampler import SolverConfig
from dzmodel.serve.package import PackageError, RobotConfig, build_package, load_package, verify_package
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.train.trainer import train
from tests.tiny_data import make_tabletop_data

ROBOT = {"robot_ip": "172.16.0.2", "camera_serials": ["213522070137", "f1230727"],
         "target_ee_pose": [0.5, 0.0, 0.3, 3.14, 0.0, 0.0], "workspace_min": [0.2, -0.4, 0.05],
         "workspace_max": [0.8, 0.4, 0.6], "control_rate_hz": 15, "gripper_threshold": 0.5}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = make_tabletop_data(tmp_path_factory.mktemp("pkg"), num_episodes=2, episode_length=30)
    train(TrainConfig(preset="tiny", datasets=[str(root / "ds")], embodiment="tabletop_pusher",
                      embodiment_files=[str(root / "emb.yaml")], metadata=str(root / "meta.json"), steps=1,
                      save_every=1, out_dir=str(root / "run"), progress=False))
    hf = convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf")
    (root / "eval").mkdir()
    (root / "eval" / "results.csv").write_text("step,task,task_name,episodes,successes,rate\n1,all,,2,1,0.5\n")
    (root / "robot.json").write_text(json.dumps(ROBOT))
    return root, hf


def test_package_builds_verifies_and_serves_a_policy(model, tmp_path):
    root, hf = model
    assert main(["package", str(hf), "--robot", str(root / "robot.json"), "--version", "1.0.0",
                 "--eval", str(root / "eval"), "--out", str(tmp_path)]) == 0
    bundle = tmp_path / "dreamzero-tabletop_pusher-1.0.0"
    for f in ("model/model.safetensors", "model/encoders/vae.safetensors", "config.json", "metadata.json",
              "embodiment.json", "robot.json", "eval/results.csv", "MODEL_CARD.md", "MANIFEST"):
        assert (bundle / f).is_file(), f
    card = (bundle / "MODEL_CARD.md").read_text()
    assert "| 1 | all | 2 | 1 | 0.5 |" in card and "packaged for a Franka arm" in card
    # a user's embodiment without a robot: block and no site config: what it drives is not known
    with pytest.raises(PackageError, match="has no robot: block.*--embodiments FILE.*for a Franka arm, give its site"):
        build_package(hf, tmp_path / "none", None, "1.0.1")
    assert main(["package", str(hf), "--version", "1.0.2", "--out", str(tmp_path / "none2")]) == 2
    before = sorted(p.name for p in tmp_path.iterdir())
    pkg = load_package(tmp_path / "dreamzero-tabletop_pusher-1.0.0.tar.gz", cache_dir=tmp_path / "cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["cache"])  # nothing beside the tarball
    assert pkg.root.parent.parent == tmp_path / "cache" and pkg.root.name == bundle.name
    assert pkg.robot.robot_ip == "172.16.0.2" and pkg.embodiment["action_horizon"] == 4
    assert pkg.files == len((bundle / "MANIFEST").read_text().splitlines())
    policy = load_policy(pkg.model_dir, solver=SolverConfig(num_steps=1, cfg_scale=1.0))  # self-contained
    assert policy.action_horizon == 4
    # versions are immutable
    with pytest.raises(PackageError, match="already exists"):
        build_package(hf, tmp_path, RobotConfig.from_dict(ROBOT), "1.0.0")


def test_tampered_added_or_missing_files_are_refused(model, tmp_path):
    _, hf = model
    bundle, _ = build_package(hf, tmp_path, RobotConfig.from_dict(ROBOT), "2.0.0")
    assert verify_package(bundle) > 5
    weights = bundle / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(PackageError, match=r"model\.safetensors: checksum mismatch"):
        verify_package(bundle)
    weights.unlink()
    with pytest.raises(PackageError, match="listed in MANIFEST but missing"):
        verify_package(bundle)
    bundle2, _ = build_package(hf, tmp_path, RobotConfig.from_dict(ROBOT), "2.0.1")
    (bundle2 / "extra.py").write_text("print('hi')")
    with pytest.raises(PackageError, match=r"extra\.py: not listed"):
        verify_package(bundle2)


def test_tarball_members_escaping_the_target_are_refused(tmp_path):
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(PackageError, match="escapes"):
        load_package(evil, cache_dir=tmp_path / "x")
    assert not (tmp_path / "escape.txt").exists() and list((tmp_path / "x").iterdir()) == []


@pytest.mark.parametrize("change, field", [
    ({"robot_ip": "300.1.1.1"}, "robot_ip"), ({"camera_serials": []}, "camera_serials"),
    ({"target_ee_pose": [0.5, 0, 0.3]}, "target_ee_pose"), ({"workspace_min": [0.9, -0.4, 0.05]}, "workspace_min"),
    ({"target_ee_pose": [2.0, 0, 0.3, 0, 0, 0]}, "outside the workspace"), ({"control_rate_hz": 0}, "control_rate_hz"),
    ({"gripper_threshold": 1.5}, "gripper_threshold"), ({"speed": 1}, "unknown field"),
    ({"target_ee_pose": [0.5, 0, float("nan"), 0, 0, 0]}, "target_ee_pose"),
])
def test_robot_config_schema(change, field):
    with pytest.raises(PackageError, match=field):
        RobotConfig.from_dict({**ROBOT, **change})


def test_a_built_in_franka_embodiment_asks_for_its_site_config():
    from dzmodel.data.embodiments import get_embodiment
    from dzmodel.serve.package import robot_description

    with pytest.raises(PackageError, match="drives a Franka arm: give its robot config"):
        robot_description(get_embodiment("libero_sim"), None, 7)
    assert robot_description(get_embodiment("libero_sim"), RobotConfig.from_dict(ROBOT), 7).robot_ip == "172.16.0.2"


def test_robot_limits_must_cover_the_models_action_dims():
    """An embodiment whose action keys give no `dim` cannot check its robot limits' length when parsed; packaging
    checks them against the model's action dims."""
    from types import SimpleNamespace

    from dzmodel.data.embodiments import RobotSpec
    from dzmodel.serve.package import robot_description

    spec = RobotSpec("humanoid", "Unitree G1", "joint", "absolute", 50.0, (-1.0,) * 3, (1.0,) * 3)
    emb = SimpleNamespace(tag="g1", robot=spec)
    with pytest.raises(PackageError, match="against the model's 26 action dims, action_min has 3 numbers"):
        robot_description(emb, None, 26)
    assert robot_description(emb, None, 3)["action_dim"] == 3
