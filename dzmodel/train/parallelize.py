"""Parallelism applied from outside the model (torchtitan style): FSDP2, activation checkpointing, compile.

FSDP2 (`fully_shard`) wraps every transformer block, then the root. Parameters stay fp32 (master weights
and Adam state); `MixedPrecisionPolicy` casts them to the compute dtype for forward/backward and reduces
gradients in `reduce_dtype`. `hybrid` shards within a node and replicates across nodes (a 2D mesh).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """none: keep all activations; full: recompute every block; selective: every other block.
    The block's forward is wrapped in place, so module names and state-dict keys do not change."""
    if mode == "none":
        return
    for i, block in enumerate(model.blocks):
        if mode == "full" or (mode == "selective" and i % 2 == 0):
            block.forward = functools.partial(_checkpointed_forward, block.forward)  # keeps module names/keys


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_compile(model: nn.Module) -> None:
    """Compile each block's forward (fuses the fp32 norm / modulate / gate-residual elementwise chains).

    Call BEFORE apply_activation_checkpointing: the checkpoint then wraps (and recomputes) the compiled
    forward. Compiling a checkpoint-wrapped forward instead graph-breaks and silently runs eager."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward)


def apply_fsdp(model: nn.Module, sharding: str = "full", param_dtype: str = "fp32", reduce_dtype: str = "fp32",
               device_type: str = "cpu") -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    mesh = None
    if sharding == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        local = int(torch.cuda.device_count()) if device_type == "cuda" else world
        local = max(1, min(local, world))
        if world % local:
            raise ValueError(f"hybrid sharding needs world size {world} divisible by GPUs per node {local}")
        mesh = init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
