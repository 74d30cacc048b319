"""The trainer tests' dataset: a tiny generated LeRobot dataset with its embodiment, metadata and tokenizer."""

import pytest

from tests.tiny_data import make_tabletop_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tabletop_data(tmp_path_factory.mktemp("train"))
