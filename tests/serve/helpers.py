"""Tiny servable bundles for the serving tests: a synthetic dataset of an embodiment, one training step of the
tiny preset, `dz convert` and `dz package` (the same path as the pipeline's package stage)."""

from pathlib import Path

from dzmodel.data.dataset import embodiment_metadata
from dzmodel.data.embodiments import get_embodiment
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.serve.package import RobotConfig, build_package
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.train.trainer import train

ROBOT = {"robot_ip": "127.0.0.1", "camera_serials": ["sim-agentview", "sim-wrist"],
         "target_ee_pose": [0.0, 0.0, 1.0, 3.14, 0.0, 0.0], "workspace_min": [-1, -1, 0], "workspace_max": [1, 1, 2]}
# the tiny preset predicts the embodiment's chunk length
HORIZON = {"libero_sim_tiny": 16, "oxe_droid_tiny": 24}


def tiny_bundle(root: Path, embodiment: str) -> Path:
    """A packaged tiny policy for `embodiment` (libero_sim_tiny or oxe_droid_tiny); returns the tarball."""
    synth = "oxe_droid" if embodiment.startswith("oxe_droid") else "libero_sim"
    ds = make_synthetic_dataset(root / "ds", num_episodes=2, episode_length=60, codec="libx264", embodiment=synth)
    embodiment_metadata(ds, get_embodiment(embodiment), root / "meta.json")
    train(TrainConfig(preset="tiny", model_overrides={"num_action_per_block": HORIZON[embodiment]}, datasets=[str(ds)],
                      embodiment=embodiment, metadata=str(root / "meta.json"), steps=1, save_every=1,
                      out_dir=str(root / "run"), progress=False))
    hf = convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf")
    _, tarball = build_package(hf, root / "dist", RobotConfig.from_dict(ROBOT), "0.1.0")
    return tarball


def served_policy(tarball: Path, **load_kwargs):
    """A bundle's policy as `dz serve` serves it, with a 2-step solver without CFG (fast on CPU)."""
    from dzmodel.policy.policy import load_policy
    from dzmodel.model.sampler import SolverConfig
    from dzmodel.serve.package import load_package
    from dzmodel.serve.server import BundlePolicy

    pkg = load_package(tarball)
    return BundlePolicy(load_policy(pkg.model_dir, solver=SolverConfig(num_steps=2, cfg_scale=1.0), **load_kwargs))
