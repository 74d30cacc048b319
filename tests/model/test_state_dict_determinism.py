"""The same tensors and metadata give the same safetensors bytes every time they are written (a bundle packaged
twice must not look like another policy to the registry)."""

import hashlib

import torch
from safetensors.torch import load_file

from dzmodel.model.state_dict import save_safetensors_atomic


def test_the_same_tensors_give_the_same_file(tmp_path):
    tensors = {"b.weight": torch.arange(6.0).reshape(2, 3), "a.bias": torch.ones(4, dtype=torch.bfloat16)}
    meta = {"format": "pt", "module": "vae", "zeta": "1", "alpha": "2"}
    digests = set()
    for i in range(12):
        path = tmp_path / f"w{i}.safetensors"
        save_safetensors_atomic(tensors, path, meta)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1
    loaded = load_file(str(tmp_path / "w0.safetensors"))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
