"""docs/deploy.md and docs/protocol.md against the code: the DROID bundle path that the `droid` profile's package
stage really writes, and the camera-frame and Franka limits as `dz serve` enforces them."""

import glob
import re
from pathlib import Path

from dzmodel.config import load_params
from dzmodel.serve import franka
from dzmodel.serve.protocol import CAMERA_PIXELS
from dzmodel.stage_paths import StagePaths
from dzmodel.stages.package import package_version

ROOT = Path(__file__).resolve().parents[2]
DEPLOY, PROTOCOL = (ROOT / "docs" / "deploy.md").read_text(), (ROOT / "docs" / "protocol.md").read_text()


def test_the_droid_bundle_path_in_the_docs_matches_what_the_droid_profile_writes(tmp_path):
    prof = load_params(ROOT / "params.yaml").profiles["droid"]
    name = prof.package.name or f"dreamzero-{prof.metadata.embodiment}"  # as build_package names it
    version = package_version(prof.package.version, "ab" * 32, None, prof.package.robot, prof.train["steps"])
    tarball = tmp_path / StagePaths(Path("."), "droid").stage("package") / f"{name}-{version}.tar.gz"
    tarball.parent.mkdir(parents=True)
    tarball.touch()
    (tarball.parent / f"{name}-{version}").mkdir()  # the bundle directory beside it
    patterns = re.findall(r"dz serve (runs/droid/\S+)", DEPLOY)
    assert patterns
    for pattern in patterns:
        assert glob.glob(str(tmp_path / pattern)) == [str(tarball)], pattern


def test_the_docs_state_the_camera_cap_and_the_franka_limits_the_code_enforces():
    assert "8..1024" not in PROTOCOL and "--max-image-pixels" in PROTOCOL and "--max-image-pixels" in DEPLOY
    assert f"{CAMERA_PIXELS:,}" in PROTOCOL and f"{CAMERA_PIXELS:,}" in DEPLOY
    row = lambda values: " | ".join(f"{v:g}" for v in values)  # noqa: E731
    assert row(franka.JOINT_MIN) in DEPLOY and row(franka.JOINT_MAX) in DEPLOY
    assert "only\nchecked for NaN" not in DEPLOY and "joint_min" in DEPLOY
