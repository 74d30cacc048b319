"""MLflow run tracking for the pipeline: one experiment per profile, a parent run per pipeline run, a nested run
per stage with what each stage logs, and the masking of credentials in URIs and logs. The model registry is
`tasks.registry`; serving a registered version (`models:/`) is `tasks.resolver`.

Everything goes through an explicit `MlflowClient` and run ids (no global active run), so logging from a
Prefect task's thread, or live from the train stage's log follower, is safe. The tracking URI is
MLFLOW_TRACKING_URI when set (a team server), else the profile's `tracking.mlflow_uri` (local sqlite).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from dzmodel.config import Profile, RunParams, StagePaths, flatten, profile_dict
from dzmodel.stages.common import files_under

TRAIN_SERIES = ("loss", "action_loss", "dynamics_loss", "lr", "grad_norm", "samples_per_s_per_gpu", "mfu",
                "peak_mem_gib")
MAX_ARTIFACT_MB = float(os.environ.get("DZ_MLFLOW_MAX_ARTIFACT_MB", "2048"))  # bigger files are logged by reference



def _files(path: Path) -> list[Path]:
    return [f for _, f in files_under(path)]


def _bytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def tracking_uri(prof: Profile, root: Path) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or prof.tracking.mlflow_uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        db = root / uri[len("sqlite:///"):]
        db.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{db.resolve()}"
    return uri


_SECRET_PARAM = re.compile(r"token|key|secret|passw|pwd|sig|credential|auth", re.IGNORECASE)


def mask_uri(uri: str) -> str:
    """`uri` fit for a log: the password of user:password@ (a lone user, often a token, entirely) and the values
    of secret-looking query parameters become ***."""
    scheme, sep, rest = uri.partition("://")
    if sep:
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        authority, rest = rest[:end], rest[end:]
        if "@" in authority:  # the last @: an unescaped one inside the password stays masked
            userinfo, host = authority.rsplit("@", 1)
            user, colon, _ = userinfo.partition(":")
            authority = f"{user}:***@{host}" if colon else f"***@{host}"
        uri = f"{scheme}://{authority}{rest}"
    head, question, query = uri.partition("?")
    if not question:
        return uri
    query, hash_, fragment = query.partition("#")
    query = re.sub(r"(?<![^&])([^=&]+)=([^&]*)",
                   lambda m: f"{m[1]}=***" if _SECRET_PARAM.search(m[1]) else m[0], query)
    return f"{head}?{query}{hash_}{fragment}"


_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")


_QUERY_PAIR = re.compile(r"(?<=[?&])([^=&\s'\"]+)=([^&\s'\"#]*)")


def mask_text(text: str) -> str:
    """`text` with every URI in it masked as `mask_uri` masks one, and any secret-looking query parameter
    elsewhere too (a path and query quoted without its host, as urllib3's retry errors quote them)."""
    text = _URI_IN_TEXT.sub(lambda m: mask_uri(m[0]), text)
    return _QUERY_PAIR.sub(lambda m: f"{m[1]}=***" if _SECRET_PARAM.search(m[1]) else m[0], text)


class MaskSecrets(logging.Filter):
    """A handler filter that masks the URIs in each record it passes: its message and its traceback (Prefect's own
    "Task run failed" lines quote the exception, and MLflow's exceptions quote the tracking URI)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed log call: the handler reports it, as it would without this filter
            return True
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask_text(record.exc_text)
            record.exc_info = None  # formatters that rebuild the traceback from the exception would unmask it
        return True


def mask_secrets_in_logs() -> None:
    """Add MaskSecrets to every handler of the root, Prefect and MLflow loggers (once each)."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
                                      if name.split(".")[0] in ("prefect", "mlflow"))]
    for handler in {h for lg in loggers for h in getattr(lg, "handlers", [])}:
        if not any(isinstance(f, MaskSecrets) for f in handler.filters):
            handler.addFilter(MaskSecrets())


def without_credentials(uri: str) -> str:
    """`uri` without user:password@ and query, for a link shown in a UI."""
    return re.sub(r"^([\w+.-]+://)[^/?#]*@", r"\1", uri).split("?", 1)[0].split("#", 1)[0]


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


