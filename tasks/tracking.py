"""MLflow for the pipeline: one experiment per profile, a parent run per pipeline run, a nested run per stage,
and the model registry (registration and the gated deployment alias).

Everything goes through an explicit `MlflowClient` and run ids (no global active run), so logging from a
Prefect task's thread, or live from the train stage's log follower, is safe. The tracking URI is
MLFLOW_TRACKING_URI when set (a team server), else the profile's `tracking.mlflow_uri` (local sqlite).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from dzmodel.config import Profile, StagePaths, flatten, profile_dict
from dzmodel.stages.common import files_under
from dzmodel.atomic import link_or_copy
from dzmodel.serve.bundles import MANIFEST, file_sha256, parse_manifest

TRAIN_SERIES = ("loss", "action_loss", "dynamics_loss", "lr", "grad_norm", "samples_per_s_per_gpu", "mfu",
                "peak_mem_gib")
MAX_ARTIFACT_MB = float(os.environ.get("DZ_MLFLOW_MAX_ARTIFACT_MB", "2048"))  # bigger files are logged by reference
POLICY_MODEL_TYPE = "dreamzero-policy"  # the logged pyfunc model's type (its name is the bundle's)
MANIFEST_SHA256_TAG = "bundle.manifest_sha256"  # on each model version: the sha256 of its bundle's MANIFEST
POLICY_SHA256_TAG = "bundle.policy_sha256"      # ... and of the MANIFEST lines of what the served policy reads
# bundle files that record how a policy was made, not what it does: a bundle that differs from a registered one only
# in these (another run's paths in the training record, another evaluation) holds the same policy
RECORD_FILES = ("MODEL_CARD.md", "model/experiment_cfg/train_config.json")
RECORD_DIRS = ("eval/",)


def policy_sha256(bundle: Path) -> str:
    """The sha256 of the bundle's MANIFEST lines (checksum, size, path) without the record files: the weights,
    the model and tokenizer configs, the statistics, the embodiment and robot files."""
    entries = parse_manifest((bundle / MANIFEST).read_text(), str(bundle / MANIFEST))
    kept = [f"{sha}  {size}  {path}" for path, (sha, size) in entries.items()
            if not (path in RECORD_FILES or path.startswith(RECORD_DIRS))]
    return hashlib.sha256("\n".join(sorted(kept)).encode()).hexdigest()
BUNDLE_ROOTS_ENV = "DZ_BUNDLE_ROOTS"  # more folders (os.pathsep-separated) that registry references may point into


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


def policy_signature(bundle: Path):
    """(signature, input example) of the policy a bundle holds, read from its model's configuration (train config,
    embodiment, statistics) without loading the weights; ValueError, saying why, when it holds none to read.

    Inputs, as `predict` takes them (the embodiment's `serve:` keys, docs/deploy.md): each camera's frames (uint8
    [H, W, 3] or [T, H, W, 3], or the same as nested lists), each state vector (numbers), the prompt (a string);
    keys the protocol accepts and ignores are optional. Frames are arrays of any items: MLflow would check a
    typed array item by item (seconds for one camera frame) and cannot take both frame shapes; the policy checks
    them (`parse_request`). Output: the action chunk, float32 [action_horizon, action_dim]. The example is one
    observation at the model's view size, all zeros."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import DataType
    from mlflow.types.schema import AnyType, Array, ColSpec, Schema, TensorSpec

    from dzmodel.data.errors import DataError
    from dzmodel.policy.policy import PolicyLoadError, model_embodiment, policy_statistics, read_train_config

    model_dir = bundle / "model"
    try:
        cfg, _ = read_train_config(model_dir)
        emb = model_embodiment(model_dir, cfg)
        _, action_stats, _, state_dims = policy_statistics(emb, model_dir / "experiment_cfg" / "metadata.json")
    except (PolicyLoadError, DataError, OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"no policy configuration to read ({str(exc).splitlines()[0][:300]})") from None
    spec = emb.wire
    inputs = [ColSpec(Array(AnyType()), key) for key in spec.images]
    inputs += [ColSpec(Array(DataType.double), key) for key in spec.state]
    inputs += [ColSpec(DataType.string, "prompt")]
    inputs += [ColSpec(AnyType(), key, required=False) for key in spec.ignored]
    chunk = TensorSpec(np.dtype(np.float32), (emb.action_horizon, int(action_stats.q01.shape[0])), "actions")
    example = {**{key: np.zeros((*emb.view_size, 3), np.uint8).tolist() for key in spec.images},  # as JSON has it
               **{key: [0.0] * state_dims[name] for key, name in spec.state.items()},
               "prompt": "pick up the object"}
    return ModelSignature(inputs=Schema(inputs), outputs=Schema([chunk])), example


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
                  for k, v in flatten(profile_dict(prof)).items()]
        params = [Param(p.key[:250], p.value[:6000]) for p in params]
        for i in range(0, len(params), 100):
            client.log_batch(run.info.run_id, params=params[i:i + 100])
        return cls(uri, exp_id, run.info.run_id, profile, monitor=_system_metrics(uri, run.info.run_id))

    @property
    def client(self):
        return _client(self.uri)

    def head_to_head(self, prof: Profile, version: str, package: dict, params_file: str) -> dict | None:
        """The packaged candidate against the version holding the alias (`head_to_head`)."""
        return head_to_head(self.uri, prof, version, Path(package["bundle"]), package.get("weights_sha256") or "",
                            params_file)

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
        self.client.log_dict(rid, result, f"{stage}_result.json")
        self.end(rid)
        return rid

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

    def log_policy_model(self, bundle: Path) -> str:
        """The bundle as an MLflow pyfunc model (tasks/mlflow_policy.py, models-from-code), logged as an MLflow 3
        model of the parent run (the run's output: the runs table's Models column lists it), with the signature
        of the policy it holds (`policy_signature`); returns its model id. `mlflow.pyfunc.load_model` on it (or on
        the registered version) gives a policy whose predict(obs) returns an action chunk; `dz serve` finds the
        bundle inside it."""
        import tempfile
        from importlib.metadata import PackageNotFoundError, requires

        import mlflow.pyfunc
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus
        from mlflow.models import Model

        try:  # the project's own runtime needs (the loading environment must have the project installed)
            needs = [r.split(";")[0].strip() for r in requires("dzmodel") or [] if "extra ==" not in r]
        except PackageNotFoundError:
            needs = ["torch", "numpy", "safetensors"]
        tags = {**_run_context_tags(), "bundle": bundle.name}  # who logged it, from where: the model page shows it
        try:
            signature, example = policy_signature(bundle)
        except ValueError as exc:  # no policy in it to describe (nor to serve)
            signature, example, tags["signature"] = None, None, f"none: {exc}"
        name = re.sub(r"[/:.%\"']", "-", bundle.name)  # characters a logged model's name may not hold
        logged = self.client.create_logged_model(self.experiment_id, name=name, source_run_id=self.run_id,
                                                 model_type=POLICY_MODEL_TYPE, tags=tags)
        quiet = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}  # no bar per copied file in the flow's log
        try:
            with tempfile.TemporaryDirectory() as tmp, _environment(quiet):
                model = Path(tmp) / "policy"
                mlflow.pyfunc.save_model(path=str(model), python_model=str(Path(__file__).with_name("mlflow_policy.py")),
                                         artifacts={"bundle": str(bundle)}, pip_requirements=needs,
                                         signature=signature, input_example=example,
                                         mlflow_model=Model(model_id=logged.model_id, run_id=self.run_id))
                self.client.log_model_artifacts(logged.model_id, str(model))
        except BaseException:
            self.client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
        self.client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
        self.client.log_outputs(self.run_id, [LoggedModelOutput(logged.model_id, step=0)])
        return logged.model_id

    def _link_version(self, model_id: str, name: str, version: str) -> None:
        """The logged model's side of the link to a version registered from it: MLflow's `mlflow.modelVersions`
        tag (what `mlflow.register_model` writes; the logged model's page lists its registered versions from it).
        An MLflow server writes it itself as it creates the version; a local store does not."""
        from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

        listed = self.client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS)
        versions = json.loads(listed) if listed else []
        if not any(v.get("name") == name and str(v.get("version")) == str(version) for v in versions):
            versions.append({"name": name, "version": str(version)})
            self.client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(versions)})

    def register(self, prof: Profile, package: dict, provenance: dict | None = None) -> tuple[str, bool]:
        """(version, created): the packaged bundle as a version of the profile's registered model (logged as an
        artifact of the parent run, or referenced when large), tagged with its step, eval success, held-out action
        error, the weights' and the MANIFEST's sha256 and the run's provenance (name, params digest, every
        stage's cache key). A bundle that an earlier version already holds (the same MANIFEST, or the same policy:
        `policy_sha256`, e.g. the same weights trained through DVC instead of the flow, or evaluated again)
        registers nothing: that version is returned, with created False."""
        from mlflow.exceptions import MlflowException

        client = self.client
        name = prof.promote.registered_model
        try:
            client.create_registered_model(name, description=f"DreamZero policies from the {self.profile} profile")
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise
        # the version's source is the servable bundle (model, encoders, robot config, MANIFEST), so that
        # `dz serve models:/<name>@<alias>` deploys exactly what was promoted; past the artifact size limit, a
        # reference to the bundle directory (bundle/<name>/<name>.ref.json) stands in for it
        bundle = Path(package["bundle"])
        if not (bundle / MANIFEST).is_file():
            raise ValueError(f"{bundle}: no {MANIFEST}; not a bundle to register")
        manifest_sha256, policy = file_sha256(bundle / MANIFEST), policy_sha256(bundle)
        same = sorted((int(v.version) for v in client.search_model_versions(f"name='{name}'")
                       if v.tags.get(MANIFEST_SHA256_TAG) == manifest_sha256
                       or v.tags.get(POLICY_SHA256_TAG) == policy))
        if same:
            client.set_tag(self.run_id, "registered_model_version", f"{name}/{same[0]} (unchanged)")
            return str(same[0]), False
        if _bytes(_files(bundle)) <= MAX_ARTIFACT_MB * 2**20:  # an MLflow pyfunc model holding the bundle
            model_id, pyfunc = self.log_policy_model(bundle), "yes"
            source = f"models:/{model_id}"  # as mlflow.register_model writes it: the version page links the model
        else:  # too large to copy into the artifact store: a reference to the bundle, and no pyfunc
            bundle = kept_for_reference(bundle, manifest_sha256)
            self.reference(self.run_id, bundle, f"bundle/{bundle.name}")
            source, pyfunc = f"runs:/{self.run_id}/bundle/{bundle.name}", "no: the bundle is logged by reference"
            model_id = None
        action = package.get("action_error") or {}
        provenance = provenance or {}
        # the MANIFEST's digest pins every file of the bundle: `dz serve models:/...` checks it on each load
        tags = {"step": str(package["step"]), "package.version": package["version"],
                MANIFEST_SHA256_TAG: manifest_sha256, POLICY_SHA256_TAG: policy,
                "weights.sha256": package.get("weights_sha256") or "",
                "package.tarball": package["tarball"], "profile": self.profile,
                "success_rate": "" if package["success_rate"] is None else str(package["success_rate"]),
                "action_error": "" if action.get("trained") is None else str(action["trained"]),
                "action_error_ratio": "" if action.get("ratio") is None else str(action["ratio"])}
        tags["pyfunc"] = pyfunc
        if model_id:
            tags["logged_model_id"] = model_id  # the MLflow model the version was made from, in any store
        if provenance.get("run_name"):
            tags["run_name"] = provenance["run_name"]
        if provenance.get("params_digest"):
            tags["params_digest"] = provenance["params_digest"]
        tags.update({f"key.{stage}": key for stage, key in (provenance.get("keys") or {}).items()})
        # a SQL or file registry resolves a models:/<id> source through MLflow's process-wide tracking URI
        with _process_tracking_uri(self.uri):
            mv = client.create_model_version(name, source, run_id=self.run_id, tags=tags, model_id=model_id,
                                             description=f"step {package['step']}, package {package['version']}")
        if model_id:
            self._link_version(model_id, name, mv.version)
        client.set_tag(self.run_id, "registered_model_version", f"{name}/{mv.version}")
        return str(mv.version), True


