"""`dz bench train`'s step on CPU (tiny preset) and its variant parsing."""

import pytest
import torch

from dzmodel.bench.train_bench import build_train_step
from dzmodel.cli import CLIError, parse_variant


def test_variant_parsing_defaults_and_errors():
    v = parse_variant("name=ew,mbs=16,accum=2,ac=elementwise,compile=0")
    assert v == {"name": "ew", "micro_batch": 16, "accumulation": 2, "compile": False, "ac": "elementwise",
                 "attention": "segments", "encoders": "cache"}
    with pytest.raises(CLIError, match="not one of"):
        parse_variant("mbs=2,gpus=8")
    with pytest.raises(CLIError, match="key=value"):
        parse_variant("mbs")


@pytest.mark.parametrize("accumulation", [1, 2])
def test_bench_step_accumulates_then_updates_once(accumulation):
    step, args, layout = build_train_step("tiny", None, 2, False, "elementwise", "sdpa", "cache",
                                          latent_hw=(4, 6), device="cpu", accumulation=accumulation)
    model = next(c.cell_contents for c in step.__closure__ if isinstance(c.cell_contents, torch.nn.Module))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) > len(before) // 2  # one AdamW update happened
    assert all(p.grad is None for p in model.parameters())  # and the accumulated grads were cleared
    assert layout.seq_len > 0 and args.num_layers == 2
