"""`dz serve --precision fp8`: the bundle's DiT blocks served with e4m3 weights where the GPU has FP8; on this CPU
the policy stays as it was and says why; the FP8 path itself (forced here) answers openpi's client."""

import numpy as np
import pytest
import torch
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dzmodel.policy import policy as policy_mod
from dzmodel.policy.policy import load_policy
from dzmodel.model.fp8 import fp8_linears
from dzmodel.model.sampler import SolverConfig
from dzmodel.serve.package import load_package
from dzmodel.serve.server import BundlePolicy, ServerThread

from .test_real_clients import openpi_libero_observation

TOKEN = "fp8-serving-token"
SOLVER = SolverConfig(num_steps=2, cfg_scale=1.0)


@pytest.fixture(scope="module")
def model_dir(libero_bundle):
    return load_package(libero_bundle).model_dir


def test_fp8_where_the_device_has_none_keeps_the_policy_and_says_why(model_dir):
    embodied = load_policy(model_dir, solver=SOLVER, precision="fp8")
    # on a CPU the policy runs the saved weights' dtype (this bundle's run trained in fp32), and says so
    assert embodied.precision == "fp32" and fp8_linears(embodied.policy.model) == 0
    assert embodied.precision_note.startswith("precision fp8 falls back to fp32: FP8 matmuls need an NVIDIA GPU")
    assert load_policy(model_dir, solver=SOLVER).precision == "fp32"
    assert load_policy(model_dir, solver=SOLVER, weights_dtype=torch.bfloat16, precision="fp8").precision == "bf16"
    with pytest.raises(ValueError, match="precision must be bf16 or fp8"):
        load_policy(model_dir, solver=SOLVER, precision="int4")


def test_the_fp8_policy_answers_openpi_close_to_the_full_precision_one(model_dir, monkeypatch):
    reference = load_policy(model_dir, solver=SOLVER)
    monkeypatch.setattr(policy_mod, "resolve_precision", lambda requested, device, **_: (requested, None))
    embodied = load_policy(model_dir, solver=SOLVER, precision="fp8")
    assert embodied.precision == "fp8" and embodied.precision_note is None and fp8_linears(embodied.policy.model) > 0
    obs = openpi_libero_observation(np.random.default_rng(0))
    answers = []
    for policy in (reference, embodied):
        with ServerThread(BundlePolicy(policy), TOKEN) as srv:
            answers.append(WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN).infer(obs)["actions"])
    full, low = answers
    assert low.shape == full.shape == (16, 7) and np.isfinite(low).all()
    assert 0 < np.linalg.norm(low - full) / np.linalg.norm(full) < 0.2
