"""`dz bench train`'s step on CPU (tiny preset) and its variant parsing."""

import pytest
import torch

from dzmodel.bench.train_bench import build_train_step
from dzmodel.bench.cli import parse_variant
from dzmodel.clitools import CLIError


def test_variant_parsing_defaults_and_errors():
    assert parse_variant("lora=64,ema=0.999")["lora_rank"] == 64
    with pytest.raises(CLIError, match="is not a number"):
        parse_variant("lora=big")
    v = parse_variant("name=ew,mbs=16,accum=2,ac=elementwise,compile=0")
    assert v == {"name": "ew", "micro_batch": 16, "accumulation": 2, "compile": False, "ac": "elementwise",
                 "attention": "segments", "encoders": "cache"}
    with pytest.raises(CLIError, match="not one of"):
        parse_variant("mbs=2,gpus=8")
    with pytest.raises(CLIError, match="key=value"):
        parse_variant("mbs")
    assert parse_variant("name=f,prec=fp8")["precision"] == "fp8"


def test_an_fp8_variant_reports_the_precision_that_ran(capsys):
    """On a device without FP8 the trainer falls back to bf16 and says so; the bench row says what ran."""
    from dzmodel.bench.train_bench import run_config

    r = run_config("f", "tiny", None, 2, False, "none", "sdpa", "cache", latent_hw=(4, 6), steps=1, warmup=0,
                   precision="fp8")
    assert r.precision == "bf16" and "precision fp8 falls back to bf16" in capsys.readouterr().out


@pytest.mark.parametrize("accumulation", [1, 2])
def test_bench_step_is_the_trainers_step(accumulation):
    step, trainer = build_train_step("tiny", None, 2, False, "elementwise", "sdpa", "cache",
                                     latent_hw=(4, 6), accumulation=accumulation)
    model = trainer.model
    assert trainer.step.model is model and trainer.step.accumulation == accumulation
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) > len(before) // 2  # one AdamW update happened
    assert all(p.grad is None for p in model.parameters())  # and the accumulated grads were cleared
    assert trainer.args.num_layers == 2


def test_bench_train_runs_on_cpu_and_compares_with_a_run(tmp_path):
    from dzmodel.bench.train_bench import compare_with_run, run

    results = run("tiny", None, [{"name": "optimised", "micro_batch": 2, "compile": False, "ac": "none",
                                  "attention": "sdpa", "encoders": "cache"},
                                 {"name": "baseline", "micro_batch": 1, "compile": False, "ac": "none",
                                  "attention": "sdpa", "encoders": "online_per_sample"},
                                 {"name": "lora", "micro_batch": 2, "compile": False, "ac": "elementwise",
                                  "attention": "sdpa", "encoders": "cache", "lora_rank": 4, "ema_decay": 0.99}],
                  (4, 6), steps=2, warmup=1, out_path=None)
    assert [r.name for r in results] == ["optimised", "baseline", "lora"]
    assert results[0].trainable_params == results[0].params > results[2].trainable_params > 0
    assert all(r.mfu is None and r.samples_per_s_per_gpu > 0 for r in results)  # no MFU on a CPU
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(
        f'{{"step": {i}, "samples_per_s_per_gpu": {v}}}\n' for i, v in enumerate([1.0, 1.0, 1.0, 9.0, 10.0, 11.0], 1)))
    cmp = compare_with_run(run_dir, results[0])
    assert cmp["train_samples_per_s_per_gpu"] == 10.0 and cmp["train_steps_timed"] == 3
    assert cmp["ratio"] == pytest.approx(10.0 / results[0].samples_per_s_per_gpu, rel=1e-3)
    with pytest.raises(ValueError, match="none after the first 9"):
        compare_with_run(run_dir, results[0], skip=9)
