"""The attention calls of the small preset's training step at the libero_object shape, one part at a time, forward and
backward, on the GPU: where a layer's attention time goes, and what other formulations of the same numbers cost.

Cross-attention (1,058 queries a sample against the prompt's 128 token rows and the CLIP image's 17):
  now          two SDPA calls, text over all 128 rows (the pad rows are identical copies) + image
  t32_bias     text over its first 32 rows, the last of them weighted by the count of pad rows it stands for
               (an additive log(count) on its score: the same softmax), default SDPA dispatch
  t32_bias_{cudnn,efficient}  the same, one SDPA backend forced
  t32_nobias   32 rows without the weight (a lower bound, not the same numbers)
  joint        one score matmul against [32 text | 17 image] keys, the two softmaxes, one matmul with [V_text; V_image]
               (P_t V_t + P_i V_i = [P_t | P_i] [V_t; V_i]), compiled
  (round 17 also timed a Triton kernel running both softmaxes in one pass, `fused`; it was slower at the prompt
  lengths the runs have and is not in the library: commit 0d00d28's dzmodel/model/fused_cross_attention.py)
Self-attention (the teacher-forcing mask as dense rectangles, `SegmentedMask`):
  segments     the product's call per group, keys gathered by concatenation
  views        calls of the same sizes on contiguous slices (what a layout with contiguous groups would cost)

Each part compiled (as in the compiled blocks), 5 warm-up and 30 timed forward + backward calls; one JSON line each,
and the largest difference of each cross variant from `now` on pad rows that are real copies.
Usage (a GPU machine, repository root):
    PYTHONPATH=$PWD python3 docs/archive/results/attention_parts_gpu.py [--batch 128] [--only now,fused] [--no-self]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dzmodel.model.attention import SegmentedMask, TeacherForcingLayout, segmented_attention

H, D, TEXT, IMAGE, KEEP = 4, 64, 128, 17, 32


def timed(fn, inputs, grad, iters=30, warm=5):
    for _ in range(warm):
        out = fn(*inputs)
        out.backward(grad)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        out = fn(*inputs)
        out.backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def cross_inputs(batch, lq, dev, gen):
    rand = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q = rand(batch, H, lq, D)
    kt, vt = rand(batch, H, TEXT, D), rand(batch, H, TEXT, D)
    lengths = torch.randint(1, KEEP - 1, (batch,), device=dev, generator=gen)
    pad = torch.arange(TEXT, device=dev)[None, :] >= lengths[:, None]   # [B, TEXT]: rows that are pad copies
    pad_k, pad_v = rand(1, H, 1, D).expand(batch, H, TEXT, D), rand(1, H, 1, D).expand(batch, H, TEXT, D)
    kt = torch.where(pad[:, None, :, None], pad_k, kt)
    vt = torch.where(pad[:, None, :, None], pad_v, vt)
    ki, vi = rand(batch, H, IMAGE, D), rand(batch, H, IMAGE, D)
    return [t.contiguous().requires_grad_(True) for t in (q, kt, vt, ki, vi)]


def pad_bias(dev, dtype=torch.bfloat16):
    """The last kept row stands for itself and the TEXT - KEEP pad rows left out. In bf16 one log(count) is off by up
    to 0.8 %, so the weight is split over the last two kept rows (both pad copies): a bf16 value below log(count) on
    one, and the remainder's log, small and precise, on the other."""
    count = TEXT - KEEP + 2  # the two rows themselves and the rows left out
    high = torch.tensor(math.log(count), dtype=dtype)
    if high.exp() > count - 1:  # rounded up: step down one bf16 value
        high = torch.nextafter(high, torch.tensor(0.0, dtype=dtype))
    bias = torch.zeros(1, 1, 1, KEEP, device=dev, dtype=dtype)
    bias[..., -2] = high
    bias[..., -1] = math.log(count - float(high.double().exp()))
    return bias


def cross_now(q, kt, vt, ki, vi):
    return F.scaled_dot_product_attention(q, kt, vt) + F.scaled_dot_product_attention(q, ki, vi)


def make_t32(bias, backend=None):
    def fn(q, kt, vt, ki, vi):
        text = F.scaled_dot_product_attention(q, kt[:, :, :KEEP], vt[:, :, :KEEP], attn_mask=bias)
        return text + F.scaled_dot_product_attention(q, ki, vi)
    if backend is None:
        return fn

    def forced(*args):
        with sdpa_kernel(backend):
            return fn(*args)
    return forced


