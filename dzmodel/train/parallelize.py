"""Parallelism applied from outside the model (torchtitan style): FSDP2, activation recompute, compile.

FSDP2 (`fully_shard`) wraps every transformer block, then the root. Parameters stay fp32 (master weights
and Adam state); `MixedPrecisionPolicy` casts them to the compute dtype for forward/backward and reduces
gradients in `reduce_dtype`. `hybrid` shards within a node and replicates across nodes (a 2D mesh).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16,
          "fp8": torch.bfloat16}  # fp8: the blocks' linears run FP8 matmuls (model/fp8.py), everything else bf16


AC_MODES = ("none", "elementwise", "selective", "full")


# `train.fp8_keep_inputs: wide` keeps the e4m3 inputs at least this wide: the FFN's down projection's (14336 in
# the 5B, 13824 in the 14B), the largest and the costliest to recompute (its GELU), not the hidden-wide ones
WIDE_FP8_INPUT = 8192


def _recompute_elementwise_policy(keep_fp8_inputs: bool | str = False):
    """Keep the outputs of matmuls and attention kernels; recompute everything else (norms, modulation,
    RoPE, GELU, gates, casts) in backward, where it fuses into the backward kernels.
    keep_fp8_inputs: keep the FP8 linears' e4m3 inputs and their absolute maxima too (`train.fp8_keep_inputs`):
    1 byte per element of each such linear's input, for not reading its bf16 input twice more in the backward
    (the maximum, then the cast); "wide": only the inputs at least WIDE_FP8_INPUT wide (and every maximum, a
    scalar). The weights' e4m3 copies are not kept (fp8.py rounds them by a copy, not a cast): the backward
    rounds the weight again, as FSDP2 frees it between forward and backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    from ..model.fp8 import E4M3

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    if hasattr(aten, "_scaled_mm"):  # the FP8 linears' matmuls (train.precision: fp8)
        keep.add(aten._scaled_mm.default)
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            keep.add(getattr(aten, name).default)
    if hasattr(torch.ops.higher_order, "flex_attention"):
        keep.add(torch.ops.higher_order.flex_attention)

    linears = {aten.mm.default: 0, aten.addmm.default: 1}  # where the (left, right) operands start

    def fp8_input(op, args, kwargs) -> bool:
        if op is aten._to_copy.default:
            return kwargs.get("dtype") == E4M3 and (keep_fp8_inputs is True or args[0].shape[-1] >= WIDE_FP8_INPUT)
        return op is aten.amax.default and (len(args) < 2 or not args[1])  # the whole tensor's: a scalar

    def policy(ctx, op, *args, **kwargs):
        if op in linears and up_projection(*args[linears[op]:linears[op] + 2]):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if keep_fp8_inputs and fp8_input(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


LOW_RANK = 256


def up_projection(left: torch.Tensor, right: torch.Tensor) -> bool:
    """A low-rank up-projection [T, r] x [r, N] (r <= LOW_RANK, N >= 8r): LoRA's B. Its output is as large as
    the layer's but costs r/in of its FLOPs: recompute it rather than keep a second full-size output per adapted
    linear (which pushed 5B LoRA at micro-batch 16 out of an H100's memory)."""
    r = left.shape[-1]
    return r <= LOW_RANK and right.shape[-1] >= 8 * r


def _elementwise_checkpointed(forward, *args, keep_fp8_inputs: bool | str = False, **kwargs):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context = functools.partial(create_selective_checkpoint_contexts, _recompute_elementwise_policy(keep_fp8_inputs))
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def block_recompute_plan(mode: str, num_blocks: int) -> list[str]:
    """Per block: "none", "elementwise" or "full". Modes:
      none         keep every activation
      elementwise  keep matmul and attention outputs, recompute the elementwise work (per-op selective
                   checkpointing). No matmul is recomputed; a block's saved activations drop ~2.5x.
      selective    recompute every other block in full, keep the rest
      full         recompute every block in full
      full:N       recompute N evenly spaced blocks in full and the others elementwise (for models whose
                   elementwise activations do not fit, e.g. 14B at L = 15,940)
    """
    if mode.startswith("full:"):
        count = mode.split(":", 1)[1]
        if not count.isdigit() or int(count) > num_blocks:
            raise ValueError(f"activation checkpointing {mode!r}: N in full:N must be an integer in [0, {num_blocks}]")
        n = int(count)
        full = {int(i * num_blocks / n) for i in range(n)} if n else set()
        return ["full" if i in full else "elementwise" for i in range(num_blocks)]
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing must be one of {', '.join(AC_MODES)} or full:N, got {mode!r}")
    if mode == "selective":
        return ["full" if i % 2 == 0 else "none" for i in range(num_blocks)]
    return [mode] * num_blocks


# What `train.compile` compiles: each block on its own, or the step's whole forward and loss as one graph
# (`TrainStep.compile`; the blocks are then traced inline and get recompute only here)
COMPILE_SCOPES = ("blocks", "step")


def apply_recompute_and_compile(model: nn.Module, mode: str, compile: bool, cuda_graphs: bool = False,
                                compile_options: dict | None = None, scope: str = "blocks",
                                keep_fp8_inputs: bool | str = False) -> None:
    """Activation recompute per block (see `block_recompute_plan`), and optionally `torch.compile` of each
    block's forward, with `cuda_graphs` in reduce-overhead mode (each compiled forward and backward replayed as a
    CUDA graph; on CUDA only) and `compile_options` (Inductor settings, `train.compile_options`). The forward is
    replaced in place, so module names and state-dict keys do not change. scope "step": the blocks get their
    recompute and Inductor's settings for this model, and are compiled as part of the step (`TrainStep.compile`).
    keep_fp8_inputs: elementwise recompute keeps the FP8 linears' e4m3 inputs (`_recompute_elementwise_policy`).

    Order matters. The elementwise policy must sit inside the compiled region, so the compiler sees it.
    A whole-block checkpoint must wrap the compiled forward: compiling a checkpoint-wrapped forward
    graph-breaks and silently runs eager.
    """
    if cuda_graphs and not compile:
        raise ValueError("CUDA graphs capture the compiled blocks: they need compile")
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope must be one of {COMPILE_SCOPES}, got {scope!r}")
    compile_blocks = compile and scope == "blocks"
    if compile:
        from ..model.compile_compat import allow_bare_cantsplit, single_tile_dimension

        allow_bare_cantsplit()  # torch 2.11: the small preset's blocks fail to compile without it
        single_tile_dimension()  # ... and their backward computes wrong gradients at micro-batch 128 without this
    for block, plan in zip(model.blocks, block_recompute_plan(mode, len(model.blocks))):
        forward = block.forward
        if plan == "elementwise":
            forward = functools.partial(_elementwise_checkpointed, forward, keep_fp8_inputs=keep_fp8_inputs)
        if compile_blocks:
            block._dz_eager_forward = forward  # kept for `eager_blocks` (the trainer's compile check)
            forward = torch.compile(forward, **compile_kwargs(cuda_graphs, compile_options))
        if plan == "full":
            forward = functools.partial(_checkpointed_forward, forward)
            if compile_blocks:
                block._dz_eager_forward = functools.partial(_checkpointed_forward, block._dz_eager_forward)
        block.forward = forward


def compile_kwargs(cuda_graphs: bool, options: dict | None) -> dict:
    """torch.compile's arguments: reduce-overhead mode for CUDA graphs, which is Inductor's `triton.cudagraphs`
    setting; with other settings they all go in `options` (torch.compile takes a mode or options, not both)."""
    if not options:
        return {"mode": "reduce-overhead"} if cuda_graphs else {}
    return {"options": {**options, **({"triton.cudagraphs": True} if cuda_graphs else {})}}


@contextlib.contextmanager
def eager_blocks(model: nn.Module):
    """Within: the blocks that `apply_recompute_and_compile` compiled run their eager forward (same recompute)."""
    swapped = [(b, b.forward) for b in model.blocks if hasattr(b, "_dz_eager_forward")]
    try:
        for block, _ in swapped:
            block.forward = block._dz_eager_forward
        yield len(swapped)
    finally:
        for block, forward in swapped:
            block.forward = forward


def apply_fsdp(model: nn.Module, sharding: str = "full", param_dtype: str = "fp32", reduce_dtype: str = "fp32",
               device_type: str = "cpu") -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # cast_forward_inputs=False: FSDP's default would round every floating input to param_dtype. That turns the
    # fp32 timesteps (spacing 4 near t = 1000 in bf16) and the fp32 per-token modulation e0 into bf16, and adds
    # a cast per block in forward and a cast back in backward. The model casts its inputs to its weights' dtype
    # itself where a matmul needs it.
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype],
                              cast_forward_inputs=False)
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


def build_adamw(params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                device_type: str = "cpu") -> torch.optim.AdamW:
    """AdamW with fp32 state. On CUDA the fused kernel, also for FSDP2's DTensor parameters: the default there
    is a per-parameter loop (8 kernels and a DTensor dispatch per parameter per step)."""
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=device_type == "cuda" or None)
