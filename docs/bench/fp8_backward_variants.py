"""Versions of the FP8 linear's backward in the 5B step, profiled one per process (`dz bench profile`'s step):
    PYTHONPATH=$PWD python docs/bench/fp8_backward_variants.py VARIANT [LAYERS]    (on a GPU with FP8)
VARIANT:
  library          dzmodel/model/fp8.py as it is: every transposed FP8 operand (dW's dY and X, dX's W) one custom
                   op each
  weight_inline    dW's operands by the custom op, dX's transposed W inline (fused into its cast by Inductor)
  fused            all the transposes inline, so Inductor fuses them into the FP8 casts (the first version)
  bf16_weight_grad dW = dY^T X in bf16 from the unrounded tensors, dX's W inline: no FP8 transposes for dW
  save_fp8_inputs  the library's backward, with elementwise recompute keeping the linears' e4m3 inputs and their
                   absolute maxima instead of recomputing both in the backward (1 byte more memory for each element
                   of a linear's input; the weights' e4m3 copies are not kept)
Prints the kernel summary and appends a JSON line to $OUT/fp8_backward_variants.jsonl."""

import json
import os
import sys

import torch
import torch.nn.functional as F

from dzmodel.bench import train_profile
from dzmodel.model import fp8
from dzmodel.model.fp8 import E4M3, E5M2, _quantize
from dzmodel.model.fp8_transpose import transpose_padded
from dzmodel.train import parallelize


def _grad_x(gq, g_inv, weight, ctx, grad_out):
    wq, w_inv = _quantize(weight, E4M3)
    return torch._scaled_mm(gq, wq.t().contiguous().t(), scale_a=g_inv, scale_b=w_inv,
                            out_dtype=grad_out.dtype).to(ctx.x_dtype)


class WeightInline(fp8._Float8Matmul):
    @staticmethod
    def backward(ctx, grad_out):
        xq, x_inv, weight = ctx.saved_tensors
        gq, g_inv = _quantize(grad_out, E5M2)
        g_t = transpose_padded(gq.view(torch.uint8)).view(gq.dtype)
        x_t = transpose_padded(xq.view(torch.uint8)).view(xq.dtype)
        grad_w = torch._scaled_mm(g_t, x_t.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32)
        return _grad_x(gq, g_inv, weight, ctx, grad_out), grad_w.to(ctx.weight_dtype), None


class Fused(fp8._Float8Matmul):
    @staticmethod
    def backward(ctx, grad_out):
        xq, x_inv, weight = ctx.saved_tensors
        gq, g_inv = _quantize(grad_out, E5M2)
        extra = -xq.shape[0] % 16
        g_t = F.pad(gq.view(torch.uint8), (0, 0, 0, extra)).view(gq.dtype).t().contiguous()
        x_cm = F.pad(xq.view(torch.uint8), (0, 0, 0, extra)).view(xq.dtype).t().contiguous().t()
        grad_w = torch._scaled_mm(g_t, x_cm, scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32)
        return _grad_x(gq, g_inv, weight, ctx, grad_out), grad_w.to(ctx.weight_dtype), None


class Bf16WeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, out_dtype):
        xq, x_inv = _quantize(x, E4M3)
        wq, w_inv = _quantize(weight, E4M3)
        ctx.save_for_backward(x, weight)  # unrounded: recomputed under elementwise recompute
        ctx.weight_dtype, ctx.x_dtype = weight.dtype, x.dtype
        return torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        gq, g_inv = _quantize(grad_out, E5M2)
        grad_w = (grad_out.t() @ x.to(grad_out.dtype)).to(ctx.weight_dtype)
        return _grad_x(gq, g_inv, weight, ctx, grad_out), grad_w, None


def _quantize_by_copy(t, dtype):
    """_quantize's arithmetic with the rounding written as a copy into a new tensor (aten.copy_, not
    aten._to_copy), so that the saving policy below keeps the input's cast and not the weight's."""
    top = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    scale = top / amax
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    out.copy_((t.float() * scale).clamp(-top, top))
    return out, scale.reciprocal()


class SaveInputs(fp8._Float8Matmul):
    """The library's backward; the forward rounds the weight by _quantize_by_copy (the same bytes)."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype):
        xq, x_inv = _quantize(x, E4M3)
        wq, w_inv = _quantize_by_copy(weight, E4M3)
        ctx.save_for_backward(xq, x_inv, weight)
        ctx.weight_dtype, ctx.x_dtype = weight.dtype, x.dtype
        return torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)


def saving_fp8_inputs_policy(library_policy=parallelize._recompute_elementwise_policy):
    """The elementwise recompute policy, but each linear's e4m3 input (the aten._to_copy to e4m3 of SaveInputs)
    and the absolute maxima (scalars) are kept, not recomputed in the backward. The weight's e4m3 copy is not
    kept: the backward rounds the weight again, as in the library."""
    from torch.utils.checkpoint import CheckpointPolicy

    policy, aten = library_policy(), torch.ops.aten

    def save_fp8(ctx, op, *args, **kwargs):
        if (op is aten._to_copy.default and kwargs.get("dtype") == E4M3) or op is aten.amax.default:
            return CheckpointPolicy.MUST_SAVE
        return policy(ctx, op, *args, **kwargs)

    return save_fp8


VARIANTS = {"library": fp8._Float8Matmul, "weight_inline": WeightInline, "fused": Fused,
            "bf16_weight_grad": Bf16WeightGrad, "save_fp8_inputs": SaveInputs}
POLICIES = {"save_fp8_inputs": saving_fp8_inputs_policy}


def use(name):
    """Put variant `name` in place of the library's FP8 matmul (and recompute policy, where it has one)."""
    fp8._Float8Matmul = VARIANTS[name]  # float8_linear looks it up at each call
    if name in POLICIES:  # _elementwise_checkpointed looks it up at each call
        parallelize._recompute_elementwise_policy = POLICIES[name]


if __name__ == "__main__":
    name, layers = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
    use(name)
    s = train_profile.profile_step("dreamzero_5b", layers, 21, True, "elementwise", "segments", (11, 20),
                                   precision="fp8")
    print(f"variant {name}, {layers} layers:")
    train_profile.print_summary(s)
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_backward_variants.jsonl"), "a") as f:
        f.write(json.dumps({"variant": name, "layers": layers, "step_ms": s.step_ms, "by_category": s.by_category,
                            "top": s.top}) + "\n")
