"""A tracking URI with credentials (http://user:password@host, ?token=...) never reaches a log, a printed
summary, a Prefect artifact or an error message as it is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.flows.test_sft_pipeline import _fake_stages, prefect_env  # noqa: F401  (the ephemeral Prefect fixture)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-pw"
SECRET_URI = f"https://lab:{SECRET}@mlflow.example.org:5000/?token={SECRET}&workspace=robots"


@pytest.mark.parametrize("uri, masked", [
    ("http://user:pass@host:5000", "http://user:***@host:5000"),
    ("https://user:p@ss@host/path?x=1", "https://user:***@host/path?x=1"),
    ("https://ghp_abc123@host/api", "https://***@host/api"),
    ("https://host/api?access_token=abc&run=1&X-Amz-Signature=ff#frag",
     "https://host/api?access_token=***&run=1&X-Amz-Signature=***#frag"),
    ("postgresql://mlflow:pw@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
    ("sqlite:////work/mlruns/mlflow.db", "sqlite:////work/mlruns/mlflow.db"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("databricks", "databricks"),
])
def test_mask_uri(uri, masked):
    from tasks.tracking import mask_uri

    assert mask_uri(uri) == masked


def test_mask_text_masks_every_uri_in_a_message_and_leaves_the_rest():
    from tasks.tracking import mask_text

    text = (f"API request to '{SECRET_URI}api/2.0/runs' failed (retries: 3); also http://u:{SECRET}@h:1/x, "
            f"see https://mlflow.org/docs?x=1; Max retries exceeded with url: /api/2.0/runs?run=7&token={SECRET}")
    masked = mask_text(text)
    assert SECRET not in masked
    assert masked == ("API request to 'https://lab:***@mlflow.example.org:5000/?token=***&workspace=robots"
                      "api/2.0/runs' failed (retries: 3); also http://u:***@h:1/x, see https://mlflow.org/docs?x=1; "
                      "Max retries exceeded with url: /api/2.0/runs?run=7&token=***")


def test_the_log_filter_masks_tracebacks_and_lets_a_malformed_call_through():
    import io
    import logging

    from tasks.tracking import MaskSecrets

    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    handler.addFilter(MaskSecrets())
    logger = logging.getLogger("dz-test-masking")
    logger.propagate = False  # pytest's own capture handler raises on a malformed call
    logger.addHandler(handler)
    try:
        try:
            raise ConnectionError(f"cannot reach {SECRET_URI}")
        except ConnectionError:
            logger.exception("request to %s failed", SECRET_URI)
        logger.warning("bad %d", "x")  # logging's own error report, not an exception at the call
    finally:
        logger.removeHandler(handler)
    assert SECRET not in seen.getvalue() and "Traceback" in seen.getvalue()
    assert seen.getvalue().count("lab:***@mlflow.example.org") == 2


def test_the_pipeline_summary_masks_the_tracking_and_prefect_uris(tmp_path, monkeypatch):
    from flows.commands import where_to_look

    monkeypatch.setenv("PREFECT_API_URL", f"https://ops:{SECRET}@prefect.example.org/api")
    summary = {"profile": "demo", "cached_stages": [], "package": "p.tar.gz", "mlflow_uri": SECRET_URI,
               "experiment": "dreamzero-demo", "mlflow_run_id": "abc", "promotion": None, "action_error": None}
    text = where_to_look(summary, tmp_path)
    assert SECRET not in text
    assert "https://lab:***@mlflow.example.org:5000/?token=***&workspace=robots" in text
    assert "https://ops:***@prefect.example.org" in text


def test_ending_a_run_prints_no_credentials(monkeypatch, capsys):
    """MLflow prints a link to each run it ends, built from the tracking URI."""
    from mlflow.entities import Run, RunData, RunInfo
    from mlflow.store.tracking.rest_store import RestStore

    from tasks.tracking import Tracker

    info = RunInfo(run_id="r1", experiment_id="1", user_id="u", status="RUNNING", start_time=0, end_time=None,
                   lifecycle_stage="active", run_name="fetch")
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    monkeypatch.setattr(RestStore, "get_run", lambda self, run_id: Run(info, RunData()))
    monkeypatch.setattr(RestStore, "update_run_info", lambda self, *a, **k: info)
    Tracker(SECRET_URI, "1", "r1", "demo").end()
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err


def test_a_registry_error_masks_the_tracking_uri(monkeypatch, tmp_path):
    from mlflow.exceptions import MlflowException

    from tasks import resolver

    class Unreachable:
        def get_model_version(self, name, version):
            raise MlflowException("RESOURCE_DOES_NOT_EXIST: no such version")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", SECRET_URI)
    monkeypatch.setattr(resolver, "_client", lambda uri: Unreachable())
    with pytest.raises(resolver.RegistryError) as err:
        resolver.resolve_registered_bundle("models:/dreamzero-demo/7", tmp_path / "params.yaml", tmp_path)
    assert SECRET not in str(err.value) and "lab:***@mlflow.example.org" in str(err.value)


def test_the_flow_logs_and_artifacts_hold_no_credentials(prefect_env, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The whole flow against a tracking server with a password in its URI (MLflow itself stubbed out)."""
    from prefect.client.orchestration import get_client
    from prefect.logging.handlers import APILogHandler

    from dzmodel import pipeline
    from flows.sft_pipeline import sft_pipeline
    from tasks.tracking import Tracker

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", SECRET_URI)
    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", _fake_stages([]))
    monkeypatch.setattr(Tracker, "_begin", classmethod(lambda cls, prof, profile, paths, *a, **kw: cls(
        SECRET_URI, "1", "run0", profile)))
    for method in ("log_stage", "end", "train_rows"):
        monkeypatch.setattr(Tracker, method, lambda self, *a, **k: None)
    monkeypatch.setattr(Tracker, "mark_outputs", lambda self, *a, **k: False)  # a run that computed its stages

    summary = sft_pipeline("demo", root=str(tmp_path), promote=False)
    APILogHandler().flush()  # logs reach the Prefect API in batches, in the background
    with get_client(sync_client=True) as client:
        logs = [log.message for log in client.read_logs()]
        artifacts = [str(a.data) + str(a.description) for a in client.read_artifacts()]
    out = capsys.readouterr()
    assert any("lab:***@mlflow.example.org" in m for m in logs)  # the run's tracking URI is logged, masked
    for text in [*logs, *artifacts, str(summary), out.out, out.err]:
        assert SECRET not in text


