"""The SFT pipeline as a Prefect flow: fetch → metadata → vision → cache → train → convert → eval → package →
promote.

It composes the tasks in `tasks/` and holds no stage logic of its own. One MLflow parent run per flow run
(experiment dreamzero-<profile>), a nested run per stage; a rerun where every stage is cached is one small run
(tag dz.cached) pointing at the run that made its outputs (dz.original_run_id). Prefect artifacts show the tables
and plots.

    dz pipeline run --profile demo                  # or: python -m flows.sft_pipeline --profile demo
"""

from __future__ import annotations

import argparse
import os
import sys
from asyncio import CancelledError
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.context import get_run_context
from prefect.settings import get_current_settings
from prefect.utilities.annotations import quote

from dzmodel.config import StagePaths, load_run
from dzmodel.pipeline import STAGES, current_fingerprint, outputs_intact
from dzmodel.runs import check_run_name, link_stage, next_run_name, run_view, start_view
from tasks import artifacts, dvc_share
from dzmodel.stages import STAGE_TABLE
from tasks.stages import STAGE_TASKS, cache_key, register_and_promote
from tasks.resolver import Registry
from tasks.tracking import Tracker, experiment_name, mask_secrets_in_logs, mask_uri, ui_page


def _run_name() -> str:
    """The flow run's name, as Prefect asks for it when the run starts: --run-name, else
    <profile>-<params digest>-<n> (the flow refuses bad params itself, with the full message)."""
    from prefect.runtime import flow_run

    given = flow_run.parameters
    if given.get("run_name"):
        return given["run_name"]
    try:
        spec = load_run(Path(given.get("root") or ".").resolve(), given.get("params_path", "params.yaml"),
                        given.get("overrides") or [], given.get("profile"))
        return next_run_name(StagePaths(spec.root, spec.name, keyed=True), spec.resolved)
    except (ValueError, OSError):
        return "sft-pipeline-bad-params"


