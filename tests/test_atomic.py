import os
import stat

import pytest
import torch

from dzmodel.atomic import NEW_FILE_MODE, atomic_write_text
from dzmodel.model.state_dict import save_safetensors_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_file_mode_follows_the_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    assert NEW_FILE_MODE == 0o666 & ~mask


def test_atomic_text_is_readable_like_a_plain_file(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_text(tmp_path / "out.json", "{}")
    assert (tmp_path / "out.json").read_text() == "{}"
    assert _mode(tmp_path / "out.json") == _mode(plain) == NEW_FILE_MODE  # not mkstemp's 0600


def test_atomic_safetensors_is_readable_like_a_plain_file(tmp_path):
    save_safetensors_atomic({"w": torch.zeros(2)}, tmp_path / "m.safetensors", {"format": "pt"})
    assert _mode(tmp_path / "m.safetensors") == NEW_FILE_MODE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "m.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(Exception):
        save_safetensors_atomic({"w": "not a tensor"}, target, {"format": "pt"})
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
