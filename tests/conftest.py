"""Shared test fixtures: where the reference fixtures live."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # bundle tarballs extract into a per-run cache, not the user's ~/.cache (subprocess servers inherit it)
    import tempfile

    os.environ.setdefault("DZ_BUNDLE_CACHE", tempfile.mkdtemp(prefix="dz-bundle-cache-"))


def shared_dir() -> Path:
    return Path(os.environ.get("DZ_SHARED_DIR", REPO_ROOT.parent / "shared"))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    path = shared_dir() / "fixtures"
    if not path.is_dir():
        pytest.fail(f"reference fixtures not found at {path}; set DZ_SHARED_DIR to the shared/ folder")
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """One compute thread for a module: small convolutions (the tiny VAE's) run several times faster than on two
    shared cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