@flow(name="sft-pipeline", log_prints=True, persist_result=False, flow_run_name=_run_name)  # its summary is returned, never read back
def sft_pipeline(profile: str | None = None, params_path: str = "params.yaml", overrides: list[str] | None = None,
                 root: str = ".", promote: bool = True, run_name: str | None = None) -> dict:
    """Run every stage of one params.yaml profile; unchanged stages come from the task cache.

    A stage whose params are the ones dvc.yaml gives it writes at dvc.yaml's places and is committed to DVC
    (tasks/dvc_share.py); any other stage writes under its cache key (runs/<profile>/store/<stage>/<key>/). A
    cached result is used only while the outputs it describes are there; the run's own view is
    runs/<profile>/<run name>/."""
    mask_secrets_in_logs()  # Prefect's own lines quote errors, and MLflow's errors quote the tracking URI
    logger = get_run_logger()
    ctx = get_run_context()
    run = check_run_name(ctx.flow_run.name)  # _run_name's: also the MLflow run's and the view's name
    spec = load_run(Path(root).resolve(), params_path, overrides, profile)  # refuses bad params before any work
    name, prof, root_dir, digest = spec.name, spec.prof, spec.root, spec.digest
    paths = StagePaths(root_dir, name, keyed=True)
    view = run_view(paths, run)
    ui = get_current_settings().ui_url
    prefect = (f"[{run}]({ui.rstrip('/')}/runs/flow-run/{ctx.flow_run.id})" if ui and os.environ.get("PREFECT_API_URL")
               else f"{run} (id {ctx.flow_run.id}, on a temporary Prefect server)")
    shared = dvc_share.shared_with_dvc(spec)  # written where dvc.yaml puts them, committed to DVC
    tracker = Tracker.open(spec, paths, run_name=run, tags={"prefect.flow_run_id": str(ctx.flow_run.id),
                                                           "prefect.flow_run_name": run, "dz.run_name": run,
                                                           "dz.params_digest": digest},
                           description=f"Pipeline run **{run}** of profile `{name}` (params digest `{digest}`).\n\n"
                                       f"- Prefect flow run: {prefect}\n- Outputs: `{view}` (links to the outputs "
                                       "each stage used)\n")
    link = ui_page(prof, tracker.uri, tracker.experiment_id, tracker.run_id)
    logger.info(f"run {run} (profile {name}): {view}; MLflow run {tracker.run_id} in experiment "
                f"{experiment_name(prof, name)} ({mask_uri(tracker.uri)})")
    start_view(paths, run, {"profile": name, "params_digest": digest, "overrides": list(spec.overrides),
                            "mlflow_run_id": tracker.run_id, "prefect_flow_run_id": str(ctx.flow_run.id)})
    artifacts.mlflow_link_artifact(name, link)
    results: dict[str, dict] = {}
    states: dict = {}  # each stage's final state: passed on as wait_for, the Prefect graph's edges
    # cached stages get their nested runs once a stage runs (they show what it reused); a rerun where every stage
    # is cached stays one small run pointing at the run that made the outputs, with nothing copied into it
    unlogged: list[tuple] = []
    stage = STAGES[0]
    workspace = dvc_share.Workspace(root_dir, name)  # held for the whole run when it shares: one writer at a time
    if shared and not workspace.claim():
        logger.info(f"{workspace.where} is in use (another pipeline run, or a stage of dvc repro): this run keeps "
                    "every stage's outputs under its cache key")
        shared = ()
    try:
        for stage in STAGES:
            key = cache_key(stage, prof, [results[u]["outputs_fingerprint"] for u in STAGE_TABLE[stage].upstream],
                            shared=stage in shared)
            paths = paths.with_key(stage, key)
            if stage in shared:
                paths = paths.share(stage)
            # the key names the task run: Prefect 3 leaves its task page's own "Cache Key" field empty
            task = STAGE_TASKS[stage].with_options(refresh_cache=not outputs_intact(stage, paths),
                                                   task_run_name=f"{stage} {key}")
            kwargs = {}
            if STAGE_TABLE[stage].live_metrics:  # per-step metrics reach MLflow while the stage runs
                kwargs["on_metrics"] = lambda rows: tracker.train_rows(rows, [tracker.run_id])
            def submit(task):  # quote: no edges guessed from the values passed in; the edges are wait_for's
                return task(quote(prof), quote(paths), cache_key=key, return_state=True,
                            wait_for=[states[u] for u in STAGE_TABLE[stage].upstream], **kwargs)

            state = submit(task)
            result = state.result()
            if (state.name == "Cached" and stage in shared
                    and result.get("outputs_fingerprint") != current_fingerprint(stage, paths)):
                # dvc.yaml's places hold another run's outputs now (dvc repro, or this flow with other params)
                logger.info(f"{stage}: its cached result describes outputs that have since been replaced in "
                            f"{paths.home(stage)}; it runs again")
                state = submit(task.with_options(refresh_cache=True))
                result = state.result()
            states[stage] = state
            cached = state.name == "Cached"
            result["_cached"] = cached
            if cached:
                result["_live_logged"] = False
                logger.info(f"{stage}: unchanged inputs and params, skipped (cached result, cache key {key})")
            link_stage(paths, run, stage, result)
            if cached or result.get("_reused"):  # logged as cached (nothing ran), once a stage runs or at the end
                unlogged.append((stage, result, paths))
            else:
                tracker.log_cached(unlogged)
                tracker.log_stage(stage, result, False, paths)
            results[stage] = result
            artifacts.stage_artifact(name, stage, result, paths, link)
        provenance = {"run_name": run, "params_digest": digest, "keys": dict(paths.keys)}
        all_cached = all(results[s]["_cached"] for s in STAGES)  # reused from DVC: this run records them
        if not all_cached:
            tracker.log_cached(unlogged)
        if shared:  # stages reused from the flow's cache: dvc.lock describes them too
            dvc_share.sync(paths, prof, results, shared, logger.info)
        original = tracker.mark_outputs(prof, paths.key(STAGES[-1]), cached=all_cached)
        if original is not False:
            logger.info(f"every stage unchanged: recorded as a cached run of the outputs of "
                        f"{original or 'a run this MLflow store does not hold'}")
        stage = "register-and-promote"
        registry = Registry.of(prof.promote.registered_model, spec.params, root_dir, tracker.uri)
        decision = (register_and_promote(quote(tracker), quote(prof), quote(results["package"]), quote(registry),
                                         quote(provenance), wait_for=[states["package"]])
                    if promote else None)
        artifacts.package_artifact(name, results["package"], decision)
        tracker.end()
    except (KeyboardInterrupt, SystemExit, CancelledError) as exc:  # Ctrl-C, SIGTERM, a cancelled run
        tracker.stop(stage, exc, "KILLED", unlogged, logger.warning)
        raise
    except BaseException as exc:
        tracker.stop(stage, exc, "FAILED", unlogged, logger.warning)
        raise
    finally:
        workspace.release()
    summary = {"profile": name, "run_name": run, "run_dir": str(view), "mlflow_run_id": tracker.run_id,
               "mlflow_experiment_id": tracker.experiment_id,
               "mlflow_uri": mask_uri(tracker.uri), "experiment": experiment_name(prof, name),
               "mlflow_page": ui_page(prof, tracker.uri, tracker.experiment_id),
               "package": results["package"]["tarball"], "promotion": decision,
               "cached_stages": [s for s in STAGES if results[s].get("_cached")],
               "stages": list(STAGES), "shared_with_dvc": list(shared),
               "reused_from_dvc": [s for s in STAGES if results[s].get("_reused") and not results[s].get("_cached")],
               "original_run_id": original or None,
               "action_error": results["package"].get("action_error")}
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--run-name")
    ns = ap.parse_args(argv)
    print(sft_pipeline(ns.profile, ns.params, ns.set, run_name=ns.run_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
