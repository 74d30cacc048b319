"""The fused i2v cross-attention: attending the prompt's first rows with the last one weighted for the padding left
out gives the model's outputs and gradients (float64, CPU path); the Triton kernels give the same numbers as that
arithmetic (Triton's CPU interpreter, in a subprocess: the interpreter is chosen when the kernels are defined)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dzmodel.model.fused_cross_attention import context_rows_needed, kernel_fits, reference_cross_attention
from dzmodel.model.wan_dit import WanI2VCrossAttention, use_fused_cross_attention

from .helpers import tiny_batch, tiny_model

TEXT_LEN = 40


def padded_context(args, lengths, seed=3):
    """A text context as the encoders give it: each sample's rows past its prompt's length are zeros."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(len(lengths), TEXT_LEN, args.text_dim, generator=g, dtype=torch.float64)
    keep = torch.arange(TEXT_LEN)[None, :] < torch.tensor(lengths)[:, None]
    return ctx * keep[..., None]


def run(model, batch):
    model.zero_grad()
    out = model(**batch, attn_backend="sdpa")
    (out.video_pred.square().mean() + out.action_pred.square().mean()).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_first_rows_with_the_padding_weighted_give_the_models_outputs_and_gradients():
    model = tiny_model(text_len=TEXT_LEN).double().train()
    batch = {k: v.double() for k, v in tiny_batch(model.args, batch=3).items()}
    batch["context"] = padded_context(model.args, [5, 11, 1])
    rows = context_rows_needed(batch["context"], multiple=4)
    assert rows == 12  # past the longest prompt (11 rows), rounded up to 4

    plain, plain_grads = run(model, batch)
    assert use_fused_cross_attention(model, rows) == model.args.num_layers
    fused, fused_grads = run(model, batch)
    torch.testing.assert_close(fused.video_pred, plain.video_pred, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fused.action_pred, plain.action_pred, rtol=1e-10, atol=1e-12)
    assert fused_grads.keys() == plain_grads.keys()
    # the text embedding's included: the kept pad row carries the rows left out. Their sum goes through the
    # key norm, which computes in fp32 (WAN) even here: one row's rounding instead of 29 rows'
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], rtol=1e-6, atol=1e-9, msg=name)

    use_fused_cross_attention(model, None)
    again, _ = run(model, batch)
    assert torch.equal(again.video_pred, plain.video_pred)


def test_too_few_rows_change_the_output():
    """The guarantee matters: cut inside a prompt and the answer differs (what `context_rows_needed` prevents)."""
    model = tiny_model(text_len=TEXT_LEN).double()
    batch = {k: v.double() for k, v in tiny_batch(model.args, batch=2).items()}
    batch["context"] = padded_context(model.args, [5, 11])
    with torch.no_grad():
        plain = model(**batch, attn_backend="sdpa").action_pred
        use_fused_cross_attention(model, 8)
        cut = model(**batch, attn_backend="sdpa").action_pred
    assert (cut - plain).abs().max() > 1e-3


def test_rows_needed():
    ctx = torch.zeros(2, 128, 4)
    ctx[0, :26] = 1.0
    ctx[1, :3] = 1.0
    assert context_rows_needed(ctx) == 32           # rows 0-25 used: row 26 on is padding; a multiple of 16
    assert context_rows_needed(ctx, multiple=1) == 27
    ctx[1, 127] = 1.0                               # a sample that uses the last row: nothing can be left out
    assert context_rows_needed(ctx) == 128
    assert context_rows_needed(torch.zeros(1, 64, 4)) == 16
    with pytest.raises(ValueError, match=r"\[N, L, C\]"):
        context_rows_needed(torch.zeros(64, 4))


def test_a_row_count_above_the_context_is_refused():
    attn = WanI2VCrossAttention(16, 2)
    attn.text_rows = 9
    with pytest.raises(ValueError, match="text_rows 9 exceeds the context's 8 rows"):
        attn(torch.randn(1, 5, 16), torch.randn(1, 8, 16), torch.randn(1, 3, 16))


def test_which_contexts_the_kernel_takes():
    assert kernel_fits(32, 17, 64)        # the small preset at libero_object
    assert kernel_fits(128, 17, 64)       # every row of its 128-row context
    assert not kernel_fits(64, 257, 128)  # the 5B's CLIP tokens: the SDPA calls
    assert not kernel_fits(32, 17, 96)    # not a power of two


KERNEL_CHECK = textwrap.dedent("""
    import json, torch
    from dzmodel.model import fused_cross_attention as f
    torch.manual_seed(0)
    report = {}
    # B, L, H, D, text rows, image rows, pad weight: queries that fill no whole tile, keys below their tiles,
    # several backward programs per (sample, head)
    for case in [(2, 70, 2, 16, 20, 5, 9), (1, 33, 1, 32, 16, 17, 1), (1, 200, 1, 16, 3, 2, 30),
                 (1, 40, 1, 64, 100, 17, 29)]:
        B, L, H, D, T, I, pad = case
        inputs = [torch.randn(B, n, H, D, dtype=torch.float64) for n in (L, T, T, I, I)]
        ref = [t.clone().requires_grad_(True) for t in inputs]
        expected = f.reference_cross_attention(*ref, pad)
        grad = torch.randn_like(expected)
        expected.backward(grad)
        ins = [t.float() for t in inputs]
        o, lse = f.launch_forward(*ins, pad)
        grads = f.launch_backward(*ins, grad.float(), lse, pad)
        diffs = [float((o.double() - expected.detach()).abs().max())]
        diffs += [float((g.double() - r.grad).abs().max()) for g, r in zip(grads, ref)]
        shapes = [list(g.shape) == list(r.shape) for g, r in zip(grads, ref)]
        report[str(case)] = {"diffs": diffs, "shapes": all(shapes), "split": f.backward_split(B * H, -(-L // f.BACKWARD_ROWS))}
    print(json.dumps(report))
""")


def test_the_triton_kernels_compute_the_same_numbers():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import json
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(r["split"] for r in report.values()) > 1
    for case, r in report.items():
        assert r["shapes"], case
        assert max(r["diffs"]) < 1e-4, (case, r["diffs"])  # fp32 kernels against the float64 arithmetic


def test_the_reference_equals_two_sdpa_calls_without_padding_weight():
    g = torch.Generator().manual_seed(0)
    q, kt, vt, ki, vi = (torch.randn(2, n, 2, 8, generator=g, dtype=torch.float64) for n in (7, 5, 5, 3, 3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    expected = t(sdpa(t(q), t(kt), t(vt)) + sdpa(t(q), t(ki), t(vi)))
    torch.testing.assert_close(reference_cross_attention(q, kt, vt, ki, vi), expected)
    # weighting the last text row n times = that row repeated n times
    kt5, vt5 = (torch.cat([x, x[:, -1:].expand(-1, 4, -1, -1)], dim=1) for x in (kt, vt))
    repeated = t(sdpa(t(q), t(kt5), t(vt5)) + sdpa(t(q), t(ki), t(vi)))
    torch.testing.assert_close(reference_cross_attention(q, kt, vt, ki, vi, pad_count=5), repeated)
