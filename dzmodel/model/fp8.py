"""FP8 linears for the DiT blocks (`train.precision: fp8`, `dz serve --precision fp8`).

Each matmul of a converted `nn.Linear` runs through `torch._scaled_mm`: activations and weights in e4m3, the
output gradient in e5m2 (its wider range), one scale per tensor from its absolute maximum at every call (dynamic
tensorwise scaling, torchao's float8 training recipe). The output and the gradients come back in the compute dtype;
weights, their gradients and the optimizer state stay as they are (fp32 master weights in training).

Only the blocks' linears are converted: self- and cross-attention projections and the FFN, which hold nearly all
of a step's matmul FLOPs. The patch, text, time and image embeddings, the head and the action and state encoders
and decoders stay in the compute dtype: they are a small share of the work, and they set the scale of everything
the blocks see (inputs) or of what the loss reads (outputs), where an e4m3 rounding (3 mantissa bits) would be the
whole error. Norms, attention and the modulation are not matmuls of weights and are unchanged.

A converted module keeps its class's parameters (`weight`, `bias`), so checkpoint keys do not change.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .fp8_transpose import ALIGN, transpose_padded
from .weight_stacks import restack

E4M3, E5M2 = getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first NVIDIA GPUs with FP8 tensor cores


def fp8_unsupported(device: torch.device | str) -> str | None:
    """None when `device` runs FP8 matmuls, else the reason, for the user."""
    device = torch.device(device)
    if E4M3 is None or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no FP8 matmul (torch._scaled_mm)"
    if device.type != "cuda":
        return (f"FP8 matmuls need an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                f"newer (H100, H200, L40S, RTX 4090); this runs on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"FP8 matmuls need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    return None


def resolve_precision(requested: str, device: torch.device | str,
                      fallback: str = "bf16") -> tuple[str, str | None]:
    """The precision to run: `requested`, or `fallback` (what the caller runs without FP8) where FP8 was asked for
    and `device` cannot run it, with the line that says so (None when nothing changed)."""
    if requested != "fp8":
        return requested, None
    why = fp8_unsupported(device)
    if why is None:
        return "fp8", None
    return fallback, f"precision fp8 falls back to {fallback}: {why}"


def _amax(t: torch.Tensor, by_rows: bool = True) -> torch.Tensor:
    """t's largest magnitude. by_rows: each row's, then the largest of those: the same value, but Inductor fuses
    a row reduction into the kernel that produces t and runs it at about twice the bandwidth of one reduction over
    the whole tensor (a 5B FP8 step on an H200: compiled elementwise work 460 -> 434 ms). Weights take the one
    reduction, which was the faster for them (0.096 against 0.111 ms for a 14336 x 3072 fp32 weight)."""
    magnitude = t.detach().abs()
    return magnitude.amax(dim=-1).amax() if by_rows and t.dim() > 1 else magnitude.amax()


def _scaled(t: torch.Tensor, dtype: torch.dtype, by_rows: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """t in fp32 scaled so that its largest magnitude meets `dtype`'s largest value, and the inverse scale (what
    _scaled_mm multiplies back)."""
    top = torch.finfo(dtype).max
    scale = top / _amax(t, by_rows).float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-top, top), scale.reciprocal()


def _quantize(t: torch.Tensor, dtype: torch.dtype, by_rows: bool = True,
              as_copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """t rounded to `dtype` at its own scale (a cast, aten._to_copy), and the inverse scale (`_amax`'s by_rows).
    as_copy: the rounding written as a copy into a new tensor (aten.copy_) rather than a cast. Elementwise
    recompute can keep the e4m3 casts of the linears' inputs for the backward (`train.fp8_keep_inputs`); by this
    it tells apart the e4m3 copies it must not keep (the weights', the context's)."""
    scaled, inverse = _scaled(t, dtype, by_rows)
    if as_copy:
        out = torch.empty(t.shape, dtype=dtype, device=t.device)
        out.copy_(scaled)
        return out, inverse
    # row-major whatever t's layout (a transposed gradient): _scaled_mm's first operand must be
    return scaled.to(dtype).contiguous(), inverse


def _quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_quantize(weight, E4M3) as a copy: never kept by elementwise recompute (FSDP2 frees the gathered weight
    between forward and backward; a kept copy would hold every block's weights)."""
    return _quantize(weight, E4M3, by_rows=False, as_copy=True)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


class _Float8Matmul(torch.autograd.Function):
    """x [M, K] @ weight[N, K]^T in FP8, with the FP8 backward. The weight itself is saved for backward and
    rounded again there, not its e4m3 copy: under FSDP2 the gathered weight is freed after the forward and
    gathered again for the backward, and a saved copy would keep every block's weights whole until then."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                keep_input: bool = True) -> torch.Tensor:
        xq, x_inv = _quantize(x, E4M3, as_copy=not keep_input)
        wq, w_inv = _quantize_weight(weight)
        ctx.save_for_backward(xq, x_inv, weight)
        ctx.weight_dtype, ctx.x_dtype = weight.dtype, x.dtype
        # _scaled_mm: the first operand row-major, the second column-major (wq.t() is)
        return torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xq, x_inv, weight = ctx.saved_tensors
        gq, g_inv = _quantize(grad_out, E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dX = dY [M, N] @ W [N, K]: W as a column-major [N, K]
            wq, w_inv = _quantize(weight, E4M3, by_rows=False)
            # W^T row-major [K, N] (N is a multiple of 16: no padding) by the same opaque copy: a transpose left to
            # the compiler fused into the cast, at about 200 GB/s on an H200
            w_t = transpose_padded(wq.view(torch.uint8)).view(wq.dtype)
            grad_x = torch._scaled_mm(gq, w_t.t(), scale_a=g_inv, scale_b=w_inv,
                                      out_dtype=grad_out.dtype).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # dW = dY^T [N, M] @ X [M, K], the token dimension padded to a multiple of 16
            g_t = transpose_padded(gq.view(torch.uint8)).view(gq.dtype)  # dY^T, row-major
            x_t = transpose_padded(xq.view(torch.uint8)).view(xq.dtype)  # X^T, whose .t() is X column-major
            grad_w = torch._scaled_mm(g_t, x_t.t(), scale_a=g_inv, scale_b=x_inv,
                                      out_dtype=torch.float32).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  keep_input: bool = True) -> torch.Tensor:
    """F.linear with its matmul in FP8 (and its backward, under autograd). keep_input False: elementwise
    recompute never keeps x's e4m3 cast (`Float8Linear.keep_input`)."""
    if weight.shape[0] % ALIGN or weight.shape[1] % ALIGN:  # CUDA's _scaled_mm refuses them; the CPU's may not
        raise ValueError(f"float8_linear: the weight is {tuple(weight.shape)}; FP8 matmuls need both dims multiples "
                         f"of {ALIGN}")
    out_dtype = _out_dtype(x)
    flat = x.reshape(-1, x.shape[-1])
    if flat.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        flat = flat.float()
    if flat.shape[0] == 0:
        out = flat.new_zeros(0, weight.shape[0], dtype=out_dtype)
    else:
        out = _Float8Matmul.apply(flat, weight, out_dtype, keep_input)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Float8Linear(nn.Linear):
    """An nn.Linear whose matmul runs in FP8 (`float8_linear`); the same parameters and checkpoint keys.
    keep_input: whether `train.fp8_keep_inputs` may keep this layer's e4m3 input for the backward. Not for the
    cross-attention's context projections: every block projects the same few hundred context rows per sample, so
    a kept cast is a copy per block (2.8 GiB in a 5B step at micro-batch 21) that saves almost no work."""

    keep_input = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.keep_input)


