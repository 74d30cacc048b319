"""`dz bench policy`'s tail accounting (`TailWatch`): what the timed calls paid for besides the model's work."""

import gc

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
    assert frozen[0] == 0 and all(n > 10_000 for n in frozen[1:])  # the warm-up call, then the frozen timed calls
    assert rows[0]["gc_freeze"] and gc.get_freeze_count() == 0  # unfrozen after the timed calls


@pytest.fixture(autouse=True)
def _unfrozen():
    yield
    gc.unfreeze()