def ui_page(prof: Profile, uri: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """The MLflow UI page of an experiment (or one of its runs): at `tracking.ui_url` when set, else at the
    tracking URI when it is a server, else where `mlflow ui` serves by default. `workflowType`: MLflow 3's UI
    opens its GenAI view of an experiment unless told otherwise."""
    base = prof.tracking.ui_url or (without_credentials(uri) if uri.startswith(("http://", "https://")) else LOCAL_UI)
    if experiment_id is None:
        return base
    page = f"{base.rstrip('/')}/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "/runs")
    return f"{page}?workflowType=machine_learning"


def experiment_name(prof: Profile, profile: str) -> str:
    return prof.tracking.experiment or f"dreamzero-{profile}"


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    if mask_uri(uri) != uri:  # MLflow prints a link to every run it ends, built from the URI as it is
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# MLflow 3 opens an experiment without this tag in its GenAI (traces) view; ours trains models
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
# a pipeline run's outputs (the cache key of its last stage, which pins every stage's inputs), whether every stage
# was cached, and for such a run the run that made those outputs
OUTPUTS_KEY_TAG, CACHED_TAG, ORIGINAL_RUN_TAG = "dz.outputs_key", "dz.cached", "dz.original_run_id"
EXPERIMENT_KIND = {EXPERIMENT_KIND_TAG: "custom_model_development"}


@contextmanager
def _environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _process_tracking_uri(uri: str):
    """MLflow's process-wide tracking URI set to `uri` inside the block, for what MLflow resolves through it
    rather than through the client it was called on (a registry store reading a models:/<id> source); put back
    as it was after, the MLFLOW_TRACKING_URI variable too (MLflow's own `_use_tracking_uri` unsets it)."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    saved, env = getattr(utils, "_tracking_uri", None), os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved)  # which sets MLFLOW_TRACKING_URI to it too, or unsets it
        if env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env


SYSTEM_METRICS_INTERVAL_S = float(os.environ.get("DZ_SYSTEM_METRICS_INTERVAL_S", "10"))


@lru_cache(maxsize=1)
def _run_context_tags() -> dict[str, str]:
    """The tags MLflow's own `start_run` gives a run: who started it (`mlflow.user`, the UI's "Created by") and
    from where (`mlflow.source.name`, `mlflow.source.type`). An explicit client's `create_run` sets none of them."""
    from mlflow.tracking.context.registry import resolve_tags
    from mlflow.utils.mlflow_tags import MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE, MLFLOW_USER

    tags = resolve_tags()
    return {k: tags[k] for k in (MLFLOW_USER, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE) if tags.get(k)}


def _system_metrics(uri: str, run_id: str):
    """MLflow's system metrics (CPU, memory, disk, network; GPU utilisation and memory where pynvml is installed)
    sampled into the pipeline run every DZ_SYSTEM_METRICS_INTERVAL_S seconds (0: off)."""
    if SYSTEM_METRICS_INTERVAL_S <= 0:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, tracking_uri=uri)
        monitor.start()
        return monitor
    except ImportError:  # psutil missing
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def end_stale_runs(client, experiment_id: str) -> list[str]:
    """Mark FAILED the pipeline runs of this experiment left RUNNING by a process of this host that is gone
    (killed with SIGKILL, or the machine rebooted), with their nested stage runs; runs of other hosts are left
    alone, since their processes cannot be checked from here. Returns the run ids it ended."""
    host = socket.gethostname()
    ended = []
    for run in client.search_runs([experiment_id], "tags.pipeline = 'sft_pipeline' and attributes.status = 'RUNNING'"):
        tags = run.data.tags
        pid = tags.get("dz.pid", "")
        if tags.get("dz.host") != host or not pid.isdigit() or _process_alive(int(pid)):
            continue
        children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}' "
                                                       "and attributes.status = 'RUNNING'")
        for stale in [*children, run]:
            client.set_tag(stale.info.run_id, "dz.ended", f"stale: its process {pid} on {host} is gone")
            client.set_terminated(stale.info.run_id, status="FAILED")
            ended.append(stale.info.run_id)
    return ended