def head_to_head(uri: str, prof: Profile, version: str, candidate: Path, weights_sha256: str,
                 params_file: str, alias: str | None = None) -> dict | None:
    """The candidate bundle against the version holding the alias, on the candidate's held-out episodes
    (`compare_action_error`, with the eval section's solver, stride, windows, device and seed); {"compared": False,
    "reason"} where there is nothing to compare with or the two cannot be compared; None when
    promote.max_regression is null."""
    from mlflow.exceptions import MlflowException

    from dzmodel.data.errors import DataError
    from dzmodel.eval.action_error import ActionErrorError, compare_action_error
    from dzmodel.policy.policy import PolicyLoadError
    from dzmodel.serve.package import PackageError, load_package
    from dzmodel.stages.eval import eval_solver

    p, e = prof.promote, prof.eval
    if p.max_regression is None:
        return None
    alias = alias or p.alias
    client = _client(uri)
    try:
        current = client.get_model_version_by_alias(p.registered_model, alias)
    except MlflowException:
        return {"compared": False, "reason": f"no version holds @{alias} yet"}
    if str(current.version) == str(version):
        return {"compared": False, "reason": f"v{version} holds @{alias} already"}
    if weights_sha256 and current.tags.get("weights.sha256") == weights_sha256:
        return {"compared": False, "reason": f"v{current.version} has the same weights"}
    try:
        with _environment({"MLFLOW_TRACKING_URI": uri}):
            bundle, manifest = pinned_registered_bundle(f"models:/{p.registered_model}/{current.version}", params_file)
        other = load_package(bundle, manifest_sha256=manifest).model_dir
        result = compare_action_error(load_package(candidate).model_dir, other, stride=e.action_error_stride,
                                      max_windows=e.action_error_windows, device=e.device,
                                      solver=eval_solver(e), seed=e.seed)
    except (RegistryError, PackageError, PolicyLoadError, ActionErrorError, DataError, OSError,
            MlflowException) as exc:
        return {"compared": False, "current_version": str(current.version),
                "reason": f"v{current.version} could not be compared: {str(exc).splitlines()[0]}"}
    return {"compared": True, "current_version": str(current.version), "candidate": result["candidate"],
            "current": result["other"], "windows": result["windows"], "episodes": result["episodes"]}


