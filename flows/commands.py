"""`dz pipeline run`, `dz deploy`, `dz promote` and `dz registry list`: the commands that need Prefect or MLflow. They join the `dz`
CLI through the `dz.commands` entry point (pyproject.toml), so the library itself never imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

from dzmodel.clitools import CLIError

PROJECT = Path(__file__).resolve().parents[1]


def _params_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params.yaml", help="the parameters file (relative to --root)")
    p.add_argument("--profile", help="default: params.yaml's `profile`")
    p.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="override one parameter of the profile, e.g. train.steps=20 (repeatable)")
    p.add_argument("--root", default=".", help="the project root (data/, runs/, mlruns/ go under it)")


QUIET = {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def project_environment(root: Path) -> dict[str, str]:
    """The defaults `make demo` sets, set here too (unless already set), so that `dz pipeline run` from the README
    behaves as the Makefile's: Prefect's database and task cache in the project (.prefect), the LIBERO config
    that `make setup` wrote, software rendering, no telemetry, and time for Prefect's temporary server to start
    on a busy 2-core machine (its default, 20 s, was seen to run out). Returns what it set."""
    defaults = {"PREFECT_HOME": str(root / ".prefect"), "MUJOCO_GL": "egl",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", **QUIET}
    libero = Path(sys.prefix) / "libero_config"
    if (libero / "config.yaml").is_file():
        defaults["LIBERO_CONFIG_PATH"] = str(libero)
    set_here = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(set_here)
    return set_here


def where_to_look(summary: dict, root: Path) -> str:
    from tasks.tracking import LOCAL_UI, mask_uri

    venv = os.path.relpath(Path(sys.executable).parent, Path.cwd())
    uri = mask_uri(summary["mlflow_uri"])
    lines = [
        "",
        f"Pipeline finished: profile {summary['profile']}, cached stages: {', '.join(summary['cached_stages']) or 'none'}",
        f"  package     {summary['package']}",
    ]
    if summary.get("reused_from_dvc"):
        lines.append(f"  from DVC    {', '.join(summary['reused_from_dvc'])}: dvc.lock held these outputs for the same "
                     "inputs; nothing ran")
    if summary.get("original_run_id"):
        lines.append(f"  cached run  every stage was cached: MLflow run {summary['mlflow_run_id']} points at "
                     f"{summary['original_run_id']}, the run that made these outputs")
    if summary.get("action_error"):
        a = summary["action_error"]
        untrained = "" if a.get("untrained") is None else f", untrained {a['untrained']:.2g}"
        lines.append(f"  held-out    action error {a['trained']:.2g} (mean predictor {a['mean_predictor']:.2g}{untrained}), "
                     f"ratio {a['ratio']:.2f} at step {a['step']}")
    if summary.get("promotion"):
        p = summary["promotion"]
        again = " (already registered: the same bundle)" if str(p.get("registered", "")).startswith("unchanged") else ""
        lines.append(f"  registry    {p['registered_model']} v{p['version']}{again}: {p['reason']}")
        if p.get("promoted"):
            lines.append(f"  serve       DZ_SERVE_TOKEN=<secret> {venv}/dz serve models:/{p['registered_model']}@{p['alias']}"
                         "   (docs/deploy.md)")
    page = summary.get("mlflow_page") or LOCAL_UI
    if uri.startswith("sqlite:"):
        port = urllib.parse.urlsplit(page).port or 5000
        lines.append(f"  MLflow UI   {venv}/mlflow ui --backend-store-uri {uri} --port {port}   "
                     f"(then {page}, experiment {summary['experiment']})")
    else:
        lines.append(f"  MLflow      {uri} (experiment {summary['experiment']}, run {summary['mlflow_run_id']})")
        if summary.get("mlflow_page"):
            lines.append(f"  MLflow UI   {summary['mlflow_page']}")
    home = os.environ.get("PREFECT_HOME", "~/.prefect")
    if os.environ.get("PREFECT_API_URL"):
        lines.append(f"  Prefect UI  {mask_uri(os.environ['PREFECT_API_URL'].removesuffix('/api'))}")
    else:
        lines.append(f"  Prefect UI  PREFECT_HOME={home} {venv}/prefect server start   (then http://127.0.0.1:4200)")
    if summary.get("run_dir"):
        lines.append(f"  run         {summary['run_name']}: {summary['run_dir']}  (outputs, metrics/, plots/)")
    shared = summary.get("shared_with_dvc") or []
    if len(shared) == len(summary.get("stages") or shared) and shared:
        lines.append("  DVC         every stage is in dvc.lock and DVC's cache: `make repro` and `dvc exp run` rerun "
                     "only what a change reaches")
    elif shared:
        lines.append(f"  DVC         {', '.join(shared)} in dvc.lock and DVC's cache (the stages whose params are "
                     "params.yaml's); the others under their cache keys")
    else:
        lines.append(f"  DVC         make repro: the same stages through `dvc repro`, into {root}/runs/{summary['profile']}/")
    return "\n".join(lines)


def _exit_on_sigterm() -> None:
    """SIGTERM (a scheduler stopping the job, `kill`) unwinds like Ctrl-C: the stage's subprocess is stopped and
    the MLflow run ends KILLED instead of staying RUNNING."""
    import signal

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def cmd_pipeline_run(ns: argparse.Namespace) -> int:
    from dzmodel.config import load_params

    root = Path(ns.root).resolve()
    # bad parameters (a misspelt profile, an unknown --set key) are one error now, before Prefect is imported or
    # any server is started or touched
    load_params(root / ns.params, ns.set, ns.profile)
    project_environment(root)  # before Prefect is imported: it reads PREFECT_HOME once
    from flows.sft_pipeline import sft_pipeline

    _exit_on_sigterm()
    summary = sft_pipeline(ns.profile, ns.params, ns.set, str(root), promote=not ns.no_promote, run_name=ns.run_name)
    if ns.summary_json:
        Path(ns.summary_json).write_text(json.dumps(summary, indent=1, default=str))
    print(where_to_look(summary, root))
    return 0


def cmd_pipeline_gc(ns: argparse.Namespace) -> int:
    from dzmodel.config import StagePaths, load_params
    from dzmodel.runs import collect_garbage

    root = Path(ns.root).resolve()
    params = load_params(root / ns.params, [], ns.profile)
    name = ns.profile or params.profile
    report = collect_garbage(StagePaths(root, name, keyed=True), keep=ns.keep, dry_run=ns.dry_run)
    verb = "would remove" if ns.dry_run else "removed"
    for view in report["views_removed"]:
        print(f"{verb} run view runs/{name}/{view}")
    for folder in report["outputs_removed"]:
        print(f"{verb} {folder}")
    print(f"{verb} {len(report['views_removed'])} run views and {len(report['outputs_removed'])} stage outputs "
          f"({report['bytes_freed'] / 2**20:.1f} MiB); kept {len(report['views_kept'])} runs")
    return 0


def _profile_and_store(ns: argparse.Namespace):
    """The profile `--profile` (or params.yaml's) names, with `--set` applied, and its MLflow tracking URI."""
    from dzmodel.config import StagePaths, load_params
    from tasks.tracking import tracking_uri

    params = load_params(Path(ns.root) / ns.params, ns.set, ns.profile)
    name = ns.profile or params.profile
    prof = params.selected(name)
    return prof, tracking_uri(prof, StagePaths(Path(ns.root).resolve(), name).root), params


def cmd_promote(ns: argparse.Namespace) -> int:
    from tasks.registry import promote, registered_head_to_head, registered_health
    from tasks.resolver import Registry

    prof, uri, params = _profile_and_store(ns)
    p = prof.promote
    gate = p.min_success if ns.min_success is None else ns.min_success
    ratio = p.max_action_error_ratio if ns.max_action_error_ratio is None else ns.max_action_error_ratio
    registry = Registry.of(p.registered_model, params, Path(ns.root), uri)
    # like the flow: no worse than the model holding the alias, on the candidate's held-out windows
    alias = ns.alias or p.alias
    if ns.reason is not None and not ns.reason.strip():
        raise CLIError("--reason: say why the comparison with the current model is skipped (it is recorded)")
    if ns.reason is not None and ns.version is None:
        raise CLIError("--reason needs --version: an override names the version it moves the alias to")
    decision = promote(uri, p.registered_model, ns.version, alias, gate, max_action_error_ratio=ratio,
                       max_regression=p.max_regression,
                       comparison=lambda version: registered_head_to_head(uri, prof, version, registry, alias),
                       health=lambda version: registered_health(uri, prof, version, registry),
                       override_reason=ns.reason.strip() if ns.reason else None)
    print(f"{decision['registered_model']} v{decision['version']} -> alias {decision['alias']}: {decision['reason']}")
    return 0 if decision["promoted"] else 1


def cmd_registry_list(ns: argparse.Namespace) -> int:
    from tasks.registry import registry_listing
    from tasks.resolver import RegistryError
    from tasks.tracking import mask_uri

    prof, uri, _ = _profile_and_store(ns)
    model = prof.promote.registered_model
    try:
        rows = registry_listing(uri, model)
    except RegistryError as exc:
        raise CLIError(str(exc)) from None
    if ns.json:
        print(json.dumps({"registered_model": model, "tracking_uri": mask_uri(uri), "versions": rows}, indent=1))
        return 0
    print(f"{model} at {mask_uri(uri)}: {len(rows)} version(s), newest first")
    print(f"{'version':>7}  {'aliases':<14} {'created':<16}  {'success':>7}  {'ae ratio':>8}  {'gate':<8} run")
    for r in rows:
        aliases = ",".join("@" + a for a in r["aliases"]) or "-"
        print(f"{r['version']:>7}  {aliases:<14} {r['created']:<16}  {_cell(r['success_rate'], '.1%'):>7}  "
              f"{_cell(r['action_error_ratio'], '.2f'):>8}  {r['promotion'] or '-':<8} {r['run_id'] or '-'}")
        if r["promotion_reason"]:
            print(f"{'':9}why: {r['promotion_reason']}")
        if r["override"]:
            print(f"{'':9}override: {r['override']}")
    return 0


def _cell(text: str, spec: str) -> str:
    try:
        return format(float(text), spec)
    except ValueError:
        return "-"


def cmd_track(ns: argparse.Namespace) -> int:
    from flows.dvc_tracking import TrackError, track

    root = Path(ns.root).resolve()
    project_environment(root)
    _exit_on_sigterm()
    try:
        summary = track(root, ns.params, ns.set, ns.profile, promote=not ns.no_promote)
    except TrackError as exc:
        print(f"dz track: {exc}", file=sys.stderr)
        return 2
    print(f"MLflow run {summary['run_name']} ({summary['mlflow_run_id']}) in experiment {summary['experiment']} "
          f"({summary['mlflow_uri']}): {summary['mlflow_page']}"
          + ("; the registry's decision is above" if summary["promotion"] else ""))
    return 0


def _prefect(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    exe = shutil.which("prefect", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None:
        raise SystemExit("dz deploy: the prefect CLI is not installed (make setup)")
    out = subprocess.run([exe, *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise SystemExit(f"dz deploy: prefect {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    return out


def cmd_deploy(ns: argparse.Namespace) -> int:
    """Create the work pool and the gpu-pool concurrency limit if missing, then `prefect deploy` prefect.yaml."""
    if not os.environ.get("PREFECT_API_URL"):
        print("dz deploy: set PREFECT_API_URL to your Prefect server (e.g. http://127.0.0.1:4200/api); "
              "a deployment needs a server that outlives this command", file=sys.stderr)
        return 2
    project = Path(os.environ.get("DZ_PROJECT_DIR") or PROJECT).resolve()
    missing = [f for f in ("params.yaml", "prefect.yaml", "flows/sft_pipeline.py") if not (project / f).is_file()]
    if missing:
        print(f"dz deploy: {project} (DZ_PROJECT_DIR) is not the project's checkout: it has no {', '.join(missing)}. "
              "Set DZ_PROJECT_DIR to the checkout the worker runs the flow from", file=sys.stderr)
        return 2
    if _prefect("work-pool", "inspect", ns.pool, check=False).returncode != 0:
        _prefect("work-pool", "create", ns.pool, "--type", "process")
        print(f"created work pool {ns.pool} (process)")
    if _prefect("concurrency-limit", "inspect", "gpu-pool", check=False).returncode != 0:
        _prefect("concurrency-limit", "create", "gpu-pool", str(ns.gpu_slots))
        print(f"created tag concurrency limit gpu-pool = {ns.gpu_slots}")
    args = ["deploy", "--prefect-file", str(Path(ns.prefect_file).resolve()), "--name", ns.name, "--pool", ns.pool]
    if ns.cron:
        args += ["--cron", ns.cron]
    for item in ns.param or []:
        args += ["--param", item]
    # the worker's flow-run process reads the checkout from here (prefect.yaml's pull step), set or not on its machine
    args += ["--job-variable", json.dumps({"env": {"DZ_PROJECT_DIR": str(project), **QUIET}})]
    out = _prefect(*args)
    print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "deployed")
    print(f"the worker runs it from {project} (DZ_PROJECT_DIR, recorded in the deployment's job variables)")
    print(f"deployment sft-pipeline/{ns.name} on work pool {ns.pool}; start a worker: "
          f"prefect worker start --pool {ns.pool}")
    return 0


def register(sub) -> None:
    """Add the pipeline commands to `dz` (called by dzmodel.cli through the dz.commands entry point)."""
    from importlib.util import find_spec

    if find_spec("prefect") is None or find_spec("mlflow") is None:  # not importing them: `dz` starts fast
        raise ImportError("the pipeline commands need prefect and mlflow (make setup)")
    from dzmodel.clitools import example

    pipe = sub.add_parser("pipeline", help="the Prefect flow: every stage, MLflow tracking, registry")
    pipe = pipe.add_subparsers(dest="cmd", required=True)
    p = pipe.add_parser("run", help="run sft_pipeline on one profile (unchanged stages come from the cache)",
                        epilog=example("dz pipeline run --profile demo --set train.lr=2e-3",
                                       "dz pipeline run --profile libero_object --no-promote"))
    _params_args(p)
    p.add_argument("--no-promote", action="store_true", help="register nothing, set no alias")
    p.add_argument("--summary-json", help="also write the run's summary here")
    p.add_argument("--run-name", help="default: <profile>-<params digest>-<n>; names the Prefect flow run, the MLflow "
                                      "run and runs/<profile>/<name>/")
    p.set_defaults(func=cmd_pipeline_run)

    p = pipe.add_parser("gc", help="remove old run views and the stage outputs (by cache key) no kept run uses",
                        epilog=example("dz pipeline gc --profile demo --dry-run", "dz pipeline gc --keep 3"))
    p.add_argument("--params", default="params.yaml", help="the parameters file (relative to --root)")
    p.add_argument("--profile", help="default: params.yaml's `profile`")
    p.add_argument("--root", default=".", help="the project root")
    p.add_argument("--keep", type=int, default=10, help="the newest run views to keep (and `latest`)")
    p.add_argument("--dry-run", action="store_true", help="list what would go; remove nothing")
    p.set_defaults(func=cmd_pipeline_gc)

    p = sub.add_parser("promote", help="set the deployment alias on a registered version if it passes the gate",
                       epilog=example("dz promote --profile demo", "dz promote --profile demo --version 3 "
                                                                   "--min-success 0.5",
                                      "dz promote --profile demo --version 1 --reason 'rollback: v2 drops grasps'"))
    _params_args(p)
    p.add_argument("--version", help="model version (default: the newest)")
    p.add_argument("--reason", help="move the alias without comparing with the model that holds it (a rollback): "
                                    "the reason is recorded on the version; the other gates and the health check "
                                    "still apply; needs --version")
    p.add_argument("--alias", help="default: the profile's promote.alias")
    p.add_argument("--min-success", type=float, help="default: the profile's promote.min_success")
    p.add_argument("--max-action-error-ratio", type=float,
                   help="held-out action error / the mean predictor's; default: promote.max_action_error_ratio")
    p.set_defaults(func=cmd_promote)

    reg = sub.add_parser("registry", help="the model registry: versions, aliases and gate decisions")
    reg = reg.add_subparsers(dest="cmd", required=True)
    p = reg.add_parser("list", help="every version of the profile's registered model, newest first, with its "
                                    "aliases, gate measures, last decision and the run that registered it",
                       epilog=example("dz registry list --profile demo", "dz registry list --profile demo --json"))
    _params_args(p)
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.set_defaults(func=cmd_registry_list)

    p = sub.add_parser("track", help="log the stage records of `dvc repro` as an MLflow run, register and promote "
                                     "(dvc.yaml's last stage)",
                       epilog=example("dz track --profile demo", "dz track --profile demo --no-promote"))
    _params_args(p)
    p.add_argument("--no-promote", action="store_true", help="register nothing, set no alias")
    p.set_defaults(func=cmd_track)

    p = sub.add_parser("deploy", help="register the scheduled deployment of prefect.yaml on a Prefect server",
                       epilog=example("dz deploy", "dz deploy --cron '0 2 * * *' --gpu-slots 2"))
    p.add_argument("--prefect-file", default=str(PROJECT / "prefect.yaml"),
                   help="the Prefect deployment file (default: the project's prefect.yaml)")
    p.add_argument("--name", default="nightly", help="the deployment in prefect.yaml")
    p.add_argument("--pool", default="gpu-pool", help="work pool (created as type process if missing)")
    p.add_argument("--gpu-slots", type=int, default=1, help="concurrency of tasks tagged gpu-pool")
    p.add_argument("--cron", help="override the schedule, e.g. '0 2 * * *'")
    p.add_argument("--param", action="append", help="override a flow parameter: key=value")
    p.set_defaults(func=cmd_deploy)