def convertible(module: nn.Module) -> bool:
    """A plain nn.Linear (not an adapter such as LoRA's) whose dims _scaled_mm takes."""
    return (type(module) is nn.Linear and module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0)


def _kept(name: str, keep: tuple[str, ...]) -> bool:
    return any(name == k or name.startswith(k + ".") for k in keep)


def _block_linears(model: nn.Module, also: tuple[type, ...] = (),
                   keep: tuple[str, ...] = ()) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, linear) for each linear of `model.blocks` that FP8 can take (and each of the types
    `also`), but those named in `keep` (a linear's dotted name within a block, or a leading part of it:
    "cross_attn"). Refused when there is none, when a name of `keep` matches no linear, and when it keeps some of
    an attention's q, k and v but not all (they run as one matmul, which needs one kind of layer)."""
    found, names = [], set()
    for block in model.blocks:
        for parent_name, parent in block.named_modules():
            for name, child in parent.named_children():
                qualified = f"{parent_name}.{name}" if parent_name else name
                if convertible(child) or type(child) in also:
                    names.add(qualified)
                    if not _kept(qualified, keep):
                        found.append((parent, name, child))
    setting = "train.fp8_bf16_layers"
    for k in keep:
        if not any(_kept(n, (k,)) for n in names):
            raise ValueError(f"{setting}: {k!r} matches no FP8 linear of the blocks (a name matches a linear's dotted "
                             f"name or a leading part of it, e.g. 'cross_attn' or 'cross_attn.q'); they are: "
                             f"{', '.join(sorted(names))}")
    for attention in sorted({n.rsplit(".", 1)[0] for n in names if n.endswith((".q", ".k", ".v"))}):
        qkv = [f"{attention}.{p}" for p in "qkv" if f"{attention}.{p}" in names]
        if 0 < sum(_kept(n, keep) for n in qkv) < len(qkv):
            raise ValueError(f"{setting} keeps some of {', '.join(qkv)} but not all: they run as one matmul, in one "
                             f"precision; name all three or {attention!r}")
    if not found:
        raise ValueError("precision fp8: no linear of the model's blocks has dims that are multiples of 16"
                         + (f" and is left out of {setting}" if keep else ""))
    return found


