"""Weight stacks for inference: the Linears that run as one matmul (`wan_dit.project_together`: a self-attention's
q, k and v; a cross-attention's k and v, k_img and v_img) get their weights and biases as views of one tensor, kept
as a non-persistent buffer of their attention module. A forward without autograd then reads the stack as it is,
instead of concatenating the weights at every call (a 5B layer's q, k and v: 56 MB a forward, a tenth of a batch-1
chunk's GPU time). Values, parameters and state_dict keys stay; no memory is added while the weights are views."""

from __future__ import annotations

import torch
from torch import nn

SUFFIX = "_stack"  # buffer names: "<names joined by _>_weight_stack" and "..._bias_stack"


def stack_names(names: tuple[str, ...]) -> tuple[str, str]:
    key = "_".join(names)
    return f"{key}_weight{SUFFIX}", f"{key}_bias{SUFFIX}"


def share_weight_stacks(model: nn.Module) -> int:
    """Stack each group of a module's `stacked_projections` (plain Linears with biases), once; returns how many.
    The module's `.to()` then converts the stack with the weights (their values stay equal)."""
    made = 0
    for module in model.modules():
        for names in getattr(type(module), "stacked_projections", ()):
            weight_name, bias_name = stack_names(names)
            linears = [getattr(module, n) for n in names]
            if weight_name in module._buffers or any(type(m) is not nn.Linear or m.bias is None for m in linears):
                continue
            with torch.no_grad():
                weight = torch.cat([m.weight for m in linears])
                bias = torch.cat([m.bias for m in linears])
            row = 0
            for m in linears:
                m.weight.data, m.bias.data = weight[row:row + m.out_features], bias[row:row + m.out_features]
                row += m.out_features
            module.register_buffer(weight_name, weight, persistent=False)
            module.register_buffer(bias_name, bias, persistent=False)
            made += 1
    return made


def drop_weight_stacks(model: nn.Module) -> None:
    """Remove the stacks (where the Linears are replaced, as by FP8 inference: the stacks would keep the old weights'
    memory)."""
    for module in model.modules():
        for name in [n for n in module._buffers if n.endswith(SUFFIX)]:
            del module._buffers[name]


def weight_stack(module: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (weight, bias) stack of `names` in a forward without autograd, where there is one; else None."""
    if torch.is_grad_enabled():
        return None
    weight_name, bias_name = stack_names(names)
    weight = getattr(module, weight_name, None)
    return None if weight is None else (weight, getattr(module, bias_name))