def t32_nobias(q, kt, vt, ki, vi):
    return (F.scaled_dot_product_attention(q, kt[:, :, :KEEP], vt[:, :, :KEEP])
            + F.scaled_dot_product_attention(q, ki, vi))


def make_joint(bias_f32):
    def fn(q, kt, vt, ki, vi):
        k = torch.cat([kt[:, :, :KEEP], ki], dim=2)
        v = torch.cat([vt[:, :, :KEEP], vi], dim=2)
        s = (q @ k.transpose(-1, -2)).float() * (1 / math.sqrt(D))
        p = torch.cat([torch.softmax(s[..., :KEEP] + bias_f32, dim=-1), torch.softmax(s[..., KEEP:], dim=-1)], dim=-1)
        return p.to(q.dtype) @ v
    return fn


def self_inputs(batch, layout, dev, gen):
    rand = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    L = layout.seq_len
    return [rand(batch, H, L, D).requires_grad_(True) for _ in range(3)]


def make_views(plan: SegmentedMask):
    """The same calls' sizes on contiguous slices of one [B, H, L, D] tensor."""
    shapes = [(sum(e - s for s, e in qr), sum(e - s for s, e in kr)) for qr, kr in plan.groups]
    shapes += [(n, n) for n, ranges in plan.self_calls().items() if n > 1 for _ in ranges]

    def fn(q, k, v):
        outs, offset = [], 0
        for nq, nk in shapes:
            start = max(0, offset + nq - nk)  # keys end where the group's queries end
            outs.append(F.scaled_dot_product_attention(q[:, :, offset:offset + nq], k[:, :, start:start + nk],
                                                       v[:, :, start:start + nk]))
            offset += nq
        return torch.cat(outs, dim=2)
    return fn, sum(nq for nq, _ in shapes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--keep", type=int, default=32, help="text rows the compact variants keep (default 32)")
    parser.add_argument("--only", default="", help="comma-separated cross variants (default: all)")
    parser.add_argument("--no-self", action="store_true", help="skip the self-attention parts")
    opts = parser.parse_args()
    global KEEP  # noqa: PLW0603
    KEEP = opts.keep
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    layout = TeacherForcingLayout(num_blocks=2, frame_seqlen=128, num_frame_per_block=2, num_action_per_block=16,
                                  num_state_per_block=1, clean_blocks=1)
    common = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": opts.batch, "keep": KEEP,
              "seq_len": layout.seq_len}
    cross = cross_inputs(opts.batch, layout.seq_len, dev, gen)
    grad = torch.randn_like(cross[0])
    reference = cross_now(*cross).float()
    variants = {
        "now": cross_now, "t32_bias": make_t32(pad_bias(dev)),
        "t32_bias_cudnn": make_t32(pad_bias(dev), SDPBackend.CUDNN_ATTENTION),
        "t32_bias_efficient": make_t32(pad_bias(dev), SDPBackend.EFFICIENT_ATTENTION),
        "t32_nobias": t32_nobias, "joint": make_joint(pad_bias(dev, torch.float32))
    }
    variants = {k: v for k, v in variants.items() if not opts.only or k in opts.only.split(",")}
    for name, fn in variants.items():
        row = dict(common, part="cross", variant=name)
        try:
            compiled = torch.compile(fn, dynamic=False)
            with torch.no_grad():
                row["max_abs_diff_vs_now"] = float((compiled(*cross).float() - reference).abs().max())
            row["ms"] = round(timed(compiled, cross, grad), 3)
        except Exception as exc:  # a backend that cannot run this: say so and go on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)

    if opts.no_self:
        return
    plan = SegmentedMask.from_layout(layout)
    qkv = self_inputs(opts.batch, layout, dev, gen)
    views, rows = make_views(plan)
    for name, fn, out_rows in (("segments", lambda q, k, v: segmented_attention(q, k, v, plan), layout.seq_len),
                               ("views", views, rows)):
        row = dict(common, part="self", variant=name)
        try:
            compiled = torch.compile(fn, dynamic=False)
            g = torch.randn(opts.batch, H, out_rows, D, device=dev, dtype=torch.bfloat16, generator=gen)
            row["ms"] = round(timed(compiled, qkv, g), 3)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