def check_bf16_layers(model: nn.Module, keep: list[str]) -> None:
    """The errors convert_blocks_to_fp8 would give for `keep`, without converting (where FP8 falls back to bf16,
    a wrong name is still refused on the machine where it was written)."""
    _block_linears(model, keep=tuple(keep))


def convert_blocks_to_fp8(model: nn.Module, keep: tuple[str, ...] | list[str] = ()) -> int:
    """Turn the linears of `model.blocks` into Float8Linear in place (their parameters stay), but those named in
    `keep` (dotted names within a block, or leading parts of them); returns how many."""
    if isinstance(keep, str):  # a name, not a list of them
        raise TypeError(f"keep is a list of names, got the string {keep!r}")
    found = _block_linears(model, keep=tuple(keep))
    for parent, name, linear in found:
        linear.__class__ = Float8Linear
        if name in getattr(parent, "context_projections", ()):
            linear.keep_input = False
    return len(found)


def fp8_linears(model: nn.Module) -> int:
    """How many FP8 linears (training or frozen) `model` holds (for checks and logs)."""
    return sum(isinstance(m, (Float8Linear, Float8InferenceLinear)) for m in model.modules())


# --- inference ---------------------------------------------------------------------------------------------------


class Float8InferenceLinear(nn.Module):
    """A frozen linear for serving: its weight stored once in e4m3 with its scale (half the bytes of bf16, read
    at every call), the activations scaled and rounded at every call; the bias in the weights' former dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_fp8, weight_inv_scale = _quantize(linear.weight.detach(), E4M3, by_rows=False)
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("weight_inv_scale", weight_inv_scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_fp8_matmuls(x, (self,))[0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=e4m3"


def frozen_fp8_matmuls(x: torch.Tensor, linears: tuple[Float8InferenceLinear, ...]) -> list[torch.Tensor]:
    """Each of `linears` applied to x, which is scaled and rounded to e4m3 once for all of them (q, k and v read
    the same tokens)."""
    out_dtype = _out_dtype(x)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return [flat.new_zeros(*x.shape[:-1], m.out_features, dtype=out_dtype) for m in linears]
    xq, x_inv = _quantize(flat, E4M3)
    outs = []
    for m in linears:
        out = torch._scaled_mm(xq, m.weight_fp8.t(), scale_a=x_inv, scale_b=m.weight_inv_scale, out_dtype=out_dtype)
        if m.bias is not None:
            out = out + m.bias.to(out_dtype)
        outs.append(out.reshape(*x.shape[:-1], m.out_features))
    return outs


def freeze_blocks_to_fp8(model: nn.Module) -> int:
    """Replace the linears of `model.blocks` by Float8InferenceLinear (their weights rounded to e4m3 once; the
    full-precision weights are dropped); returns how many. For inference only: nothing trains through them."""
    found = _block_linears(model, also=(Float8Linear,))
    for parent, name, linear in found:
        setattr(parent, name, Float8InferenceLinear(linear))
    restack(model)  # drops the weight stacks of the replaced Linears (they would keep the old weights' memory)
    return len(found)
