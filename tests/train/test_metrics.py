"""The metrics sink: one JSON row per line, also after a run was killed mid-write and resumed."""

import json

from dzmodel.train.metrics import JsonlSink


def test_a_resumed_sink_drops_a_torn_last_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"loss": 2.0})
    sink.log(2, {"loss": 1.5})
    sink.close()
    path.write_bytes(path.read_bytes() + b'{"step": 3, "lo')  # kill -9 in the middle of a write
    sink = JsonlSink(path)
    sink.log(3, {"loss": 1.25})
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] == 1.25
    JsonlSink(tmp_path / "new.jsonl").close()  # a fresh file is created empty
    assert (tmp_path / "new.jsonl").read_text() == ""
