"""FP8 linears: the matmul is the product of the e4m3 (e5m2 for gradients) roundings, scaled back; the blocks'
linears are the ones converted (keys unchanged, q/k/v still one matmul); FP8 is chosen only where the device runs it,
with a line that says why not otherwise."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dzmodel.model import fp8, fp8_transpose
from dzmodel.model.fp8 import (Float8InferenceLinear, Float8Linear, convert_blocks_to_fp8, float8_linear, fp8_linears,
                               fp8_unsupported, freeze_blocks_to_fp8,
                               resolve_precision)
from dzmodel.model.fp8_transpose import transpose_padded

from .helpers import tiny_batch, tiny_model


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t through dtype at the tensor's own scale, back in float64: what an FP8 matmul multiplies."""
    top = torch.finfo(dtype).max
    scale = top / t.detach().abs().amax().double()
    return (t.detach().double() * scale).clamp(-top, top).to(dtype).double() / scale


@pytest.mark.parametrize("rows", [48, 37])  # 37: the weight gradient's token dimension is padded to 16
def test_forward_and_backward_are_the_fp8_products(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 64, generator=g, requires_grad=True)
    w = torch.randn(32, 64, generator=g, requires_grad=True)
    b = torch.randn(32, generator=g, requires_grad=True)
    y = float8_linear(x, w, b)
    grad = torch.randn(rows, 32, generator=g)
    y.backward(grad)
    xr, wr, gr = _rounded(x, torch.float8_e4m3fn), _rounded(w, torch.float8_e4m3fn), _rounded(grad, torch.float8_e5m2)
    torch.testing.assert_close(y.double(), xr @ wr.T + b.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), gr @ wr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), gr.T @ xr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, grad.sum(0))
    # and it is FP8, not the full-precision product: e4m3 keeps 3 mantissa bits
    exact = F.linear(x.detach(), w.detach(), b.detach())
    assert 0.005 < ((y - exact).norm() / exact.norm()).item() < 0.1


def test_a_weight_whose_dims_are_not_multiples_of_16_is_refused():
    for shape in ((20, 64), (32, 40)):
        with pytest.raises(ValueError, match=rf"the weight is \({shape[0]}, {shape[1]}\); FP8 matmuls need both dims "
                                             "multiples of 16"):
            float8_linear(torch.randn(8, shape[1]), torch.randn(*shape))


def test_under_autocast_the_output_is_in_the_compute_dtype():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float8_linear(x, w, torch.zeros(16)).dtype == torch.bfloat16
    assert float8_linear(x.reshape(2, 8, 32), w).shape == (2, 8, 16)


def _count_fp8_matmuls(monkeypatch):
    calls = []
    real = fp8._Float8Matmul.apply

    def counted(x, weight, out_dtype, keep_input=True):
        calls.append(tuple(weight.shape))
        return real(x, weight, out_dtype, keep_input)

    monkeypatch.setattr(fp8._Float8Matmul, "apply", counted)
    return calls


def test_only_the_blocks_linears_are_converted_and_keys_stay(monkeypatch):
    model = tiny_model(ffn_dim=96)  # no FFN weight of the k-and-v shape [2·dim, dim]
    keys = list(model.state_dict())
    per_block = sum(isinstance(m, nn.Linear) for m in model.blocks[0].modules())
    converted = convert_blocks_to_fp8(model)
    assert converted == per_block * len(model.blocks) == fp8_linears(model)
    assert list(model.state_dict()) == keys  # the same parameters: checkpoints load either way
    outside = [n for n, m in model.named_modules() if isinstance(m, Float8Linear) and not n.startswith("blocks.")]
    assert outside == [] and type(model.head.head) is nn.Linear
    calls = _count_fp8_matmuls(monkeypatch)
    batch = tiny_batch(model.args)
    with torch.no_grad():
        model(**batch)
    # per block: q, k and v as one matmul (the last block, which computes only the rows the loss reads: q, and k
    # with v), o; the cross-attention's q, text k with v, image k with v, o; the FFN's two
    dim, blocks = model.args.dim, len(model.blocks)
    fused, pairs = calls.count((3 * dim, dim)), calls.count((2 * dim, dim))
    assert fused == blocks - 1 and pairs == 2 * blocks + 1
    assert len(calls) == blocks * (per_block - 4) + 1


