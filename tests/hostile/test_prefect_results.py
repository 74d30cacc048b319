"""Prefect task results: plain JSON, and a result record in the storage that names another deserializer
(cloudpickle, or Prefect's JSON with an importable object hook) is never deserialized; the stage runs again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dzmodel import pipeline
from dzmodel.config import StagePaths, load_params
from tests.flows.test_sft_pipeline import _fake_stages, prefect_env  # noqa: F401  (the ephemeral Prefect fixture)

ROOT = Path(__file__).resolve().parents[2]


class Touch:
    """Unpickling it creates a file: what a crafted pickle could do instead."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def crafted(kind: str, marker: Path):
    """A serializer that runs code on load, and a payload that makes it create `marker`."""
    from prefect.serializers import JSONSerializer, PickleSerializer

    if kind == "pickle":
        return PickleSerializer(picklelib="pickle"), Touch(marker)
    # Prefect's JSON serializer imports its object hook by name: subprocess.run({"touch": 0, path: 0})
    return JSONSerializer(object_decoder="subprocess.run"), {"touch": 0, str(marker): 0}


def test_stage_results_are_plain_json_and_nothing_else_is_persisted():
    from flows.sft_pipeline import sft_pipeline
    from tasks.stages import STAGE_TASKS, JSONResultKeys, register_and_promote

    for task in STAGE_TASKS.values():
        assert task.persist_result and task.result_serializer.type == "dz-json", task.name
        assert isinstance(task.cache_policy.key_storage, JSONResultKeys), task.name
        assert task.with_options(refresh_cache=True).cache_policy.key_storage is not None  # as the flow calls it
    assert register_and_promote.persist_result is False
    assert sft_pipeline.persist_result is False


@pytest.mark.parametrize("target", ["metadata", "record"])
@pytest.mark.parametrize("kind", ["pickle", "json-object-hook"])
def test_a_crafted_result_never_runs(prefect_env, tmp_path, monkeypatch, kind, target):  # noqa: F811
    """metadata: the stored metadata names the crafted serializer, the result file holds its payload.
    record: Prefect's one-file result record, serializer and payload together, where the result is kept."""
    from prefect import flow
    from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    from tasks.stages import STAGE_TASKS

    fetch = STAGE_TASKS["fetch"]

    calls: list[str] = []
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages(calls))
    prof = load_params(ROOT / "params.yaml").selected("demo")
    paths = StagePaths(tmp_path, "demo")
    key = f"dz-fetch-hostile-{kind}-{target}-{tmp_path.name}"

    @flow
    def fetch_once():
        return fetch(prof, paths, cache_key=key, return_state=True).name

    assert fetch_once() == "Completed" and calls == ["fetch"]
    assert fetch_once() == "Cached" and calls == ["fetch"]  # the genuine result is reused
    storage = Path(PREFECT_LOCAL_STORAGE_PATH.value())
    result, metadata = storage / key, storage / "dz-result-metadata" / key
    marker = tmp_path / "pwned"
    serializer, payload = crafted(kind, marker)
    if target == "metadata":
        metadata.parent.mkdir(parents=True, exist_ok=True)
        metadata.write_bytes(ResultRecordMetadata(storage_key=str(result), serializer=serializer).dump_bytes())
        result.write_bytes(serializer.dumps(payload))
    else:
        result.write_bytes(ResultRecord(metadata=ResultRecordMetadata(storage_key=str(result), serializer=serializer),
                                        result=payload).serialize())

    state = fetch_once()
    assert not marker.exists()
    assert state == "Completed" and calls == ["fetch", "fetch"]  # ignored: the stage ran again, replacing it
    assert json.loads(metadata.read_bytes())["serializer"] == {"type": "dz-json"}
    assert json.loads(result.read_bytes())["outputs_fingerprint"]