def test_prefects_own_failure_lines_hold_no_credentials(prefect_env, tmp_path, monkeypatch):  # noqa: F811
    """A stage that fails with the tracking URI in its error (as MLflow's exceptions carry it): Prefect's own
    "Task run failed" and "Finished in state Failed" lines, with their tracebacks, are masked too, in what a
    handler writes and in what reaches the Prefect API."""
    import io
    import logging

    from prefect.client.orchestration import get_client
    from prefect.logging.handlers import APILogHandler

    from dzmodel import pipeline
    from flows.sft_pipeline import sft_pipeline
    from tasks.stages import MaskedError
    from tasks.tracking import Tracker

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", SECRET_URI)

    def unreachable(prof, paths, log):
        raise ConnectionError(f"API request to {SECRET_URI}api/2.0/mlflow/runs/create failed")

    monkeypatch.setattr(pipeline, "STAGE_FUNCTIONS", {**_fake_stages([]), "metadata": unreachable})
    monkeypatch.setattr(Tracker, "_begin", classmethod(lambda cls, prof, profile, paths, *a, **kw: cls(
        SECRET_URI, "1", "run0", profile)))
    for method in ("log_stage", "end", "train_rows", "record_failure"):
        monkeypatch.setattr(Tracker, method, lambda self, *a, **k: None)
    from prefect.logging.handlers import PrefectConsoleHandler

    for lg in [logging.getLogger(), *map(logging.getLogger, list(logging.Logger.manager.loggerDict))]:
        for h in getattr(lg, "handlers", []):  # a console bound to an earlier test's captured (closed) stderr
            if isinstance(h, PrefectConsoleHandler):
                monkeypatch.setattr(h.console, "file", io.StringIO())
    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    handler.setFormatter(logging.Formatter("%(name)s | %(message)s"))
    logging.getLogger("prefect").addHandler(handler)
    try:
        with pytest.raises(MaskedError, match=r"ConnectionError: API request to https://lab:\*\*\*@mlflow"):
            sft_pipeline("demo", root=str(tmp_path), promote=False)
    finally:
        logging.getLogger("prefect").removeHandler(handler)
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = [log.message for log in client.read_logs()]
    written = seen.getvalue()
    assert "Task run failed" in written and "Traceback" in written  # Prefect's own lines, with the traceback
    assert "lab:***@mlflow.example.org" in written
    assert any("lab:***@mlflow.example.org" in m and "failed" in m.lower() for m in logs)
    with get_client(sync_client=True) as client:  # the failed states' messages, which the UI shows
        states = [str(t.state.message) for t in client.read_task_runs()] + [
            str(f.state.message) for f in client.read_flow_runs()]
    assert any("lab:***@mlflow.example.org" in m for m in states)
    for text in [*logs, written, *states]:
        assert SECRET not in text