def test_named_linears_stay_bf16_and_a_wrong_name_is_one_clear_error():
    model = tiny_model(ffn_dim=96)
    per_block = sum(isinstance(m, nn.Linear) for m in model.blocks[0].modules())
    converted = convert_blocks_to_fp8(model, keep=["self_attn.o", "cross_attn"])
    block = model.blocks[0]
    assert type(block.self_attn.o) is nn.Linear and type(block.cross_attn.q) is nn.Linear
    assert type(block.self_attn.q) is Float8Linear and type(block.ffn[0]) is Float8Linear
    cross = sum(isinstance(m, nn.Linear) for m in block.cross_attn.modules())
    assert converted == (per_block - 1 - cross) * len(model.blocks) == fp8_linears(model)
    with pytest.raises(ValueError, match=r"train.fp8_bf16_layers: 'cross' matches no FP8 linear of the blocks "
                                         r"\(a name matches .*; they are: .*self_attn.o"):
        convert_blocks_to_fp8(tiny_model(), keep=["cross"])  # a leading dotted part, not any prefix of the string
    with pytest.raises(ValueError, match=r"keeps some of self_attn.q, self_attn.k, self_attn.v but not all: they "
                                         r"run as one matmul"):
        convert_blocks_to_fp8(tiny_model(), keep=["self_attn.q"])
    with pytest.raises(ValueError, match="left out of train.fp8_bf16_layers"):
        convert_blocks_to_fp8(tiny_model(), keep=["self_attn", "cross_attn", "ffn"])
    with pytest.raises(TypeError, match="a list of names"):
        convert_blocks_to_fp8(tiny_model(), keep="cross_attn")


def test_a_converted_model_trains_close_to_the_full_precision_one():
    torch.manual_seed(0)
    model = tiny_model()
    batch = tiny_batch(model.args)
    ref = model(**batch)
    convert_blocks_to_fp8(model)
    out = model(**batch)
    for a, b in ((out.video_pred, ref.video_pred), (out.action_pred, ref.action_pred)):
        rel = ((a - b).norm() / b.norm()).item()
        assert 0 < rel < 0.1
    (out.video_pred.square().mean() + out.action_pred.square().mean()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.blocks.parameters())


def test_fp8_is_chosen_only_where_the_device_runs_it(monkeypatch):
    precision, why = resolve_precision("fp8", "cpu")
    assert precision == "bf16" and why.startswith("precision fp8 falls back to bf16: ")
    assert "compute capability 8.9" in why and "this runs on cpu" in why
    assert resolve_precision("bf16", "cpu") == ("bf16", None)
    assert resolve_precision("fp8", "cpu", fallback="fp32")[0] == "fp32"  # the caller names what it runs instead

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    precision, why = resolve_precision("fp8", "cuda")
    assert precision == "bf16" and "NVIDIA A100-SXM4-80GB has 8.0" in why
    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert resolve_precision("fp8", "cuda") == ("fp8", None) and fp8_unsupported("cuda") is None