def registered_head_to_head(uri: str, prof: Profile, version: str, params_file: str,
                            alias: str | None = None) -> dict | None:
    """`head_to_head` for a version already in the registry (`dz promote`): its bundle comes from there."""
    from mlflow.exceptions import MlflowException

    if prof.promote.max_regression is None:
        return None
    name = prof.promote.registered_model
    try:
        with _environment({"MLFLOW_TRACKING_URI": uri}):
            bundle, _ = pinned_registered_bundle(f"models:/{name}/{version}", params_file)
        weights = _client(uri).get_model_version(name, version).tags.get("weights.sha256", "")
    except (RegistryError, OSError, MlflowException) as exc:
        return {"compared": False, "reason": f"v{version}'s bundle could not be fetched: {str(exc).splitlines()[0]}"}
    return head_to_head(uri, prof, version, bundle, weights, params_file, alias)


def bundle_health(bundle: Path, manifest_sha256: str | None = None) -> tuple[bool, str]:
    """A bundle's health: every file matches its MANIFEST (with `manifest_sha256`, the MANIFEST too:
    `load_package`), it holds weights, and every floating-point weight is finite. (ok, why)."""
    import torch
    from safetensors import safe_open

    from dzmodel.serve.package import PackageError, load_package

    try:
        model_dir = Path(load_package(bundle, manifest_sha256=manifest_sha256).model_dir)
        files = sorted(model_dir.rglob("*.safetensors"))
        if not files:
            return False, f"health: the bundle holds no weights (no *.safetensors in {model_dir.name}/)"
        for f in files:
            with safe_open(str(f), framework="pt") as weights:  # one tensor at a time; bf16 and fp8 too
                for key in weights.keys():
                    value = weights.get_tensor(key)
                    if value.is_floating_point() and not torch.isfinite(value.float()).all():
                        return False, f"health: weights not finite ({f.name}: {key})"
    except (PackageError, OSError, ValueError) as exc:
        return False, f"health: the bundle failed its checks ({str(exc).splitlines()[0]})"
    return True, f"health: {len(files)} weight file(s) finite, every file as its MANIFEST lists"