@dataclass
class Tracker:
    """The parent run of one pipeline run, and helpers to log each stage into a nested run under it."""
    uri: str = field(repr=False)  # may hold credentials
    experiment_id: str
    run_id: str
    profile: str
    monitor: object = field(default=None, repr=False, compare=False)  # MLflow's system metrics sampler

    @classmethod
    def start(cls, prof: Profile, profile: str, paths: StagePaths, run_name: str | None = None,
              tags: dict[str, str] | None = None, description: str | None = None) -> "Tracker":
        """The parent run of profile `profile`'s run, its params logged."""
        return cls._begin(prof, profile, paths, flatten(profile_dict(prof)), run_name, tags, description)

    @classmethod
    def open(cls, run: RunParams, paths: StagePaths, run_name: str | None = None, tags: dict[str, str] | None = None,
             description: str | None = None) -> "Tracker":
        """`start` for params loaded once (`load_run`)."""
        return cls._begin(run.prof, run.name, paths, run.flat, run_name, tags, description)

    @classmethod
    def _begin(cls, prof: Profile, profile: str, paths: StagePaths, flat: dict, run_name: str | None,
               tags: dict[str, str] | None, description: str | None) -> "Tracker":
        from mlflow.entities import Param

        uri = tracking_uri(prof, paths.root)
        client = _client(uri)
        name = experiment_name(prof, profile)
        exp = client.get_experiment_by_name(name)
        if exp is None:
            artifacts = None
            if uri.startswith("sqlite:"):  # local default: a file artifact store beside the database
                artifacts = (paths.root / prof.tracking.artifact_root).resolve().as_uri()
            exp_id = client.create_experiment(name, artifact_location=artifacts,
                                              tags={"profile": profile, **EXPERIMENT_KIND})
        else:
            exp_id = exp.experiment_id
            if exp.tags.get(EXPERIMENT_KIND_TAG) is None:  # made before the kind was set: MLflow's GenAI view
                client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND[EXPERIMENT_KIND_TAG])
        end_stale_runs(client, exp_id)
        all_tags = {**_run_context_tags(), "profile": profile, "pipeline": "sft_pipeline",
                    "dz.host": socket.gethostname(), "dz.pid": str(os.getpid()), **(tags or {})}
        commit = _git_commit(paths.root)
        if commit:
            all_tags["mlflow.source.git.commit"] = commit
        if description:
            all_tags["mlflow.note.content"] = description
        run = client.create_run(exp_id, run_name=run_name or f"sft-{profile}-{time.strftime('%Y%m%d-%H%M%S')}",
                                tags=all_tags)
        params = [Param(k, mask_uri(json.dumps(v) if not isinstance(v, str) else v))  # tracking.mlflow_uri, ...
                  for k, v in flat.items()]
        params = [Param(p.key[:250], p.value[:6000]) for p in params]
        for i in range(0, len(params), 100):
            client.log_batch(run.info.run_id, params=params[i:i + 100])
        return cls(uri, exp_id, run.info.run_id, profile, monitor=_system_metrics(uri, run.info.run_id))

    @property
    def client(self):
        return _client(self.uri)

    def stage_run(self, stage: str, cached: bool) -> str:
        run = self.client.create_run(self.experiment_id, run_name=stage, tags={
            **_run_context_tags(), "mlflow.parentRunId": self.run_id, "stage": stage, "cached": str(cached).lower(),
            "profile": self.profile})
        return run.info.run_id

    def mark_outputs(self, prof: Profile, outputs_key: str, cached: bool) -> str | None | bool:
        """Tag the run with the cache key of its last stage's outputs (`dz.outputs_key`, which pins every stage's
        inputs) and whether every stage was cached (`dz.cached`). A cached run also points at the earliest
        uncached run of the same outputs (`dz.original_run_id`, a line of its description): its id is returned,
        or None when this store holds no such run; False for a run that computed something."""
        client = self.client
        client.set_tag(self.run_id, OUTPUTS_KEY_TAG, outputs_key)
        client.set_tag(self.run_id, CACHED_TAG, str(cached).lower())
        if not cached:
            return False
        runs = client.search_runs([self.experiment_id], f"tags.`{OUTPUTS_KEY_TAG}` = '{outputs_key}'",
                                  order_by=["attributes.start_time ASC"], max_results=100)
        original = next((r for r in runs if r.info.run_id != self.run_id and r.data.tags.get(CACHED_TAG) == "false"),
                        None)
        run = client.get_run(self.run_id)
        note = run.data.tags.get("mlflow.note.content", "")
        if original is None:
            note += "\nEvery stage was cached; the run that made these outputs is not in this MLflow store.\n"
        else:
            client.set_tag(self.run_id, ORIGINAL_RUN_TAG, original.info.run_id)
            link = ui_page(prof, self.uri, self.experiment_id, original.info.run_id)
            name = original.info.run_name or original.info.run_id
            note += f"\nEvery stage was cached: the outputs, metrics and curves are those of run [{name}]({link}).\n"
        client.set_tag(self.run_id, "mlflow.note.content", note)
        return None if original is None else original.info.run_id

    def record_failure(self, stage: str, exc: BaseException, status: str = "FAILED") -> None:
        """Why the run stopped: the stage that was running (a nested run of its own, ended with `status`) and the
        error, as tags of both (`failed_stage` or `killed_stage`, `error`: its first line) and the full text as
        the nested run's `error.txt`."""
        text = mask_text(f"{type(exc).__name__}: {exc}".strip())
        first = (text.splitlines() or [type(exc).__name__])[0][:500]
        which = "killed_stage" if status == "KILLED" else "failed_stage"
        self.client.set_tag(self.run_id, which, stage)
        self.client.set_tag(self.run_id, "error", first)
        child = self.stage_run(stage, cached=False)
        self.client.set_tag(child, "error", first)
        self.client.log_text(child, text + "\n", "error.txt")
        self.end(child, status=status)

    def log_cached(self, unlogged: list[tuple]) -> None:
        """The nested runs of the cached stages (stage, result, paths) not logged yet; empties the list."""
        try:
            for stage, result, paths in unlogged:
                self.log_stage(stage, result, True, paths)
        finally:
            unlogged.clear()

    def stop(self, stage: str, exc: BaseException, status: str, unlogged: list[tuple], warn=None) -> None:
        """End a run that failed (or was killed) in `stage`: the cached stages' runs, the error, the status. A store
        that cannot take them does not hide the error itself (a warning instead)."""
        try:
            self.log_cached(unlogged)
        finally:
            try:
                self.record_failure(stage, exc, status)
            except Exception as problem:  # noqa: BLE001  (the original error is what the user must see)
                (warn or logging.getLogger(__name__).warning)(
                    f"MLflow: could not record the {stage} stage's error ({problem})")
            self.end(status=status)

    def end(self, run_id: str | None = None, status: str = "FINISHED") -> None:
        if run_id in (None, self.run_id) and self.monitor is not None:
            self.monitor.finish()  # its last samples, before the run ends
            self.monitor = None
        self.client.set_terminated(run_id or self.run_id, status=status)

    # -- logging helpers --------------------------------------------------------------------------------

    def _log_metrics(self, batch: list, run_ids) -> None:
        for rid in run_ids:
            for i in range(0, len(batch), 500):  # MLflow's log_batch takes at most 1000 metrics
                self.client.log_batch(rid, metrics=batch[i:i + 500])

    def metrics(self, run_id: str, values: dict[str, float], step: int = 0, also_parent: bool = True) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in values.items() if isinstance(v, (int, float))]
        self._log_metrics(batch, {run_id, self.run_id} if also_parent else {run_id})

    def train_rows(self, rows: list[dict], run_ids: list[str]) -> None:
        """Per-step training series (live from the metrics.jsonl follower, or all at once afterwards)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(r[k]), now, int(r["step"])) for r in rows for k in TRAIN_SERIES if k in r]
        self._log_metrics(batch, run_ids)

    def artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> bool:
        """A file or directory as an artifact; past MAX_ARTIFACT_MB, a reference (path, size) instead.
        True when the content itself was logged."""
        path = Path(path)
        if not path.exists():
            return False
        if _bytes(_files(path)) > MAX_ARTIFACT_MB * 2**20:
            self.reference(run_id, path, artifact_path)
            return False
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path or path.name)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)
        return True

    def reference(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        files = _files(path)
        ref = {"path": str(path.resolve()), "files": len(files), "bytes": _bytes(files)}
        name = f"{artifact_path or ''}/{path.name}.ref.json".lstrip("/")
        self.client.log_dict(run_id, ref, name)

    def log_stage(self, stage: str, result: dict, cached: bool, paths: StagePaths) -> str:
        """A nested run with what the stage measured and wrote."""
        rid = self.stage_run(stage, cached)
        self.metrics(rid, {f"{stage}.seconds": result.get("seconds", 0.0)}, also_parent=False)
        log = getattr(self, f"_log_{stage}", None)
        if log is not None:
            log(rid, result, paths)
        else:  # a stage without logging of its own: its headline numbers and plots
            self._log_summary(stage, rid, result)
        self.client.log_dict(rid, result, f"{stage}_result.json")
        self.end(rid)
        return rid

    def _log_summary(self, stage, rid, result):
        """What any stage's result names: the numbers of its `summary` (as <stage name>.<key>) and its plots."""
        numbers = {f"{stage}.{k}": float(v) for k, v in (result.get("summary") or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            self.metrics(rid, numbers, also_parent=False)
        for plot in result.get("plots") or []:
            self.artifact(rid, plot, "plots")

    def _log_fetch(self, rid, result, paths):
        self.metrics(rid, {"dataset.episodes": result["episodes"], "dataset.frames": result["frames"]})
        self.log_dataset([rid, self.run_id], result, paths)
        marker = paths.data / "dataset.dz_fetch.json"
        if marker.is_file():
            self.artifact(rid, marker, "dataset")

    def log_dataset(self, run_ids: list[str], result: dict, paths: StagePaths) -> None:
        """The training dataset as an MLflow dataset input (name, source, content digest, episodes and frames)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        from dzmodel.stages.common import content_fingerprint

        marker = paths.data / "dataset.dz_fetch.json"
        fetched = json.loads(marker.read_text()) if marker.is_file() else {}
        source = str(fetched.get("source") or result.get("dataset"))
        revision = fetched.get("revision")
        dataset = Dataset(name=Path(source).name if "/" in source else source,
                          digest=content_fingerprint(Path(result["dataset"])),
                          source_type="huggingface" if fetched.get("kind") == "hub" else "local",
                          source=json.dumps({"uri": f"{source}@{revision}" if revision else source,
                                             "path": result["dataset"]}),
                          profile=json.dumps({"episodes": result["episodes"], "frames": result["frames"],
                                              "fps": result["fps"], "views": result.get("views", [])}))
        inputs = [DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "training")])]
        for rid in run_ids:
            self.client.log_inputs(rid, datasets=inputs)

    def _log_metadata(self, rid, result, paths):
        self.artifact(rid, paths.metadata, "metadata")
        self.artifact(rid, paths.metadata.parent / "statistics.csv", "metadata")

    def _log_vision(self, rid, result, paths):
        if result.get("vision") is None:  # disabled
            return
        self.metrics(rid, {"vision.heldout_mse": result["heldout_mse"],
                           "vision.heldout_mse_random": result["heldout_mse_random"],
                           "vision.steps": result["steps"]})
        self.artifact(rid, Path(result["vision"]) / "report.json", "vision")

    def _log_train(self, rid, result, paths):
        s = result["summary"]
        summary = {"train.final_loss": s["loss"], "train.final_action_loss": s["action_loss"],
                   "train.final_dynamics_loss": s["dynamics_loss"],
                   "train.samples_per_s_per_gpu": s["samples_per_s_per_gpu"], "train.mfu": s.get("mfu"),
                   "train.peak_mem_gib": s["peak_mem_gib"], "train.steps": s["steps"]}
        self.metrics(rid, {k: v for k, v in summary.items() if v is not None})  # no MFU on a CPU
        from dzmodel.stages.train import read_metrics

        rows = read_metrics(Path(result["train_dir"]) / "metrics.jsonl")
        self.train_rows(rows, [rid] if result.get("_live_logged") else [rid, self.run_id])
        for plot in result.get("plots", []):
            self.artifact(rid, plot, "plots")
            self.artifact(self.run_id, plot, "plots")
        self.artifact(rid, paths.train_config, "config")
        from dzmodel.train.checkpoint import list_checkpoints

        ckpts = [{"step": s, "path": str(p.resolve()), "bytes": _bytes(_files(p))}
                 for s, p in list_checkpoints(result["train_dir"])]
        self.client.log_dict(rid, {"checkpoints": ckpts}, "checkpoints.json")  # references: DCP shards stay put

    def _log_convert(self, rid, result, paths):
        self.client.log_dict(rid, {"converted": result["converted"], "steps": result["steps"]}, "converted.json")

    def _log_eval(self, rid, result, paths):
        self._log_action_error(rid, result.get("action_error"), Path(result["eval_dir"]) / "action_error")
        action_plot = paths.plots("eval") / "action_error_vs_step.png"
        if action_plot.is_file() and (result.get("action_error") or {}).get("measured"):
            self.artifact(rid, action_plot, "plots")
            self.artifact(self.run_id, action_plot, "plots")
        if result.get("previews"):  # decoded predicted video beside the real frames, per converted step
            self.artifact(rid, Path(result["eval_dir"]) / "previews", "eval/previews")
            for preview in result["previews"]:  # latent errors per step (None or absent: `metrics` drops them)
                if preview["step"] is not None:
                    self.metrics(rid, {"previews.latent_mse": preview.get("latent_mse"),
                                       "previews.still_latent_mse": preview.get("still_latent_mse")},
                                 step=int(preview["step"]))
        if not result.get("evaluated"):
            return
        for row in result.get("curve") or result["rows"]:  # success vs step: one point per evaluated step
            if row["step"] is None:
                continue
            if row["task"] == "all":
                values = {"eval.success_rate": row["rate"], "eval.success_rate.ci_low": row.get("ci_low"),
                          "eval.success_rate.ci_high": row.get("ci_high"), "eval.episodes": row.get("episodes")}
            else:
                values = {f"eval.success_rate.task_{row['task']}": row["rate"]}
            self.metrics(rid, values, step=int(row["step"]))
        best = result.get("best") or {}
        if best:
            self.metrics(rid, {"eval.best_success_rate": best["rate"], "eval.best_step": best["step"] or 0})
        out = Path(result["eval_dir"])
        for name in ("results.csv", "episodes.csv", "summary.json", "success_vs_step.png"):
            self.artifact(rid, out / name, "eval")
        plot = Path(result["plot"]) if result.get("plot") else out / "success_vs_step.png"
        if plot.is_file():  # the curve across steps (the stage's plots), else the evaluation's own plot
            self.artifact(rid, plot, "plots")
            self.artifact(rid, plot.with_suffix(".csv"), "plots")
            self.artifact(self.run_id, plot, "plots")
        if (out / "videos").is_dir():
            self.artifact(rid, out / "videos", "eval/videos")

    def _log_action_error(self, rid, action: dict | None, out: Path) -> None:
        """Held-out action error per step (action_error.trained, .ratio), and the run's two references."""
        if not action or not action.get("measured"):
            return
        for row in action["steps"]:
            if row["step"] is not None:
                self.metrics(rid, {"action_error.trained": row["trained"], "action_error.ratio": row["ratio"]},
                             step=int(row["step"]))
        refs = {"action_error.mean_predictor": action["mean_predictor"], "action_error.windows": action["windows"]}
        if action.get("untrained") is not None:
            refs["action_error.untrained"] = action["untrained"]
        self.metrics(rid, refs)
        for name in ("action_error.json", "action_error.csv"):
            self.artifact(rid, out / name, "eval/action_error")

    def _log_package(self, rid, result, paths):
        self.metrics(rid, {"package.step": result["step"]})
        self.artifact(rid, result["tarball"], "package")
        self.client.set_tag(self.run_id, "package.tarball", result["tarball"])

    # -- registry -------------------------------------------------------------------------------------