def test_served_fp8_weights_are_rounded_once_and_share_the_input_rounding(monkeypatch):
    g = torch.Generator().manual_seed(3)
    linear = nn.Linear(64, 48)
    x = torch.randn(5, 7, 64, generator=g)
    with torch.no_grad():  # one layer: the same rounding of the weight as the training path's, so the same numbers
        torch.testing.assert_close(Float8InferenceLinear(linear)(x), float8_linear(x, linear.weight, linear.bias))
    reference = tiny_model()
    served = tiny_model()
    frozen = freeze_blocks_to_fp8(served)
    assert frozen == fp8_linears(served)
    assert not [n for n, _ in served.blocks.named_parameters() if n.endswith(".weight") and "norm" not in n
                and "modulation" not in n]  # the full-precision weights are gone
    assert all(m.weight_fp8.dtype == torch.float8_e4m3fn
               for m in served.modules() if isinstance(m, Float8InferenceLinear))
    batch = tiny_batch(served.args)
    roundings = []
    real = fp8._quantize
    monkeypatch.setattr(fp8, "_quantize", lambda t, dtype: roundings.append(tuple(t.shape)) or real(t, dtype))
    with torch.no_grad():
        a, b = reference(**batch), served(**batch)
    for x, y in ((b.video_pred, a.video_pred), (b.action_pred, a.action_pred)):
        assert 0 < ((x - y).norm() / y.norm()).item() < 0.1
    # inputs rounded per block: q/k/v's tokens once (the last block, which computes only the rows the loss reads:
    # its q rows, then k/v), the attention output, the cross-attention's queries, text (once for k and v), image
    # (once for k and v), its output, the FFN's two; separate q, k and v roundings would add two per block
    assert len(roundings) == 8 * len(served.blocks) + 1


def test_the_policy_bench_puts_fp8_beside_bf16_with_the_chunk_difference(monkeypatch):
    from dzmodel.bench import policy_bench
    from dzmodel.bench.policy_bench import PolicySetting, run_policy_bench

    setting = PolicySetting(name="s", solver_steps=2, cfg_scale=1.0, cuda_graphs=False)
    rows = run_policy_bench("tiny", "cpu", [setting, PolicySetting(name="s fp8", weights="fp8", solver_steps=2,
                                                                    cfg_scale=1.0, cuda_graphs=False)],
                            calls=1, warmup=0, breakdown_calls=0)
    assert "p50_ms" in rows[0] and "compute capability 8.9" in rows[1]["error"] and "p50_ms" not in rows[1]
    monkeypatch.setattr(policy_bench, "resolve_precision", lambda requested, device, **_: (requested, None))
    rows = run_policy_bench("tiny", "cpu", [setting, PolicySetting(name="s fp8", weights="fp8", solver_steps=2,
                                                                    cfg_scale=1.0, cuda_graphs=False)],
                            batches=(2,), calls=1, warmup=0, breakdown_calls=0)
    diff = rows[1]["chunk_diff_vs_bf16"]
    assert rows[1]["weights"] == "fp8" and rows[1]["p50_ms"] > 0 and 0 < diff["rel_l2"] < 0.5 and diff["max_abs"] > 0
    with pytest.raises(ValueError, match="put them after every other setting"):
        run_policy_bench("tiny", "cpu", [PolicySetting(weights="fp8"), setting])


