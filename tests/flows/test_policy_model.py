"""The registered policy is an MLflow pyfunc model: `mlflow.pyfunc.load_model("models:/<name>@production")`
returns a model whose predict(obs) gives an action chunk, and `dz serve models:/...` still finds the bundle.
The version and the logged model point at each other as MLflow's UI reads them, the model carries the policy's
signature, and the run and the model say who made them and from where."""

from __future__ import annotations

import getpass
import json
import logging
import urllib.parse
import warnings
from pathlib import Path

import numpy as np
import pytest

from dzmodel.config import StagePaths, load_params
from tests.serve.helpers import HORIZON, tiny_bundle

ROOT = Path(__file__).resolve().parents[2]
# the documented observation (docs/deploy.md): openpi's LIBERO request for the demo's embodiment
OBS = {"observation/image": np.zeros((64, 64, 3), np.uint8), "observation/wrist_image": np.zeros((64, 64, 3), np.uint8),
       "observation/state": np.zeros(8), "prompt": "put the bowl on the plate"}


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    import mlflow
    from mlflow.tracking import MlflowClient

    from tasks import registry
    from tasks.tracking import Tracker

    root = tmp_path_factory.mktemp("project")
    tarball = tiny_bundle(root / "build", "libero_sim_tiny")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        prof = load_params(ROOT / "params.yaml", [], "demo").selected()
        tracker = Tracker.start(prof, "demo", StagePaths(root, "demo"), run_name="demo-test-1")
        bundle = Path(str(tarball).removesuffix(".tar.gz"))
        package = {"bundle": str(bundle), "tarball": str(tarball), "step": 1, "version": "0.1.0",
                   "success_rate": None, "action_error": None, "weights_sha256": "0" * 64}
        version, created = registry.register(tracker, prof, package)
        assert created and registry.register(tracker, prof, package) == (version, False)  # the same bundle: no new version
        MlflowClient(uri, uri).set_registered_model_alias("dreamzero-demo", "production", version)
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        yield uri, bundle, version


def test_the_production_model_loads_as_a_pyfunc_and_predicts_an_action_chunk(registered):
    import mlflow

    model = mlflow.pyfunc.load_model("models:/dreamzero-demo@production")
    actions = model.predict(OBS)
    assert actions.shape == (HORIZON["libero_sim_tiny"], 7) and np.isfinite(actions).all()
    as_json = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in OBS.items()}  # as a server gets it
    assert model.predict(as_json).shape == actions.shape
    frames = {k: np.zeros((4, 64, 64, 3), np.uint8) for k in ("observation/image", "observation/wrist_image")}
    assert model.predict({**OBS, **frames, "observation/state": np.zeros(8, np.float32)}).shape == actions.shape
    with pytest.raises(Exception, match="observation/state"):
        model.predict({k: v for k, v in OBS.items() if k != "observation/state"})


def test_dz_serve_finds_the_bundle_inside_the_registered_model(registered, tmp_path, monkeypatch):
    from dzmodel.serve.bundles import MANIFEST, file_sha256
    from tasks.resolver import pinned_registered_bundle

    uri, bundle, version = registered
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    path, digest = pinned_registered_bundle("models:/dreamzero-demo@production", ROOT / "params.yaml",
                                            cache_dir=tmp_path / "cache")
    assert path.name == bundle.name and digest == file_sha256(bundle / MANIFEST)
    assert path.is_relative_to(next((tmp_path / "cache" / "registry").iterdir()) / "dreamzero-demo" / version)  # per store


SIGNATURE_INPUTS = ["observation/image", "observation/wrist_image", "observation/state", "prompt"]


@pytest.fixture(scope="module", params=["sqlite", "file"])
def fresh(registered, request, tmp_path_factory):
    """The tiny bundle registered into an empty store (sqlite, or MLflow's file store), with what MLflow warned
    or logged at WARNING while it did: (tracker, version, warned)."""
    from tasks import registry
    from tasks.tracking import Tracker

    _, bundle, _ = registered
    root = tmp_path_factory.mktemp(request.param)
    uri = f"sqlite:///{root / 'mlflow.db'}" if request.param == "sqlite" else (root / "mlruns").as_uri()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store in maintenance mode
        # MLflow shows some of its warnings "once" per process: an earlier registration must not hide them here
        mp.setattr(warnings, "onceregistry", {})
        prof = load_params(ROOT / "params.yaml", [], "demo").selected()
        tracker = Tracker.start(prof, "demo", StagePaths(root, "demo"), run_name="demo-test-2")
        package = {"bundle": str(bundle), "tarball": f"{bundle}.tar.gz", "step": 1, "version": "0.1.0",
                   "success_rate": None, "action_error": None, "weights_sha256": "0" * 64}
        logging.getLogger("mlflow").addHandler(handler)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                version, _ = registry.register(tracker, prof, package)
        finally:
            logging.getLogger("mlflow").removeHandler(handler)
        tracker.end()
        warned = [str(w.message) for w in caught] + [r.getMessage() for r in records]
        yield tracker, version, warned


