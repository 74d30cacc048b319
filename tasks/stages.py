"""Prefect tasks: one per pipeline stage, each a thin call of `dzmodel.pipeline.run_stage` (what `dz stage`
and dvc.yaml run too).

Caching: the flow computes each stage's key from the params it reads, its upstream stages' output fingerprints
and a hash of the code it runs, all as the stage table declares them (`dzmodel/stages.py`, which dvc.yaml
mirrors), so an unchanged stage is skipped and returns its stored result; the flow forces a rerun
(refresh_cache) when a stage's outputs are missing or were changed since it recorded them.
Stages that use the GPU pool carry the `gpu-pool` tag, which a Prefect tag concurrency limit bounds.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta

from prefect import get_run_logger, task

from dzmodel.config import Profile, StagePaths
from dzmodel.pipeline import run_stage, stage_params
from dzmodel.stages import code_fingerprint

GPU_POOL_TAG = "gpu-pool"


def cache_key(stage: str, prof: Profile, upstream_fingerprints: list[str]) -> str:
    """upstream_fingerprints: the outputs' fingerprints of the stage's upstream stages, in table order."""
    payload = json.dumps({"stage": stage, "params": stage_params(prof, stage), "upstream": upstream_fingerprints,
                          "code": code_fingerprint(stage)}, sort_keys=True, default=str)
    return f"dz-{stage}-" + hashlib.sha256(payload.encode()).hexdigest()[:24]


def _key_from_parameters(context, parameters: dict) -> str:
    return parameters["cache_key"]


def _run(stage: str, prof: Profile, paths: StagePaths, **kwargs) -> dict:
    logger = get_run_logger()
    return run_stage(stage, prof, paths, log=logger.info, **kwargs)


_CACHED = dict(cache_key_fn=_key_from_parameters, persist_result=True, cache_expiration=timedelta(days=90))


# no Prefect retries: fetch_dataset retries transient hub errors itself (fetch.retries, fetch.retry_delay_s), the
# same way under `dz stage fetch` and dvc
@task(name="fetch", **_CACHED)
def fetch(prof: Profile, paths: StagePaths, cache_key: str) -> dict:
    return _run("fetch", prof, paths)


@task(name="metadata", **_CACHED)
def metadata(prof: Profile, paths: StagePaths, cache_key: str) -> dict:
    return _run("metadata", prof, paths)


@task(name="vision", tags=[GPU_POOL_TAG], **_CACHED)
def vision(prof: Profile, paths: StagePaths, cache_key: str) -> dict:
    return _run("vision", prof, paths)


@task(name="cache", tags=[GPU_POOL_TAG], **_CACHED)
def cache(prof: Profile, paths: StagePaths, cache_key: str) -> dict:
    return _run("cache", prof, paths)


@task(name="train", tags=[GPU_POOL_TAG], **_CACHED)
def train(prof: Profile, paths: StagePaths, cache_key: str,
          on_metrics: Callable[[list[dict]], None] | None = None) -> dict:
    """torchrun in a subprocess; its log lines stream into this task's log, its metrics to `on_metrics`."""
    result = _run("train", prof, paths, on_metrics=on_metrics)
    result["_live_logged"] = on_metrics is not None
    return result


@task(name="convert", **_CACHED)
def convert(prof: Profile, paths: StagePaths, cache_key: str) -> dict:
    return _run("convert", prof, paths)


@task(name="eval", tags=[GPU_POOL_TAG], **_CACHED)
def evaluate(prof: Profile, paths: StagePaths, cache_key: str) -> dict:
    return _run("eval", prof, paths)


@task(name="package", **_CACHED)
def package(prof: Profile, paths: StagePaths, cache_key: str) -> dict:
    return _run("package", prof, paths)


STAGE_TASKS = {"fetch": fetch, "metadata": metadata, "vision": vision, "cache": cache, "train": train, "convert": convert,
               "eval": evaluate, "package": package}


@task(name="register-and-promote", retries=2, retry_delay_seconds=5)
def register_and_promote(tracker, prof: Profile, package_result: dict) -> dict:
    """Register the packaged model in MLflow; give it the deployment alias only if it passes the gate."""
    from .tracking import promote

    version = tracker.register(prof, package_result)
    p = prof.promote
    decision = promote(tracker.uri, p.registered_model, version, p.alias, p.min_success, run_id=tracker.run_id,
                       max_action_error_ratio=p.max_action_error_ratio)
    get_run_logger().info(f"registry: {p.registered_model} v{version}: {decision['reason']}")
    return decision
