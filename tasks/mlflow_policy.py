"""The packaged policy as an MLflow pyfunc model (MLflow's models-from-code: this file is logged with the model
and run when it loads, so nothing is unpickled).

    import mlflow
    policy = mlflow.pyfunc.load_model("models:/dreamzero-demo@production")
    actions = policy.predict(obs)   # obs: the openpi request, a dict (docs/deploy.md); -> [horizon, action dim]

It loads the bundle logged beside it (MANIFEST checked, as `dz serve` does) and answers one observation at a
time with a fresh session: one chunk per call, no history kept between calls (`dz serve` keeps a session per
episode). The environment needs this project installed (`make setup`)."""

from __future__ import annotations

import uuid

import mlflow
from mlflow.pyfunc import PythonModel


class DreamZeroPolicy(PythonModel):
    # predict takes the observation dict that the logged signature describes (`tracking.policy_signature`), and
    # MLflow checks it against that before each call: no type hints (MLflow would infer another signature from
    # them), and none of MLflow's warnings asking for them, at logging or at loading
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        from dzmodel.policy.policy import load_policy
        from dzmodel.serve.package import load_package
        from dzmodel.serve.safety import ActionSafety
        from dzmodel.serve.server import BundlePolicy

        package = load_package(context.artifacts["bundle"])  # checks every file against the MANIFEST
        self.policy = BundlePolicy(load_policy(package.model_dir, device="cpu"),
                                   safety=ActionSafety.from_robot(package.robot))  # as `dz serve` sends them

    def predict(self, context, model_input, params=None):
        """One action chunk for one observation: the openpi request's fields (images uint8 [H, W, 3] or
        [T, H, W, 3], the state vector, the prompt), as a dict."""
        import numpy as np

        from dzmodel.serve.protocol import parse_request

        if hasattr(model_input, "to_dict"):  # a one-row DataFrame: what MLflow passes once it checked the signature
            model_input = {k: v[0] for k, v in model_input.to_dict(orient="list").items()}
        obs = {k: (np.asarray(v) if isinstance(v, list) else v) for k, v in dict(model_input).items()}
        prompt = obs.get("prompt")
        if isinstance(prompt, np.ndarray) and prompt.size == 1:  # served as JSON: a tensor of one string
            obs["prompt"] = str(prompt.reshape(-1)[0])
        for key in self.policy.spec.images:  # JSON carries pixels as numbers: back to uint8
            if key in obs and isinstance(obs[key], np.ndarray) and obs[key].dtype != np.uint8:
                obs[key] = obs[key].astype(np.uint8)
        request = parse_request(obs, self.policy.spec, self.policy.state_dims)
        self.policy.check_request(request)
        session = f"pyfunc-{uuid.uuid4().hex}"
        try:
            return self.policy.infer(request, session)
        finally:
            self.policy.end_session(session)


mlflow.models.set_model(DreamZeroPolicy())
