"""Restore a converted model directory exported by `libero_scripted_gpu.sh export`: model.bf16.safetensors ->
model.safetensors in fp32 (the weights were rounded to bf16 only for the transfer). Usage:

    cat step_0001000.tar.part-* | tar -x -C runs/libero_scripted/converted
    python docs/archive/results/upcast_model.py runs/libero_scripted/converted/step_0001000
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from dzmodel.model.state_dict import save_safetensors_atomic

for arg in sys.argv[1:]:
    d = Path(arg)
    src = d / "model.bf16.safetensors"
    state = {k: v.to(torch.float32) for k, v in load_file(str(src)).items()}
    save_safetensors_atomic(state, d / "model.safetensors", {"format": "pt"})
    src.unlink()
    print(f"{d}: {len(state)} tensors, fp32")
