"""Prefect tasks: one per pipeline stage, each a thin call of `dzmodel.pipeline.run_stage` (what `dz stage`
and dvc.yaml run too).

Caching: the flow computes each stage's key from the params it reads, its upstream stages' output fingerprints
and a hash of the code it runs, all as the stage table declares them (`dzmodel/stages/`, which dvc.yaml
mirrors), so an unchanged stage is skipped and returns its stored result; the flow forces a rerun
(refresh_cache) when a stage's outputs are missing or were changed since it recorded them.
Stages that use the GPU pool carry the `gpu-pool` tag, which a Prefect tag concurrency limit bounds.

Results: a stage's result is a dict of JSON values (paths, numbers, the outputs' fingerprint), persisted as plain
JSON (`JSONResults`). Prefect takes the deserializer of a stored result from the stored metadata itself, so
metadata edited to name cloudpickle (or a JSON serializer with an importable object hook) would run code when a
cached task is reused. Each cached result's metadata therefore lives apart from the result, in `JSONResultKeys`,
which hands Prefect only metadata that names JSONResults (and, for a local result, whose file holds a stage
result in JSON);
anything else counts as no cached result: the stage runs again and replaces both.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.cache_policies import NO_CACHE, CacheKeyFnPolicy
from prefect.filesystems import LocalFileSystem
from prefect.serializers import Serializer
from prefect.settings import get_current_settings
from pydantic import Field

from dzmodel.config import Profile, StagePaths
from dzmodel.pipeline import run_stage, stage_params
from dzmodel.progress import report_to
from dzmodel.stages import STAGE_TABLE, STAGES, code_fingerprint

from . import dvc_share
from .tracking import mask_text

GPU_POOL_TAG = "gpu-pool"
log = logging.getLogger(__name__)


class JSONResults(Serializer):
    """Plain JSON: no object hooks, nothing imported by name; a result must be JSON values."""

    type: str = Field(default="dz-json", frozen=True)

    def dumps(self, obj: Any) -> bytes:
        if isinstance(obj, BaseException):  # a failed task's error, which Prefect stores as its result
            obj = {"error": type(obj).__name__, "message": mask_text(str(obj))}
        return json.dumps(obj).encode()

    def loads(self, blob: bytes) -> Any:
        return json.loads(blob)


class MaskedError(RuntimeError):
    """A stage's error whose text named a URI with credentials, masked (the original's traceback quotes it)."""


def _stage_result_file(path: Path) -> bool:
    """A file of this machine's Prefect storage holding a stage's result: a JSON dict with its outputs'
    fingerprint (what `run_stage` returns)."""
    storage = Path(get_current_settings().results.local_storage_path).expanduser().resolve()
    path = path.resolve()
    if not path.is_relative_to(storage) or not path.is_file():
        return False
    try:
        result = json.loads(path.read_bytes())
    except ValueError:
        return False
    return isinstance(result, dict) and "outputs_fingerprint" in result


def _json_results_only(path: str, content: bytes) -> bytes:
    """`content`, a cached result's metadata, if it names JSONResults; else ValueError, which Prefect takes as
    no cached result."""
    try:
        meta = json.loads(content)
        serializer = meta["serializer"]
        plain = serializer == {"type": JSONResults().type}
        if plain and meta.get("storage_block_id") is None:  # a local result: its path is the storage key
            plain = _stage_result_file(Path(meta["storage_key"]))
    except (ValueError, TypeError, KeyError):
        serializer, plain = None, False
    if not plain:
        found = serializer.get("type") if isinstance(serializer, dict) else None
        log.warning(f"{path}: ignored a cached task result that is not plain JSON (serializer {found!r}); "
                    "the stage runs again")
        raise ValueError(f"{path}: not the metadata of a plain JSON result (serializer {found!r}); ignored")
    return content


class JSONResultKeys(LocalFileSystem):
    """Where Prefect keeps the metadata of each cached result: `basepath`, else a folder of the local storage
    path (PREFECT_LOCAL_STORAGE_PATH) as it is set when read. Reads back only what `_json_results_only` passes."""

    _block_type_name = "dz JSON result keys"  # its own block type: inheriting LocalFileSystem's would replace it

    def _resolve_path(self, path: str) -> Path:
        if self.basepath is None:
            base = Path(get_current_settings().results.local_storage_path) / "dz-result-metadata"
            return LocalFileSystem(basepath=str(base))._resolve_path(path)
        return super()._resolve_path(path)

    async def aread_path(self, path: str) -> bytes:
        return _json_results_only(path, await super().aread_path(path))

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return _json_results_only(path, LocalFileSystem.read_path(self, path, _sync=True))


def cache_key(stage: str, prof: Profile, upstream_fingerprints: list[str], shared: bool = False) -> str:
    """upstream_fingerprints: the outputs' fingerprints of the stage's upstream stages, in table order. shared:
    the stage writes at dvc.yaml's places (tasks/dvc_share.py), not under its key; a stored result names the
    paths it wrote, so the two places never share a key."""
    fields = {"stage": stage, "params": stage_params(prof, stage), "upstream": upstream_fingerprints,
              "code": code_fingerprint(stage), **({"at": "dvc workspace"} if shared else {})}
    payload = json.dumps(fields, sort_keys=True, default=str)
    return f"dz-{stage}-" + hashlib.sha256(payload.encode()).hexdigest()[:24]


def _key_from_parameters(context, parameters: dict) -> str:
    return parameters["cache_key"]


def _run(stage: str, prof: Profile, paths: StagePaths, cache_key: str, **kwargs) -> dict:
    logger = get_run_logger()
    # Prefect 3 leaves the task run's own "Cache Key" field empty: the key is this task's parameter and this line
    logger.info(f"{stage}: cache key {cache_key} (a later run with the same key reuses this result)")
    shared = stage in paths.shared  # at dvc.yaml's places: DVC may hold these outputs already (tasks/dvc_share.py)
    if shared and (reused := dvc_share.reuse(stage, paths, logger.info)) is not None:
        return dict(reused, _reused="dvc")
    code = code_fingerprint(stage)
    try:
        with report_to(logger.info):  # the stage's progress bars (convert, statistics, evaluation, recording) log here
            result = run_stage(stage, prof, paths, log=logger.info, **kwargs)
    except Exception as exc:  # Prefect's failed state quotes the error: no credentials of a URI in it
        masked = mask_text(str(exc))
        if masked != str(exc):
            raise MaskedError(f"{type(exc).__name__}: {masked}") from None
        raise
    if shared:
        dvc_share.commit_run(stage, paths, prof, result, code, logger.info)
    return result


_CACHED = dict(cache_policy=CacheKeyFnPolicy(cache_key_fn=_key_from_parameters).configure(key_storage=JSONResultKeys()),
               persist_result=True, result_serializer=JSONResults(), cache_expiration=timedelta(days=90))


def _stage_task(stage: str):
    """The Prefect task of one stage of the table: `_run` of it, cached by its key, on the GPU pool's tag where the
    table's row says it uses the GPU. A stage whose row says `live_metrics` streams its metrics to `on_metrics`
    while it runs (train: torchrun's log lines into the task's log, each step's metrics to MLflow)."""
    spec = STAGE_TABLE[stage]

    def run(prof: Profile, paths: StagePaths, cache_key: str,
            on_metrics: Callable[[list[dict]], None] | None = None) -> dict:
        if not spec.live_metrics:
            return _run(stage, prof, paths, cache_key)
        result = _run(stage, prof, paths, cache_key, on_metrics=on_metrics)
        result["_live_logged"] = on_metrics is not None and not result.get("_reused")
        return result

    run.__name__ = run.__qualname__ = f"stage_{stage}"  # the task's key: one per stage
    # no Prefect retries: a stage retries what is transient itself (fetch: fetch.retries, fetch.retry_delay_s), the
    # same way under `dz stage` and dvc
    return task(run, name=stage, tags=[GPU_POOL_TAG] if spec.gpu else [], **_CACHED)


STAGE_TASKS = {stage: _stage_task(stage) for stage in STAGES}


@task(name="register-and-promote", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE, persist_result=False)
def register_and_promote(tracker, prof: Profile, package_result: dict, registry, provenance: dict | None = None) -> dict:
    """Register the packaged model in MLflow (an unchanged bundle: the version that holds it already); give it
    the deployment alias only if it passes the gate and is no worse than the model holding the alias, both
    measured on the candidate's held-out episodes."""
    from .registry import register_and_promote as now

    return now(tracker, prof, package_result, registry, provenance, log=get_run_logger().info)
