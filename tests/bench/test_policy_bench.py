"""`dz bench policy`'s tail accounting (`TailWatch`): what the timed calls paid for besides the model's work."""

import gc

import numpy as np

import pytest

from dzmodel.bench import policy_bench
from dzmodel.bench.policy_bench import PolicySetting, run_policy_bench

SETTING = PolicySetting(name="t", weights="fp32", solver_steps=2, cfg_scale=1.0)


def test_a_collection_during_the_timed_calls_is_counted_and_every_call_is_listed(monkeypatch):
    original = policy_bench._observations
    calls = []

    def observations(*args):  # a full collection inside every third timed call, as the collector might run one
        calls.append(1)
        if len(calls) % 3 == 0:
            gc.collect()
        return original(*args)

    monkeypatch.setattr(policy_bench, "_observations", observations)
    row, = run_policy_bench("tiny", "cpu", [SETTING], calls=6, warmup=0, breakdown_calls=0)
    assert len(row["per_call_ms"]) == 6 and row["p50_ms"] > 0
    assert row["gc_pauses"]["gen2"]["count"] == 2 and row["gc_pauses"]["gen2"]["total_ms"] > 0
    assert row["graph_captures_timed"] == 0 and row["new_memory_segments"] == 0  # CPU: no device memory
    assert row["p95_ms"] <= row["max_ms"] and not row["gc_freeze"]


def test_gc_freeze_leaves_the_model_out_of_the_collections(monkeypatch):
    original, frozen = policy_bench._observations, []

    def observations(*args):
        frozen.append(gc.get_freeze_count())
        return original(*args)

    monkeypatch.setattr(policy_bench, "_observations", observations)
    rows = run_policy_bench("tiny", "cpu", [SETTING], calls=2, warmup=1, breakdown_calls=0, gc_freeze=True)
    # the warm-up call, the frozen timed calls, then the FLOP count's call, unfrozen again
    assert frozen[0] == 0 and all(n > 10_000 for n in frozen[1:3]) and frozen[3:] == [0]
    assert rows[0]["gc_freeze"] and gc.get_freeze_count() == 0  # unfrozen after the timed calls


@pytest.fixture(autouse=True)
def _unfrozen():
    yield
    gc.unfreeze()


def _policy_call(cfg_scale: float, batch: int):
    policy = policy_bench.random_policy("tiny", "cpu", "fp32", 0)
    policy_bench._configure(policy, PolicySetting(weights="fp32", solver_steps=2, cfg_scale=cfg_scale), "cpu")
    obs = policy_bench._observations(policy, np.random.default_rng(0), batch, "flops")
    policy.predict_batch(obs)  # the prompt's embedding is cached from here on, as in the timed calls
    return policy, lambda: policy.predict_batch(obs)


def test_a_call_s_flops_count_its_attention_and_scale_with_the_batch_and_cfg():
    policy, call = _policy_call(5.0, 1)
    runner, graphs = object(), policy.graphs
    policy.model.block_runner = runner  # stands for the compiled block: counted without it, then put back
    total, by_op = policy_bench.count_call_flops(policy, lambda: (policy.model.block_runner is None
                                                                  and not policy.graphs.enabled and call()))
    assert policy.model.block_runner is runner and policy.graphs is graphs
    assert by_op["aten._scaled_dot_product_flash_attention_for_cpu"] > 0  # torch's counter alone leaves it out
    assert by_op["aten.addmm"] > 0 and total == sum(by_op.values())
    policy.model.block_runner = None
    two = policy_bench.count_call_flops(*_policy_call(5.0, 2))[0]
    assert abs(two / total - 2) < 0.01  # every stage's work is per sample: the text embedding is cached
    unguided = policy_bench.count_call_flops(*_policy_call(1.0, 1))[0]
    assert unguided < total  # CFG runs the DiT's solver steps on a second, unconditioned copy


def test_each_row_reports_the_call_s_flops_and_no_mfu_without_a_known_peak():
    row, = run_policy_bench("tiny", "cpu", [SETTING], calls=2, warmup=1, breakdown_calls=0)
    assert row["model_gflops_per_call"] > 0 and row["model_tflops_per_s"] > 0
    assert row["mfu"] is None  # a CPU has no peak in the table: no made-up MFU
    assert abs(sum(row["model_gflops_by_op"].values()) - row["model_gflops_per_call"]) < 0.01


def test_a_count_that_fails_leaves_the_row_s_timings(monkeypatch):
    def fails(policy, call):
        raise RuntimeError("out of memory in the eager call")

    monkeypatch.setattr(policy_bench, "count_call_flops", fails)
    row, = run_policy_bench("tiny", "cpu", [SETTING], calls=2, warmup=0, breakdown_calls=0)
    assert row["p50_ms"] > 0 and "error" not in row
    assert row["model_gflops_per_call"] is None and "out of memory" in row["flops_error"]
