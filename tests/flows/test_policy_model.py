"""The registered policy is an MLflow pyfunc model: `mlflow.pyfunc.load_model("models:/<name>@production")`
returns a model whose predict(obs) gives an action chunk, and `dz serve models:/...` still finds the bundle."""

from __future__ import annotations

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
        version, created = tracker.register(prof, package)
        assert created and tracker.register(prof, package) == (version, False)  # the same bundle: no new version
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
    with pytest.raises(Exception, match="observation/state"):
        model.predict({k: v for k, v in OBS.items() if k != "observation/state"})


def test_dz_serve_finds_the_bundle_inside_the_registered_model(registered, tmp_path, monkeypatch):
    from dzmodel.serve.bundles import MANIFEST, file_sha256
    from tasks.tracking import pinned_registered_bundle

    uri, bundle, version = registered
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    path, digest = pinned_registered_bundle("models:/dreamzero-demo@production", ROOT / "params.yaml",
                                            cache_dir=tmp_path / "cache")
    assert path.name == bundle.name and digest == file_sha256(bundle / MANIFEST)
    assert path.is_relative_to(next((tmp_path / "cache" / "registry").iterdir()) / "dreamzero-demo" / version)  # per store


@pytest.mark.slow
def test_mlflow_models_serve_answers_with_an_action_chunk(registered, tmp_path):
    import json
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