def _logged_model(tracker, version):
    client = tracker.client
    mv = client.get_model_version("dreamzero-demo", version)
    return mv, client.get_logged_model(mv.tags["logged_model_id"])


def test_the_version_names_its_logged_model(fresh):
    from tasks import registry

    tracker, version, _ = fresh
    mv, logged = _logged_model(tracker, version)
    # its source names the logged model (the version page's "Source Model" link), and model_id is set where the
    # store keeps the field (the file store; a SQL store, behind a server too, has no column for it)
    assert mv.source == f"models:/{logged.model_id}"
    if tracker.uri.startswith("file:"):
        assert mv.model_id == logged.model_id
    assert registry.version_model_id(mv) == logged.model_id
    assert registry.registry_listing(tracker.uri, "dreamzero-demo")[0]["model_id"] == logged.model_id  # dz registry
    assert mv.run_id == tracker.run_id == logged.source_run_id  # the version page's "Source Run"
    assert tracker.client.get_model_version_download_uri("dreamzero-demo", version) == logged.artifact_location


def test_the_logged_model_lists_the_version(fresh):
    tracker, version, _ = fresh
    _, logged = _logged_model(tracker, version)
    # what the logged model's page lists under "Model versions" (and the run page under "Registered models")
    listed = json.loads(logged.tags.get("mlflow.modelVersions", "[]"))
    assert [(v["name"], str(v["version"])) for v in listed] == [("dreamzero-demo", version)]


def test_the_logged_model_carries_the_policys_signature(fresh):
    from mlflow.models import Model

    tracker, version, _ = fresh
    _, logged = _logged_model(tracker, version)
    info = Model.load(urllib.parse.urlparse(logged.artifact_location).path)  # its MLmodel, as the UI reads it
    assert info.signature is not None
    assert info.signature.inputs.input_names() == SIGNATURE_INPUTS
    assert all(spec.required for spec in info.signature.inputs.inputs)
    (chunk,) = info.signature.outputs.inputs
    assert (chunk.name, chunk.type, chunk.shape) == ("actions", np.float32, (HORIZON["libero_sim_tiny"], 7))
    assert info.saved_input_example_info is not None  # an observation: what `mlflow models serve` documents


def test_registering_gives_no_warning_about_a_signature(fresh):
    _, _, warned = fresh
    assert not [w for w in warned if "signature" in w.lower() or "type hint" in w.lower()], warned


def test_the_run_and_the_logged_model_say_who_made_them_and_from_where(fresh):
    tracker, version, _ = fresh
    run = tracker.client.get_run(tracker.run_id)
    _, logged = _logged_model(tracker, version)
    for tags in (run.data.tags, logged.tags):  # the run page's and the model page's "Created by", "Source"
        assert tags["mlflow.user"] == getpass.getuser(), tags
        assert tags["mlflow.source.name"] and tags["mlflow.source.type"] == "LOCAL"
    assert run.info.user_id == getpass.getuser()


@pytest.mark.slow
def test_mlflow_models_serve_answers_with_an_action_chunk(registered, tmp_path):
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    uri, _, _ = registered
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([f"{bin_dir}/mlflow", "models", "serve", "-m", "models:/dreamzero-demo@production",
                               "--env-manager", "local", "-p", str(port)], env=env, stdout=log, stderr=log,
                              start_new_session=True)
    try:
        obs = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in OBS.items()}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", json.dumps({"inputs": obs}).encode(),
                                         {"Content-Type": "application/json"})
        deadline = time.monotonic() + 120
        while True:
            try:
                reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(1)
        assert np.asarray(reply["predictions"]).shape == (HORIZON["libero_sim_tiny"], 7)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