def registered_health(uri: str, prof: Profile, version: str, params_file: str) -> tuple[bool, str]:
    """The health gate of a registered version: its bundle as the registry serves it (the MANIFEST recorded at
    registration: `pinned_registered_bundle`), then `bundle_health`."""
    from mlflow.exceptions import MlflowException

    name = prof.promote.registered_model
    try:
        with _environment({"MLFLOW_TRACKING_URI": uri}):
            bundle, manifest = pinned_registered_bundle(f"models:/{name}/{version}", params_file)
    except (RegistryError, OSError, MlflowException) as exc:
        return False, f"health: v{version}'s bundle could not be fetched ({str(exc).splitlines()[0]})"
    ok, why = bundle_health(bundle, manifest)
    return ok, why.replace("health: ", f"health: v{version}: ", 1)


def promote(uri: str, registered_model: str, version: str | None, alias: str, min_success: float | None,
            run_id: str | None = None, max_action_error_ratio: float | None = None,
            comparison=None, max_regression: float | None = None, health=None,
            override_reason: str | None = None) -> dict:
    """Set `alias` on a model version only if it passes the gate (its LIBERO success, its held-out action error
    ratio: `promotion_decision`), the health gate (`health`: a function of the version giving (ok, why), when
    given) and is no worse than the model holding the alias on the same held-out windows
    (`comparison`: a dict, or a function of the version giving one, called only once the other gates pass:
    `head_to_head_decision`). `override_reason` (an operator's rollback, say) skips the comparison, and only it:
    the reason is recorded on the version with who moved the alias and when.
    Record the decision and why on the version (tags) and, when given, on the pipeline run."""
    import getpass

    from dzmodel.pipeline import head_to_head_decision, promotion_decision

    client = _client(uri)
    if version is None:
        versions = client.search_model_versions(f"name='{registered_model}'")
        if not versions:
            raise ValueError(f"registered model {registered_model!r} has no versions at {mask_uri(uri)}")
        version = str(max(int(v.version) for v in versions))
    mv = client.get_model_version(registered_model, version)
    rate_text = mv.tags.get("success_rate", "")
    rate = float(rate_text) if rate_text not in ("", None) else None
    ratio_text = mv.tags.get("action_error_ratio", "")
    ratio = float(ratio_text) if ratio_text not in ("", None) else None
    ok, reason = promotion_decision(rate, min_success, ratio, max_action_error_ratio)
    if ok and health is not None:
        ok, healthy = health(version)
        reason = ("passed" if ok else "refused") + reason[len("passed"):] + "; " + healthy
    if ok and override_reason:
        comparison = None
        reason += f"; not compared with the current model (overridden: {override_reason})"
    elif ok:
        if callable(comparison):
            comparison = comparison(version)
        ok, versus = head_to_head_decision(comparison, max_regression)
        reason = ("passed" if ok else "refused") + reason[len("passed"):] + "; " + versus
    decision = {"registered_model": registered_model, "version": version, "alias": alias, "promoted": ok,
                "reason": reason, "success_rate": rate, "min_success": min_success,
                "action_error_ratio": ratio, "max_action_error_ratio": max_action_error_ratio,
                "head_to_head": None if callable(comparison) else comparison, "max_regression": max_regression,
                "override_reason": override_reason, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if ok:
        client.set_registered_model_alias(registered_model, alias, version)
    client.set_model_version_tag(registered_model, version, "promotion", "passed" if ok else "refused")
    client.set_model_version_tag(registered_model, version, "promotion_reason", reason)
    if override_reason:
        who = getpass.getuser()
        client.set_model_version_tag(registered_model, version, "promotion_override",
                                     f"@{alias} by {who} at {decision['at']}: {override_reason}"
                                     + ("" if ok else " (refused)"))
    if run_id:
        client.log_dict(run_id, decision, "promotion.json")
        client.set_tag(run_id, "promotion", reason)
    return decision


def registry_listing(uri: str, registered_model: str) -> list[dict]:
    """Every version of a registered model, newest first: its aliases, the measures its gates read, the last
    promotion decision and any override, the run that registered it."""
    from mlflow.exceptions import MlflowException

    client = _client(uri)
    try:
        aliases = client.get_registered_model(registered_model).aliases or {}
    except MlflowException as exc:
        raise RegistryError(f"registered model {registered_model!r} not found at {mask_uri(uri)} "
                            f"({exc.message.splitlines()[0]})") from None
    rows = []
    for mv in client.search_model_versions(f"name='{registered_model}'"):
        t = mv.tags
        rows.append({"version": str(mv.version),
                     "created": time.strftime("%Y-%m-%d %H:%M", time.gmtime(mv.creation_timestamp / 1000)),
                     "aliases": sorted(a for a, v in aliases.items() if str(v) == str(mv.version)),
                     "success_rate": t.get("success_rate", ""), "action_error_ratio": t.get("action_error_ratio", ""),
                     "promotion": t.get("promotion", ""), "promotion_reason": t.get("promotion_reason", ""),
                     "override": t.get("promotion_override", ""), "weights_sha256": t.get("weights.sha256", ""),
                     "run_id": mv.run_id or "", "model_id": version_model_id(mv) or ""})
    return sorted(rows, key=lambda r: -int(r["version"]))


LOGGED_MODEL_SOURCE = re.compile(r"^models:/(m-[0-9a-f]{32})$")


def version_model_id(mv) -> str | None:
    """The id of the logged model a version was registered from: its `model_id` where the store keeps one (a file
    store; a SQL store, behind a server too, keeps none), else its models:/<id> source, else the tag."""
    source = LOGGED_MODEL_SOURCE.match(mv.source or "")
    return getattr(mv, "model_id", None) or (source and source.group(1)) or mv.tags.get("logged_model_id") or None


# --- serving from the registry -------------------------------------------------------------------------

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))$")


