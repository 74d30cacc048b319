"""`dz bench serve` (dzmodel/bench/serve_bench.py): N real openpi clients against `dz serve`'s server, batching off and
on (tiny preset, CPU)."""

import json

from dzmodel.cli import main


def test_serve_bench_drives_clients_through_the_server_with_and_without_batching(tmp_path, capsys):
    out = tmp_path / "serve.jsonl"
    assert main(["bench", "serve", "--clients", "2", "--max-batch", "2", "--batch-window-ms", "200", "--requests", "3",
                 "--warmup", "1", "--solver-steps", "2", "--cfg-scale", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["clients"], r["max_batch"]) for r in rows] == [(1, 1), (2, 1), (2, 2)]
    for r in rows:
        assert not r["errors"] and r["client"] == ["openpi"]
        assert r["requests"] == 3 * r["clients"] and r["chunks_per_s"] > 0 and len(r["client_p95_ms"]) == r["clients"]
    assert "batching" not in rows[1]  # batching off: no batcher
    batched = rows[2]["batching"]
    assert batched["requests"] == 2 * (3 + 1) and batched["mean_size"] > 1  # the two sessions shared forwards
    assert rows[2]["worst_client_p95_vs_one_client"] > 0


def test_serve_bench_wants_several_clients(capsys):
    assert main(["bench", "serve", "--clients", "1"]) != 0
    assert "--clients and --max-batch must be >= 2" in capsys.readouterr().err


def test_a_large_preset_must_name_the_embodiment_it_serves(capsys):
    assert main(["bench", "serve", "--preset", "dreamzero_5b"]) != 0  # refused before any model is built
    err = capsys.readouterr().err
    assert "--preset dreamzero_5b: name the embodiment served with --embodiment" in err and "64x128" in err


def test_paced_clients_ask_once_a_period_and_count_the_requests_they_sent_late(tmp_path):
    out = tmp_path / "serve.jsonl"
    common = ["bench", "serve", "--clients", "2", "--max-batch", "2", "--requests", "3", "--warmup", "1",
              "--solver-steps", "2", "--cfg-scale", "1", "--out", str(out)]
    assert main([*common, "--period-ms", "600"]) == 0
    assert main([*common, "--period-ms", "0.001"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert "period_ms" not in rows[0] and "period_ms" not in rows[3]  # the one-client baseline stays back to back
    slow, fast = rows[1:3], rows[4:6]
    for r in slow:  # 3 requests a period apart: the last goes 2 periods after the first, and none waited
        assert not r["errors"] and r["period_ms"] == 600 and r["requests"] == 6
        assert r["wall_s"] >= 2 * 0.6 and r["late_requests"] == 0
    for r in fast:  # a period shorter than a chunk: every request after the first was due before its answer came
        assert not r["errors"] and r["late_requests"] == 2 * (3 - 1)
