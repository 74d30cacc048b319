"""Tiny bundles shared by the serving tests (each built once per test session: a training step, convert, package)."""

import pytest

from .helpers import tiny_bundle


@pytest.fixture(scope="session")
def libero_bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("libero"), "libero_sim_tiny")


@pytest.fixture(scope="session")
def droid_bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("droid"), "oxe_droid_tiny")
