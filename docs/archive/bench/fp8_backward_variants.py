"""Versions of the FP8 linear's backward in the 5B step, profiled one per process (`dz bench profile`'s step):
    PYTHONPATH=$PWD python docs/archive/bench/fp8_backward_variants.py VARIANT [LAYERS [KEEP_INPUTS]]  (on a GPU with FP8)
or `dz train` with the variant in place:
    PYTHONPATH=$PWD python docs/archive/bench/fp8_backward_variants.py VARIANT train [dz train's arguments]
VARIANT:
  library          dzmodel/model/fp8.py as it is: every transposed FP8 operand (dW's dY and X, dX's W) one custom
                   op each
  weight_inline    dW's operands by the custom op, dX's transposed W inline (fused into its cast by Inductor)
  fused            all the transposes inline, so Inductor fuses them into the FP8 casts (the first version)
  bf16_weight_grad dW = dY^T X in bf16 from the unrounded tensors, dX's W inline: no FP8 transposes for dW
  wholeamax        the library with every cast's absolute maximum as one reduction over the whole tensor (the
                   library's form before; it now takes activations' and gradients' per row, then over the rows)
  keep_wide        the library's `train.fp8_keep_inputs: wide` (it began here as this variant): elementwise
                   recompute keeps the e4m3 inputs of the linears at least 8192 wide (the FFN's down projection)
                   and every cast's scale, not the others' inputs (run with KEEP_INPUTS 0)
  keep_weights     the weight's e4m3 copy saved for the backward and kept by elementwise recompute, not rounded
                   again there (one process: the weight is whole in memory anyway; 1 byte per weight more)
  clip_apart       gradient clipping by clip_grad_norm_'s own scaling pass (the trainer before it folded the
                   scaling into the fused AdamW's grad_scale)
  A+B              several of them at once (keep_wide+keep_weights)
KEEP_INPUTS: 1 (default): elementwise recompute keeps the linears' e4m3 inputs (`train.fp8_keep_inputs`); 0:
recomputes them in the backward.
TOP (environment, default 20): how many kernels the summary lists.
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
        return _grad_x(gq, g_inv, weight, ctx, grad_out), grad_w.to(ctx.weight_dtype), None, None


class Fused(fp8._Float8Matmul):
    @staticmethod
    def backward(ctx, grad_out):
        xq, x_inv, weight = ctx.saved_tensors
        gq, g_inv = _quantize(grad_out, E5M2)
        extra = -xq.shape[0] % 16
        g_t = F.pad(gq.view(torch.uint8), (0, 0, 0, extra)).view(gq.dtype).t().contiguous()
        x_cm = F.pad(xq.view(torch.uint8), (0, 0, 0, extra)).view(xq.dtype).t().contiguous().t()
        grad_w = torch._scaled_mm(g_t, x_cm, scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32)
        return _grad_x(gq, g_inv, weight, ctx, grad_out), grad_w.to(ctx.weight_dtype), None, None


class Bf16WeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, out_dtype, keep_input=True):
        xq, x_inv = _quantize(x, E4M3, as_copy=not keep_input)
        wq, w_inv = _quantize(weight, E4M3)
        ctx.save_for_backward(x, weight)  # unrounded: recomputed under elementwise recompute
        ctx.weight_dtype, ctx.x_dtype = weight.dtype, x.dtype
        return torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        gq, g_inv = _quantize(grad_out, E5M2)
        grad_w = (grad_out.t() @ x.to(grad_out.dtype)).to(ctx.weight_dtype)
        return _grad_x(gq, g_inv, weight, ctx, grad_out), grad_w, None, None


class KeepWeight(fp8._Float8Matmul):
    """The library, the weight's e4m3 copy and scale saved for the backward rather than the weight rounded again
    there (with `keep_weights`' recompute policy, which keeps that copy)."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype, keep_input=True):
        xq, x_inv = _quantize(x, E4M3, as_copy=not keep_input)
        scaled, w_inv = fp8._scaled(weight, E4M3, by_rows=False)
        # the functional copy into a new e4m3 tensor: the policy tells it from the inputs' casts, and eager
        # selective checkpointing refuses to keep the output of an in-place copy_
        wq = torch.ops.aten.copy.default(torch.empty(weight.shape, dtype=E4M3, device=weight.device), scaled)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.weight_dtype, ctx.x_dtype = weight.dtype, x.dtype
        return torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        gq, g_inv = _quantize(grad_out, E5M2)
        w_t = transpose_padded(wq.view(torch.uint8)).view(wq.dtype)
        grad_x = torch._scaled_mm(gq, w_t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=grad_out.dtype).to(ctx.x_dtype)
        g_t = transpose_padded(gq.view(torch.uint8)).view(gq.dtype)
        x_t = transpose_padded(xq.view(torch.uint8)).view(xq.dtype)
        grad_w = torch._scaled_mm(g_t, x_t.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32)
        return grad_x, grad_w.to(ctx.weight_dtype), None, None


_library_scaled = fp8._scaled
VARIANTS = {"library": fp8._Float8Matmul, "weight_inline": WeightInline, "fused": Fused,
            "bf16_weight_grad": Bf16WeightGrad, "keep_weights": KeepWeight}


def _whole_scaled(t, dtype, by_rows=True):
    return _library_scaled(t, dtype, by_rows=False)


def _keeping_wide(base_policy):
    """base_policy (a `_recompute_elementwise_policy`) asked for the wide inputs where it was asked for none."""
    return lambda keep_fp8_inputs=False: base_policy(keep_fp8_inputs or "wide")


def _keeping_weights(base_policy):
    """base_policy that also keeps the weights' e4m3 copies (KeepWeight writes them by the functional copy into
    an e4m3 tensor), with every cast's scalar maximum."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten

    def make(keep_fp8_inputs=False):
        base = base_policy(keep_fp8_inputs)

        def policy(ctx, op, *args, **kwargs):
            if op is aten.copy.default and args[0].dtype == E4M3:
                return CheckpointPolicy.MUST_SAVE
            if op is aten.amax.default and (len(args) < 2 or not args[1]):  # a scale's maximum: a scalar
                return CheckpointPolicy.MUST_SAVE
            return base(ctx, op, *args, **kwargs)

        return policy

    return make


def _clip_apart(self):
    """TrainStep.clip_gradients as before: clip_grad_norm_ scales the gradients in a pass of its own."""
    norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def use(name):
    """Put variant `name` in place (NAME+NAME: several)."""
    for part in name.split("+"):
        # the policy is looked up at each checkpointed call
        if part == "keep_wide":
            parallelize._recompute_elementwise_policy = _keeping_wide(parallelize._recompute_elementwise_policy)
        elif part == "keep_weights":
            parallelize._recompute_elementwise_policy = _keeping_weights(parallelize._recompute_elementwise_policy)
        if part in VARIANTS:
            fp8._Float8Matmul = VARIANTS[part]  # float8_linear looks it up at each call
        elif part == "wholeamax":
            fp8._scaled = _whole_scaled  # _quantize looks it up at each call
        elif part == "clip_apart":
            from dzmodel.train.step import TrainStep

            TrainStep.clip_gradients = _clip_apart
        elif part != "keep_wide":
            raise ValueError(f"unknown variant {part!r}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "train":
        from dzmodel.cli import main

        use(sys.argv[1])
        sys.exit(main(["train", *sys.argv[3:]]))
    name, layers = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
    keep_inputs = sys.argv[3] != "0" if len(sys.argv) > 3 else True
    use(name)
    s = train_profile.profile_step("dreamzero_5b", layers, 21, True, "elementwise", "segments", (11, 20),
                                   precision="fp8", fp8_keep_inputs=keep_inputs,
                                   top=int(os.environ.get("TOP", "20")))
    print(f"variant {name}, {layers} layers{', e4m3 inputs kept' if keep_inputs else ''}:")
    train_profile.print_summary(s)
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_backward_variants.jsonl"), "a") as f:
        f.write(json.dumps({"variant": name, "layers": layers, "keep_inputs": keep_inputs, "step_ms": s.step_ms,
                            "by_category": s.by_category, "top": s.top}) + "\n")