def test_compiled_fp8_matmuls_equal_the_eager_ones():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g, requires_grad=True)
    w = torch.randn(32, 64, generator=g, requires_grad=True)
    grads = []
    for fn in (float8_linear, torch.compile(float8_linear)):
        y = fn(x, w)
        y.square().sum().backward()
        grads.append((y.detach(), x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager)


def test_backward_keeps_the_weight_itself_not_an_fp8_copy():
    """Under FSDP2 the gathered weight is freed after the forward; a saved e4m3 copy would keep it whole."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        float8_linear(x, w)
    weights = [t for t in saved if t.shape == w.shape]
    assert len(weights) == 1 and weights[0].data_ptr() == w.data_ptr()
    assert [t.dtype for t in saved if t.shape == x.shape] == [torch.float8_e4m3fn]  # the input: its e4m3 copy


def _transposed_reference(t: torch.Tensor) -> torch.Tensor:
    rows = t.shape[0] + (-t.shape[0] % 16)
    out = torch.zeros(t.shape[1], rows, dtype=t.dtype, device=t.device)
    out[:, :t.shape[0]] = t.t()
    return out


def test_the_weight_gradient_operands_are_transposed_and_zero_padded():
    for shape in ((37, 48), (64, 80), (0, 48), (1, 32)):
        t = torch.randint(0, 256, shape, dtype=torch.uint8)
        out = transpose_padded(t)
        assert out.shape == (shape[1], -(-shape[0] // 16) * 16) and out.is_contiguous()
        assert torch.equal(out, _transposed_reference(t))
    already = torch.randint(0, 256, (48, 32), dtype=torch.uint8).t()  # its transpose is contiguous: still a copy
    assert torch.equal(transpose_padded(already), _transposed_reference(already))
    torch.library.opcheck(transpose_padded, (torch.randint(0, 256, (37, 48), dtype=torch.uint8),))
    torch.library.opcheck(transpose_padded, (already,))
    with pytest.raises(ValueError, match="one-byte elements"):
        transpose_padded(torch.zeros(4, 4))


def test_compiled_fp8_backward_keeps_the_transposed_copies_whole():
    """The compiled backward holds the transposes of its FP8 operands (dW's dY and X, dX's W) as three whole ops,
    which the compiler cannot fuse into the FP8 casts: fused, they ran at a twentieth of the memory bandwidth on an
    H200."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    backward_ops = []

    def keep_forward(gm, _):
        return make_boxed_func(gm.forward)

    def record_backward(gm, _):
        backward_ops.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    x = torch.randn(37, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    float8_linear(x, w).square().sum().backward()
    eager = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(float8_linear, backend=aot_autograd(fw_compiler=keep_forward, bw_compiler=record_backward),
                             dynamic=True)  # the token count varies with packing
    compiled(x, w).square().sum().backward()
    assert backward_ops.count(torch.ops.dzmodel.transpose_padded.default) == 3  # dY, X and W
    torch.testing.assert_close((x.grad, w.grad), eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
def test_the_gpu_kernel_copies_like_the_reference():
    for rows, cols in ((37, 48), (64, 80), (18900, 3072), (130, 14336), (1, 3088)):
        t = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device="cuda")
        assert fp8_transpose.uses_triton(t)
        assert torch.equal(transpose_padded(t), _transposed_reference(t))
        assert torch.equal(transpose_padded(t.t()), _transposed_reference(t.t()))  # a strided input
    assert transpose_padded(torch.zeros(0, 48, dtype=torch.uint8, device="cuda")).shape == (48, 0)


def test_activations_take_their_maximum_per_row_and_weights_over_the_whole_tensor():
    """The cast's absolute maximum: per row, then over the rows, for activations and gradients (Inductor fuses a
    row reduction into the producer's kernel: the 5B FP8 step's compiled elementwise work fell from 460 to 434 ms on
    an H200); one reduction for weights (faster for them). Either way the same value, so the same FP8 tensor."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def reductions(fn, t):
        graph = make_fx(fn)(t).graph
        return [tuple(node.args[1]) if len(node.args) > 1 else () for node in graph.nodes
                if node.target is torch.ops.aten.amax.default]

    x = torch.randn(37, 64)
    x[5, 7] = 40.0  # the largest magnitude in one row
    assert reductions(lambda t: fp8._quantize(t, fp8.E4M3), x) == [(-1,), ()]
    assert reductions(lambda t: fp8._quantize(t, fp8.E4M3, by_rows=False), x) == [()]
    assert reductions(lambda t: fp8._quantize_weight(t), x) == [()]
    for dtype in (fp8.E4M3, fp8.E5M2):
        by_rows, whole = fp8._quantize(x, dtype), fp8._quantize(x, dtype, by_rows=False)
        assert torch.equal(by_rows[0].view(torch.uint8), whole[0].view(torch.uint8))
        assert torch.equal(by_rows[1], whole[1]) and by_rows[1].item() == pytest.approx(40.0 / torch.finfo(dtype).max)
