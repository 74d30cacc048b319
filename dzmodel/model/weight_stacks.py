"""Weight stacks for inference: the Linears that run as one matmul (`wan_dit.project_together`: a self-attention's
q, k and v; a cross-attention's k and v, k_img and v_img) get their weights and biases as views of one tensor, kept
as a non-persistent buffer of their attention module. A forward without autograd then reads the stack as it is,
instead of concatenating the weights at every call (a 5B layer's q, k and v: 56 MB a forward, a tenth of a batch-1
chunk's GPU time). Values, parameters and state_dict keys stay; no memory is added while the weights are views.

The policy makes the stacks (`share_weight_stacks`) when it is built. Whatever later gives the Linears other
tensors is followed by `restack`: the attention modules call it after `.to()` and after loading a state dict, and
LoRA's `apply_lora` / `merge_lora` and FP8's freezing on the model they change. Training never reads a stack:
with autograd on, the Linears' own weights are used."""

from __future__ import annotations

import torch
from torch import nn

SUFFIX = "_stack"  # buffer names: "<names joined by _>_weight_stack" and "..._bias_stack"


def stack_names(names: tuple[str, ...]) -> tuple[str, str]:
    key = "_".join(names)
    return f"{key}_weight{SUFFIX}", f"{key}_bias{SUFFIX}"


def _stackable(linears: list[nn.Module]) -> bool:
    return all(type(m) is nn.Linear and m.bias is not None for m in linears)


def _views_of(weight: torch.Tensor, bias: torch.Tensor, linears: list[nn.Linear]) -> bool:
    """Whether each Linear's weight and bias are its rows of the stack (same storage, offset, dtype and device)."""
    w_ptr, b_ptr = weight.data_ptr(), bias.data_ptr()
    w_row, b_row = weight.stride(0) * weight.element_size(), bias.element_size()
    row = 0
    for m in linears:
        if m.weight.dtype != weight.dtype or m.weight.data_ptr() != w_ptr + row * w_row or \
                m.bias.data_ptr() != b_ptr + row * b_row:
            return False
        row += m.out_features
    return row == weight.shape[0]


def _stack(module: nn.Module, names: tuple[str, ...], create: bool) -> bool:
    """(Re)build the stack of one group from its Linears where it is missing (`create`) or they are not its views;
    drop it where they are no longer plain Linears with biases (FP8, adapters). True where a stack was built."""
    weight_name, bias_name = stack_names(names)
    linears = [getattr(module, n) for n in names]
    stack = module._buffers.get(weight_name)
    if not _stackable(linears):
        module._buffers.pop(weight_name, None)
        module._buffers.pop(bias_name, None)
        return False
    if (stack is None and not create) or (stack is not None and _views_of(stack, module._buffers[bias_name], linears)):
        return False
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = torch.cat([m.bias for m in linears])
    row = 0
    for m in linears:
        m.weight.data, m.bias.data = weight[row:row + m.out_features], bias[row:row + m.out_features]
        row += m.out_features
    module.register_buffer(weight_name, weight, persistent=False)
    module.register_buffer(bias_name, bias, persistent=False)
    return True


def _stack_all(model: nn.Module, create: bool) -> int:
    return sum(_stack(module, names, create) for module in model.modules()
               for names in getattr(type(module), "stacked_projections", ()))


def share_weight_stacks(model: nn.Module) -> int:
    """Stack each group of every module's `stacked_projections` (plain Linears with biases); returns how many groups
    were stacked (0 when called again)."""
    return _stack_all(model, create=True)


def restack(model: nn.Module) -> None:
    """Keep the existing stacks in `model` (its modules) its Linears' storage after something gave them other tensors:
    `.to()` (which converts the stacks and the weights apart: the same values), a state dict loaded with
    assign=True, adapters added or merged, Linears replaced by FP8 ones (their stacks are dropped: they would keep
    the old weights' memory). The attention modules call it after `_apply` and after loading a state dict; LoRA's
    `apply_lora` and `merge_lora` and `fp8.freeze_blocks_to_fp8` after changing the model."""
    _stack_all(model, create=False)


def weight_stack(module: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (weight, bias) stack of `names` in a forward without autograd, where there is one; else None."""
    if torch.is_grad_enabled():
        return None
    weight_name, bias_name = stack_names(names)
    weight = getattr(module, weight_name, None)
    return None if weight is None else (weight, getattr(module, bias_name))