class RegistryError(ValueError):
    """A models:/ URI that does not resolve to a servable bundle; the message says what to set."""


def register_and_promote(tracker: Tracker, prof: Profile, package_result: dict, provenance: dict | None = None,
                         params_file: str = "params.yaml", log=print) -> dict:
    """Register the packaged model (an unchanged bundle: the version that holds it already), then give it the
    deployment alias only if it passes the gate and is no worse than the model holding the alias, both measured
    on the candidate's held-out episodes. What the flow's task and `dz track` (the DVC path) both call."""
    from mlflow.exceptions import MlflowException

    version, created = tracker.register(prof, package_result, provenance)
    p = prof.promote
    holder = None
    if not created:
        try:
            holder = str(tracker.client.get_model_version_by_alias(p.registered_model, p.alias).version)
        except MlflowException:
            pass
    passed_before = not created and \
        tracker.client.get_model_version(p.registered_model, version).tags.get("promotion") == "passed"
    if passed_before and holder not in (None, version):
        # this policy held the alias once and someone moved it since (a rollback): a rerun does not undo that
        reason = (f"left alone: v{version} passed before, and @{p.alias} was moved to v{holder} since (a rollback, "
                  f"say); `dz promote --version {version}` moves it back")
        decision = {"registered_model": p.registered_model, "version": version, "alias": p.alias, "promoted": False,
                    "reason": reason, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        tracker.client.log_dict(tracker.run_id, decision, "promotion.json")
        tracker.client.set_tag(tracker.run_id, "promotion", reason)
    else:
        decision = promote(tracker.uri, p.registered_model, version, p.alias, p.min_success, run_id=tracker.run_id,
                           max_action_error_ratio=p.max_action_error_ratio, max_regression=p.max_regression,
                           comparison=lambda v: tracker.head_to_head(prof, v, package_result, params_file))
    decision["registered"] = "new version" if created else "unchanged: this version holds the same policy"
    log(f"registry: {p.registered_model} v{version} ({decision['registered']}): {decision['reason']}")
    return decision


def _registry_uri_for(name: str, params_file: Path) -> str:
    """MLFLOW_TRACKING_URI, else the tracking URI of the params.yaml profile that registers `name`."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    from dzmodel.config import load_params

    if not params_file.is_file():
        raise RegistryError(f"models:/{name}: set MLFLOW_TRACKING_URI, or run from the project (no {params_file})")
    params = load_params(params_file)
    for profile, prof in params.profiles.items():
        if prof.promote.registered_model == name:
            return tracking_uri(prof, StagePaths(params_file.parent.resolve(), profile).root)
    raise RegistryError(f"models:/{name}: no profile in {params_file} registers {name!r}; set MLFLOW_TRACKING_URI")


def kept_for_reference(bundle: Path, manifest_sha256: str) -> Path:
    """Where a bundle registered by reference stays: one in a profile's package folder (runs/<p>/package/, which
    the next run of the stage replaces, under `dz stage`, dvc repro or the flow) is first linked, file by file,
    into runs/<p>/store/package/registered-<MANIFEST digest>/ (a copy where links cannot be made); any other
    (the flow's keyed store) is kept where it is."""
    package = bundle.parent
    if package.name != "package" or package.parent.parent.name != "runs":
        return bundle
    dest = package.parent / "store" / "package" / f"registered-{manifest_sha256[:16]}" / bundle.name
    if (dest / MANIFEST).is_file() and file_sha256(dest / MANIFEST) == manifest_sha256:
        return dest
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(bundle, tmp, copy_function=link_or_copy, symlinks=True)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def _bundle_roots(name: str, params_file: Path) -> list[Path]:
    """Where a registered reference may point: the package stage's output folders (unkeyed, and the flow's keyed
    store) of each profile of the project that registers `name`, and the folders in DZ_BUNDLE_ROOTS."""
    roots = [Path(p).expanduser().resolve() for p in os.environ.get(BUNDLE_ROOTS_ENV, "").split(os.pathsep) if p]
    if params_file.is_file():
        from dzmodel.config import load_params

        project = params_file.parent.resolve()
        for profile, prof in load_params(params_file).profiles.items():
            if prof.promote.registered_model == name:  # `dz stage package`'s folder, and the flow's keyed ones
                paths = StagePaths(project, profile)
                roots += [paths.stage("package").resolve(), paths.store("package").resolve()]
    return roots


def _referenced_bundle(ref_file: Path, roots: list[Path]) -> Path:
    """The bundle directory a `<name>.ref.json` names, only if it lies inside one of `roots`."""
    try:
        target = json.loads(ref_file.read_text())["path"]
        if not isinstance(target, str):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise RegistryError(f'{ref_file}: not a bundle reference (expected {{"path": "/abs/bundle/dir"}})') from None
    path = Path(target).resolve()  # symlinks and .. resolved before the check
    if not Path(target).is_absolute() or not any(path != r and path.is_relative_to(r) for r in roots):
        raise RegistryError(f"{ref_file}: points at {target!r} ({path}), outside the bundle roots "
                            f"{[str(r) for r in roots]}; list a shared folder of bundles in {BUNDLE_ROOTS_ENV}")
    if not (path / MANIFEST).is_file():
        raise RegistryError(f"{ref_file}: {path} is not a bundle (no {MANIFEST})")
    return path


def _pyfunc_bundle(model: Path) -> Path | None:
    """The bundle a downloaded pyfunc model (`log_policy_model`) holds, as its MLmodel names it; None when
    `model` is not one. The named folder must lie inside the download."""
    import yaml

    spec = model / "MLmodel"
    if not spec.is_file():
        return None
    try:
        rel = yaml.safe_load(spec.read_text())["flavors"]["python_function"]["artifacts"]["bundle"]["path"]
        if not isinstance(rel, str):
            raise TypeError
    except (yaml.YAMLError, KeyError, TypeError):
        raise RegistryError(f"{spec}: not a DreamZero policy model (no python_function artifact 'bundle')") from None
    bundle = (model / rel).resolve()
    if not bundle.is_relative_to(model.resolve()) or not (bundle / MANIFEST).is_file():
        raise RegistryError(f"{spec}: its bundle {rel!r} is not a bundle inside the downloaded model; refused")
    return bundle


def resolve_registered_bundle(uri: str, params_file: str | Path = "params.yaml", cache_dir: Path | None = None) -> Path:
    return pinned_registered_bundle(uri, params_file, cache_dir)[0]


def pinned_registered_bundle(uri: str, params_file: str | Path = "params.yaml",
                             cache_dir: Path | None = None) -> tuple[Path, str]:
    """`models:/<name>@<alias>` or `models:/<name>/<version>` -> a local bundle directory (downloaded into the
    bundle cache's registry/ folder, once per version), for `dz serve` to verify and serve.

    On every call, the bundle's MANIFEST must have the sha256 recorded at registration (so a cached download
    or a referenced bundle changed since is refused; `load_package` then checks each file against MANIFEST).
    The version's source must be a model logged in the tracking store (models:/<model id>, or its location) or a
    runs:/ path of the store, and a reference (`*.ref.json`, for large bundles) must point inside the package
    folder of a profile that registers the name, or DZ_BUNDLE_ROOTS."""
    import shutil
    import tempfile

    from mlflow.exceptions import MlflowException

    from dzmodel.serve.bundles import default_cache_dir

    m = MODEL_URI.match(uri)
    if m is None:
        raise RegistryError(f"{uri}: expected models:/<name>@<alias> or models:/<name>/<version>")
    name = m["name"]
    params_file = Path(params_file)
    registry = _registry_uri_for(name, params_file)
    client = _client(registry)
    try:
        mv = client.get_model_version_by_alias(name, m["alias"]) if m["alias"] else \
            client.get_model_version(name, m["version"])
    except MlflowException as exc:
        raise RegistryError(f"{uri}: not found at {mask_uri(registry)} ({exc.message.splitlines()[0]})") from None
    expected = mv.tags.get(MANIFEST_SHA256_TAG, "")
    if not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise RegistryError(f"{uri}: version {mv.version} has no {MANIFEST_SHA256_TAG} tag, so nothing pins what it "
                            "serves (registered before versions recorded it): re-run the pipeline to register it again")
    source = download = mv.source or ""
    logged, by_id = False, LOGGED_MODEL_SOURCE.match(source)
    model = by_id or re.search(r"/models/(m-[0-9a-f]{32})/artifacts$", source)
    if model:  # a model logged in this store: models:/<its id>, or its artifact location exactly
        try:
            location = client.get_logged_model(model.group(1)).artifact_location
            if by_id or location == source:
                logged, download = True, location
        except MlflowException:
            pass
    if not (logged or re.fullmatch(r"runs:/[0-9a-f]{32}/\S+", source)) or ".." in source.split("/"):
        raise RegistryError(f"{uri}: version {mv.version}'s source {mask_uri(source)} is neither a model logged in "
                            "this tracking store nor a runs:/<run id>/<path> of it (what registration writes); refused")
    # per tracking store: another project's registry may hold a different version under the same name and number
    store = hashlib.sha256(registry.encode()).hexdigest()[:12]
    dest = (cache_dir or default_cache_dir()) / "registry" / store / name / str(mv.version)
    if not dest.is_dir():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{mv.version}.", suffix=".tmp", dir=dest.parent))
        try:
            import mlflow

            mlflow.artifacts.download_artifacts(artifact_uri=download, tracking_uri=registry, dst_path=str(tmp))
            try:
                os.replace(tmp, dest)
            except OSError:
                if not dest.is_dir():
                    raise
                # another `dz serve` downloaded this version at the same time and put it there first: its copy
                # is pinned below like any cached one
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    manifests = sorted(dest.rglob(MANIFEST), key=lambda p: len(p.parts))
    refs = sorted(dest.rglob("*.ref.json"))
    model_bundle = _pyfunc_bundle(dest)
    if model_bundle is not None:
        bundle, where = model_bundle, f"the copy downloaded into {dest} (delete it to download again)"
    elif manifests:
        bundle, where = manifests[0].parent, f"the copy downloaded into {dest} (delete it to download again)"
    elif len(refs) == 1:
        bundle, where = _referenced_bundle(refs[0], _bundle_roots(name, params_file)), "the referenced bundle"
    else:
        raise RegistryError(f"{uri}: version {mv.version}'s source {source} holds no bundle (no {MANIFEST}, or not "
                            "exactly one reference): re-run the package stage")
    digest = file_sha256(bundle / MANIFEST)
    if digest != expected:
        raise RegistryError(f"{bundle / MANIFEST}: sha256 {digest} does not match {expected}, registered for {uri} "
                            f"(version {mv.version}): {where} was changed after registration; refused")
    print(f"{uri} -> version {mv.version} ({source})", flush=True)
    return bundle, expected  # the loader checks the MANIFEST against it again as it reads the files
