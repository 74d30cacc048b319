"""Links to the MLflow UI (Prefect's artifact, the run summary): where `tracking.ui_url` says, else the tracking
server, else `mlflow ui`'s default address; always the classic experiment view, never a password."""

from pathlib import Path

import pytest

from dzmodel.config import ParamsError, load_params

ROOT = Path(__file__).resolve().parents[2]


def _demo(*overrides: str):
    return load_params(ROOT / "params.yaml", list(overrides), "demo").selected("demo")


def test_the_ui_page_follows_the_configured_address_then_the_server_then_the_local_default():
    pytest.importorskip("mlflow", reason="the tracking module needs mlflow (make setup)")
    from tasks.tracking import ui_page

    local = _demo()
    assert ui_page(local, "sqlite:///mlruns/mlflow.db", "7", "abc") == \
        "http://127.0.0.1:5000/#/experiments/7/runs/abc?workflowType=machine_learning"
    assert ui_page(local, "sqlite:///mlruns/mlflow.db", "7") == \
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
    assert ui_page(local, "https://bob:secret@mlflow.lab:8443/?token=x", "7") == \
        "https://mlflow.lab:8443/#/experiments/7/runs?workflowType=machine_learning"
    lab = _demo("tracking.ui_url=https://mlflow.lab/ml/")
    for store in ("sqlite:///mlruns/mlflow.db", "http://10.0.0.5:5000"):
        assert ui_page(lab, store, "7", "abc") == \
            "https://mlflow.lab/ml/#/experiments/7/runs/abc?workflowType=machine_learning"


@pytest.mark.parametrize("bad", ["mlflow.lab:5000", "ftp://mlflow.lab", "https://", "https://x/?q=1"])
def test_a_ui_url_that_is_no_web_address_is_refused_naming_the_field(bad):
    with pytest.raises(ParamsError, match=r"tracking\.ui_url\S*: an http\(s\) address"):
        _demo(f"tracking.ui_url={bad}")


def test_the_summary_prints_the_page_it_was_given(tmp_path):
    pytest.importorskip("prefect", reason="the pipeline commands need prefect (make setup)")
    from flows.commands import where_to_look

    summary = {"profile": "demo", "cached_stages": [], "package": "p.tar.gz", "mlflow_uri": "sqlite:///m.db",
               "experiment": "dreamzero-demo", "mlflow_run_id": "abc", "promotion": None,
               "mlflow_page": "http://127.0.0.1:5055/#/experiments/7/runs?workflowType=machine_learning"}
    text = where_to_look(summary, tmp_path)
    assert "--port 5055" in text and "(then http://127.0.0.1:5055/#/experiments/7/runs?workflowType=" in text
    text = where_to_look({**summary, "mlflow_uri": "http://10.0.0.5:5000"}, tmp_path)
    assert "MLflow      http://10.0.0.5:5000 (experiment dreamzero-demo, run abc)" in text
    assert "MLflow UI   http://127.0.0.1:5055/#/experiments/7/runs?workflowType=machine_learning" in text
    assert "cached run" not in text
    cached = where_to_look({**summary, "cached_stages": ["fetch"], "original_run_id": "first"}, tmp_path)
    assert "cached run  every stage was cached: MLflow run abc points at first, the run that made these" in cached
