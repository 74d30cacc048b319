"""Forms of the FP8 cast's absolute maximum, compiled, at the 5B step's shapes (micro-batch 21: 18,900 tokens).
    PYTHONPATH=$PWD python docs/archive/bench/fp8_amax_forms.py [TOKENS]  (on a GPU with FP8)

Each case is compiled alone: a producer (the FFN's GELU, the modulated norm, a gradient, a weight) and the scaled
cast of its output to FP8 in one function, with the absolute maximum taken
  full   t.abs().amax(), one reduction over the whole tensor (dzmodel/model/fp8.py's form for weights)
  rows   per row, then over the rows: t.abs().amax(-1).amax(), the same value (a maximum is exact); the library's
         form for activations and gradients since this measurement
and, for scale, the producer alone (its output in bf16, no cast). Then the FFN (up, GELU, down) forward and
backward through Float8Linear with each form, and in bf16. Prints a table and appends JSON lines to
$OUT/fp8_amax_forms.jsonl."""

import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from dzmodel.model import fp8
from dzmodel.model.fp8 import E4M3, E5M2

_library_scaled = fp8._scaled


def _full_scaled(t, dtype, by_rows=True):
    return _library_scaled(t, dtype, by_rows=False)


def _rows_scaled(t, dtype, by_rows=True):
    return _library_scaled(t, dtype, by_rows=True)


FORMS = {"full": _full_scaled, "rows": _rows_scaled}


DEVICE = os.environ.get("DEVICE", "cuda")  # cpu: a smoke run of the script, not a measurement


def timed(fn, *args, iters=30):
    for _ in range(3):
        fn(*args)
    if DEVICE != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        return (time.perf_counter() - start) / iters * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def quantize_with(form, t, dtype):
    scaled, inverse = FORMS[form](t, dtype)
    return scaled.to(dtype), inverse


def cases(tokens):
    dev = DEVICE
    h = torch.randn(tokens, 14336, device=dev, dtype=torch.bfloat16)
    b = torch.randn(14336, device=dev, dtype=torch.bfloat16)
    r = torch.randn(tokens, 3072, device=dev)
    shift, scale = torch.randn(2, 3072, device=dev)
    g = torch.randn(tokens, 9216, device=dev, dtype=torch.bfloat16)
    w = torch.randn(14336, 3072, device=dev)
    gelu = lambda h, b: F.gelu(h + b, approximate="tanh")  # noqa: E731
    norm = lambda r, shift, scale: (F.layer_norm(r, (3072,)) * (1 + scale) + shift).to(torch.bfloat16)  # noqa: E731
    same = lambda t: t  # noqa: E731
    # name, producer, its inputs, FP8 dtype, bytes the producer alone must move
    return [("ffn gelu [T,14336] bf16", gelu, (h, b), E4M3, h.numel() * 4),
            ("norm+modulate [T,3072] fp32->bf16", norm, (r, shift, scale), E4M3, r.numel() * 6),
            ("gradient [T,9216] bf16 -> e5m2", same, (g,), E5M2, g.numel() * 3),
            ("weight [14336,3072] fp32", same, (w,), E4M3, w.numel() * 5)]


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 18900
    out = os.path.join(os.environ.get("OUT", "."), "fp8_amax_forms.jsonl")
    rows = []
    for name, producer, args, dtype, nbytes in cases(tokens):
        row = {"case": name, "tokens": tokens}
        torch._dynamo.reset()
        row["producer_ms"] = timed(torch.compile(producer), *args)
        for form in FORMS:
            torch._dynamo.reset()
            fn = torch.compile(lambda *a, form=form: quantize_with(form, producer(*a), dtype))
            row[f"{form}_ms"] = timed(fn, *args)
        row["min_bytes_gb"] = nbytes / 1e9
        rows.append(row)
        print(f"{name:36s} producer {row['producer_ms']:.3f} ms  full {row['full_ms']:.3f}  rows {row['rows_ms']:.3f}"
              f"  (producer alone at {nbytes / row['producer_ms'] / 1e6:.0f} GB/s)", flush=True)

    # the FFN, forward and backward, as a block runs it
    x = torch.randn(tokens, 3072, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    for form in ("bf16", *FORMS):
        torch._dynamo.reset()
        ffn = nn.Sequential(nn.Linear(3072, 14336), nn.GELU(approximate="tanh"), nn.Linear(14336, 3072)).to(DEVICE)
        if form != "bf16":
            fp8.convert_blocks_to_fp8(_Blocks(ffn))
            fp8._scaled = FORMS[form]
        step = torch.compile(lambda x: ffn(x).float().square().mean())

        def fwd_bwd(x):
            with torch.autocast(DEVICE, torch.bfloat16):
                loss = step(x)
            loss.backward()
        ms = timed(fwd_bwd, x, iters=20)
        fp8._scaled = _library_scaled
        rows.append({"case": "ffn forward+backward", "tokens": tokens, "form": form, "ms": ms})
        print(f"ffn forward+backward {form:5s} {ms:.3f} ms", flush=True)
    with open(out, "a") as f:
        for row in rows:
            f.write(json.dumps({**row, "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE}) + "\n")


class _Blocks(nn.Module):
    """A model whose one block is `ffn`, for convert_blocks_to_fp8."""

    def __init__(self, ffn):
        super().__init__()
        self.blocks = nn.ModuleList([ffn])


if __name__ == "__main__":
    main()
