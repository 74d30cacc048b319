"""The GPU-side scripts of the research archive (docs/archive/results/ and docs/archive/bench/, run where no test runs):
they parse, their usage names every command, and the per-episode files they assembled are the ones the docs cite."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

RESULTS = Path(__file__).parents[1] / "docs" / "archive" / "results"
SCRIPTS = sorted(RESULTS.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["libero_scripted_gpu.sh", "fastpath_gpu.sh"])
def test_the_usage_line_names_every_command(name):
    script = RESULTS / name
    text = script.read_text()
    commands = set(re.findall(r"^  ([a-z-]+)\)$", text, re.M))
    result = subprocess.run(["bash", str(script), "no-such-command"], capture_output=True, text=True)
    assert result.returncode == 2
    assert commands and all(c in result.stderr for c in commands), (commands, result.stderr)


def test_the_runs_plot_reads_every_recorded_result(tmp_path):
    """plot_runs.py names the CSVs of the first closed-loop runs (docs/archive/results-history.md, sections 6-8): each
    exists and has its "all" row."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_runs", RESULTS / "plot_runs.py")
    plot_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_runs)
    files = [f for *_, pattern in plot_runs.RUNS.values() for f in plot_runs.expand(pattern)]
    assert len(files) >= 20 and all(f.is_file() for f in files), [f for f in files if not f.is_file()]
    assert all(n in (40, 80) and 0 <= k <= n for _, k, n in map(plot_runs.overall, files))
    low, high = plot_runs.wilson(4, 40)  # 10 %: about 4-24 %
    assert 0.03 < low < 0.05 and 0.22 < high < 0.25 and plot_runs.wilson(0, 40)[0] == 0
    assert plot_runs.main(tmp_path / "runs.png").stat().st_size > 10_000


def test_the_final_csvs_are_the_evaluations_own_episodes(tmp_path):
    """docs/results/final/libero_object/seed<N>.csv (the profile's recipe now) and the archive's final_fp32_stream/ (the
    recipe before it) are rebuilt from the evaluations' per-episode files (10 tasks x 50 init states per seed, one
    checkpoint each) and hold the numbers docs/results.md reports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("final_tables", RESULTS / "final_tables.py")
    final_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(final_tables)
    counts = final_tables.main(tmp_path)
    assert counts == {"final/libero_object": {0: (467, 500), 1: (445, 500), 2: (495, 500)},
                      "final_fp32_stream": {0: (439, 500), 1: (400, 500), 2: (443, 500)}}
    for recipe, seeds in counts.items():
        for seed in seeds:
            name = f"{recipe}/seed{seed}.csv"
            kept = final_tables.OUTPUTS[recipe] / f"seed{seed}.csv"
            assert (tmp_path / name).read_text() == kept.read_text(), name
            assert (tmp_path / name).read_text().splitlines()[0] == "seed,task,init_state,checkpoint_step,success"


@pytest.mark.parametrize("script", sorted((RESULTS.parent / "bench").glob("*.sh")), ids=lambda p: p.name)
def test_the_bench_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_loss_parity_compares_the_last_window_and_plots(tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("loss_parity", RESULTS.parent / "bench" / "loss_parity.py")
    loss_parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loss_parity)
    ref = [{"step": s, "loss": 2.0 if s <= 100 else 1.0} for s in range(1, 201)]
    other = [{"step": s, "loss": 2.0 if s <= 100 else 1.01} for s in range(1, 201)]
    result = loss_parity.parity(ref, other, window=100)
    assert result["reference_mean_loss"] == 1.0 and abs(result["relative_difference"] - 0.01) < 1e-12
    for name, rows in (("a", ref), ("b", other)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cmd = [sys.executable, str(RESULTS.parent / "bench" / "loss_parity.py"), str(tmp_path / "a.jsonl"),
           str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "p.png")]
    for labels in ([], ["--labels", "bf16", "fp8, bf16 stream"]):
        out = subprocess.run(cmd + labels, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert (tmp_path / "p.png").stat().st_size > 1000
        assert json.loads(out.stdout.splitlines()[0])["window_steps"] == 100
    one_label = subprocess.run(cmd + ["--labels", "bf16"], capture_output=True, text=True)
    assert one_label.returncode == 2 and "--labels" in one_label.stderr
    for rows, value in ((ref, 0.50), (other, 0.52)):  # held-out scores (train.val_cache) at steps 100 and 200
        rows[99]["val_action_loss"], rows[199]["val_action_loss"] = 0.9, value
    result = loss_parity.parity(ref, other, window=100)
    assert result["heldout_step"] == 200 and abs(result["heldout_relative_difference"] - 0.04) < 1e-12
    del other[199]["val_action_loss"]
    with pytest.raises(SystemExit, match="steps 200 and 100"):
        loss_parity.parity(ref, other, window=100)


def test_the_14b_projection_adds_the_layers_to_the_rest_of_the_step(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("project_14b", RESULTS.parent / "bench" / "project_14b.py")
    project_14b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(project_14b)
    common = {"preset": "dreamzero_14b", "micro_batch": 1, "compile": True, "activation_checkpointing": "elementwise",
              "attention": "segments", "encoders": "cache", "device": "NVIDIA H100 80GB HBM3", "peak_mem_gib": 50.0}
    rows = [{**common, "name": "fp8@fsdp2", "num_layers": 8, "step_ms": 500.0, "precision": "fp8"},
            {**common, "name": "fp8@fsdp2", "num_layers": 16, "step_ms": 980.0, "precision": "fp8"},
            {**common, "name": "bf16@fsdp2", "num_layers": 8, "step_ms": 620.0}]  # one depth: skipped
    out, = project_14b.project(rows)
    assert out["layer_ms"] == 60.0 and out["rest_ms"] == 20.0 and out["step_ms"] == 20.0 + 40 * 60.0
    assert out["gpus"] == 2 and out["precision"] == "fp8" and 0 < out["mfu_vs_bf16_peak"] < 1


def test_the_fp8_backward_variants_compute_the_same_gradients():
    """fp8_backward_variants.py (docs/archive/bench/): the inline versions are the library's arithmetic with some or all of
    the transposes inline (equal results), the bf16 weight gradient differs from it only in dW."""
    import torch

    variants = _variants()
    grads = {}
    for name, fn in variants.VARIANTS.items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(37, 64, generator=g, requires_grad=True)
        w = torch.randn(32, 64, generator=g, requires_grad=True)
        fn.apply(x, w, torch.float32).square().sum().backward()
        grads[name] = (x.grad, w.grad)
    for inline in ("fused", "weight_inline"):
        torch.testing.assert_close(grads[inline], grads["library"], rtol=0, atol=0)
    torch.testing.assert_close(grads["bf16_weight_grad"][0], grads["library"][0], rtol=0, atol=0)
    dw, ref = grads["bf16_weight_grad"][1], grads["library"][1]
    assert 0 < ((dw - ref).norm() / ref.norm()).item() < 0.1


def _variants():
    import importlib.util
    import sys

    if "fp8_backward_variants" not in sys.modules:  # registered: the compiler looks its functions' module up
        path = RESULTS.parent / "bench" / "fp8_backward_variants.py"
        spec = importlib.util.spec_from_file_location("fp8_backward_variants", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["fp8_backward_variants"] = module
    return sys.modules["fp8_backward_variants"]
