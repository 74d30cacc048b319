"""The DVC path's MLflow run: `dz track`, dvc.yaml's last stage.

`dvc repro` runs each stage through `dz stage NAME`, which records its result in runs/<profile>/stages/<name>.json.
`dz track` then logs those records as one MLflow run, the way a flow run logs its stages: the resolved params as
columns, a nested run per stage with its metrics and plots, the dataset as an input, then registration and the
promotion gate (the same `register_and_promote` the flow calls). An unchanged bundle registers no new version.

The run is named `<profile>-<params digest>-dvc-<n>`; its record, runs/<profile>/tracking.json, is the stage's
output, so DVC reruns it only when a stage before it, or a parameter it reads, changed.
"""

from __future__ import annotations

import json
from pathlib import Path

from dzmodel.atomic import atomic_write_text
from dzmodel.config import StagePaths, load_run
from dzmodel.pipeline import STAGES, outputs_intact
from tasks.registry import register_and_promote
from tasks.resolver import Registry
from tasks.tracking import Tracker, experiment_name, mask_uri, ui_page

TRACKING_RECORD = "tracking.json"


class TrackError(ValueError):
    """The stage records cannot be logged (missing or stale); the message says which and what to run."""


def stage_records(paths: StagePaths) -> dict[str, dict]:
    """Every stage's recorded result, checked against its outputs: a record whose outputs changed since (or are
    gone) would log numbers that no longer describe them."""
    records = {}
    for stage in STAGES:
        record = paths.record(stage)
        if not record.is_file():
            raise TrackError(f"{record}: stage {stage} has no record; run `dvc repro` (or `dz stage {stage}`) first")
        if not outputs_intact(stage, paths):
            raise TrackError(f"{record}: stage {stage}'s outputs changed or are missing since it ran; "
                             f"run `dvc repro` (or `dz stage {stage}`) again")
        records[stage] = json.loads(record.read_text())
    return records


def _run_name(tracker_client, experiment_id: str, prefix: str) -> str:
    runs = tracker_client.search_runs([experiment_id], f"tags.`dz.run_name` LIKE '{prefix}%'", max_results=1000)
    taken = [int(r.data.tags["dz.run_name"][len(prefix):]) for r in runs
             if r.data.tags["dz.run_name"][len(prefix):].isdigit()]
    return f"{prefix}{max(taken, default=0) + 1}"


def track(root: str | Path = ".", params_path: str = "params.yaml", overrides: list[str] | None = None,
          profile: str | None = None, promote: bool = True, log=print) -> dict:
    """Log the stage records of `dvc repro` (or of `dz stage` calls) of one profile as an MLflow run, register
    the package and run the promotion gate. Returns the summary also written to runs/<profile>/tracking.json."""
    spec = load_run(Path(root).resolve(), params_path, overrides, profile)
    name, prof, root_dir, digest = spec.name, spec.prof, spec.root, spec.digest
    paths = StagePaths(root_dir, name)
    records = stage_records(paths)  # before any MLflow run exists: nothing half-logged
    tags = {"dz.params_digest": digest, "dz.source": "dvc"}
    tracker = Tracker.open(spec, paths, run_name=f"{name}-{digest}-dvc-pending", tags=tags,
                           description=f"`dvc repro` of profile `{name}` (params digest `{digest}`): the stage "
                                       f"records of `{paths.run}`, logged by `dz track`.\n")
    try:
        run = _run_name(tracker.client, tracker.experiment_id, f"{name}-{digest}-dvc-")
        tracker.client.set_tag(tracker.run_id, "mlflow.runName", run)
        tracker.client.set_tag(tracker.run_id, "dz.run_name", run)
        for stage in STAGES:
            result = dict(records[stage], _live_logged=False)
            tracker.log_stage(stage, result, cached=False, paths=paths)
        decision = None
        if promote:
            provenance = {"run_name": run, "params_digest": digest,
                          "keys": {s: r.get("outputs_fingerprint", "") for s, r in records.items()}}
            registry = Registry.of(prof.promote.registered_model, spec.params, root_dir, tracker.uri)
            decision = register_and_promote(tracker, prof, records["package"], registry, provenance, log=log)
        tracker.end()
    except (KeyboardInterrupt, SystemExit):
        tracker.end(status="KILLED")
        raise
    except BaseException:
        tracker.end(status="FAILED")
        raise
    summary = {"profile": name, "run_name": run, "mlflow_run_id": tracker.run_id,
               "mlflow_experiment_id": tracker.experiment_id, "mlflow_uri": mask_uri(tracker.uri),
               "experiment": experiment_name(prof, name), "params_digest": digest, "promotion": decision,
               "mlflow_page": ui_page(prof, tracker.uri, tracker.experiment_id, tracker.run_id),
               "package": records["package"].get("tarball")}
    atomic_write_text(paths.run / TRACKING_RECORD, json.dumps(summary, indent=1, default=str) + "\n")
    return summary
