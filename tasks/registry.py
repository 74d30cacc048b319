"""The model registry: a packaged bundle registered as a version of the profile's registered model (logged as an
MLflow pyfunc model, or referenced when large), the promotion gates (success, held-out action error, health, no
worse than the version holding the alias) and the alias they move, and the listing `dz registry list` prints.

The parameters come loaded (`Registry` says where the registered versions are read), never re-read from a path, so
a run's `--set` overrides hold for its promotion too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from dzmodel.atomic import link_or_copy
from dzmodel.config import Profile
from dzmodel.serve.bundles import MANIFEST, file_sha256, parse_manifest

from .resolver import (LOGGED_MODEL_SOURCE, MANIFEST_SHA256_TAG, Registry, RegistryError,
                       pinned_registered_bundle)
from .tracking import (MAX_ARTIFACT_MB, Tracker, _bytes, _client, _environment, _files, _process_tracking_uri,
                       _run_context_tags, mask_uri)

POLICY_MODEL_TYPE = "dreamzero-policy"  # the logged pyfunc model's type (its name is the bundle's)

POLICY_SHA256_TAG = "bundle.policy_sha256"  # on each model version: the sha256 of the MANIFEST lines the policy reads
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


def log_policy_model(tracker: Tracker, bundle: Path) -> str:
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
    logged = tracker.client.create_logged_model(tracker.experiment_id, name=name, source_run_id=tracker.run_id,
                                             model_type=POLICY_MODEL_TYPE, tags=tags)
    quiet = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}  # no bar per copied file in the flow's log
    try:
        with tempfile.TemporaryDirectory() as tmp, _environment(quiet):
            model = Path(tmp) / "policy"
            mlflow.pyfunc.save_model(path=str(model), python_model=str(Path(__file__).with_name("mlflow_policy.py")),
                                     artifacts={"bundle": str(bundle)}, pip_requirements=needs,
                                     signature=signature, input_example=example,
                                     mlflow_model=Model(model_id=logged.model_id, run_id=tracker.run_id))
            tracker.client.log_model_artifacts(logged.model_id, str(model))
    except BaseException:
        tracker.client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    tracker.client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    tracker.client.log_outputs(tracker.run_id, [LoggedModelOutput(logged.model_id, step=0)])
    return logged.model_id

def _link_version(tracker: Tracker, model_id: str, name: str, version: str) -> None:
    """The logged model's side of the link to a version registered from it: MLflow's `mlflow.modelVersions`
    tag (what `mlflow.register_model` writes; the logged model's page lists its registered versions from it).
    An MLflow server writes it itself as it creates the version; a local store does not."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    listed = tracker.client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS)
    versions = json.loads(listed) if listed else []
    if not any(v.get("name") == name and str(v.get("version")) == str(version) for v in versions):
        versions.append({"name": name, "version": str(version)})
        tracker.client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(versions)})

def register(tracker: Tracker, prof: Profile, package: dict, provenance: dict | None = None) -> tuple[str, bool]:
    """(version, created): the packaged bundle as a version of the profile's registered model (logged as an
    artifact of the parent run, or referenced when large), tagged with its step, eval success, held-out action
    error, the weights' and the MANIFEST's sha256 and the run's provenance (name, params digest, every
    stage's cache key). A bundle that an earlier version already holds (the same MANIFEST, or the same policy:
    `policy_sha256`, e.g. the same weights trained through DVC instead of the flow, or evaluated again)
    registers nothing: that version is returned, with created False."""
    from mlflow.exceptions import MlflowException

    client = tracker.client
    name = prof.promote.registered_model
    try:
        client.create_registered_model(name, description=f"DreamZero policies from the {tracker.profile} profile")
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
        client.set_tag(tracker.run_id, "registered_model_version", f"{name}/{same[0]} (unchanged)")
        return str(same[0]), False
    if _bytes(_files(bundle)) <= MAX_ARTIFACT_MB * 2**20:  # an MLflow pyfunc model holding the bundle
        model_id, pyfunc = log_policy_model(tracker, bundle), "yes"
        source = f"models:/{model_id}"  # as mlflow.register_model writes it: the version page links the model
    else:  # too large to copy into the artifact store: a reference to the bundle, and no pyfunc
        bundle = kept_for_reference(bundle, manifest_sha256)
        tracker.reference(tracker.run_id, bundle, f"bundle/{bundle.name}")
        source, pyfunc = f"runs:/{tracker.run_id}/bundle/{bundle.name}", "no: the bundle is logged by reference"
        model_id = None
    action = package.get("action_error") or {}
    provenance = provenance or {}
    # the MANIFEST's digest pins every file of the bundle: `dz serve models:/...` checks it on each load
    tags = {"step": str(package["step"]), "package.version": package["version"],
            MANIFEST_SHA256_TAG: manifest_sha256, POLICY_SHA256_TAG: policy,
            "weights.sha256": package.get("weights_sha256") or "",
            "package.tarball": package["tarball"], "profile": tracker.profile,
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
    with _process_tracking_uri(tracker.uri):
        mv = client.create_model_version(name, source, run_id=tracker.run_id, tags=tags, model_id=model_id,
                                         description=f"step {package['step']}, package {package['version']}")
    if model_id:
        _link_version(tracker, model_id, name, mv.version)
    client.set_tag(tracker.run_id, "registered_model_version", f"{name}/{mv.version}")
    return str(mv.version), True


def head_to_head(uri: str, prof: Profile, version: str, candidate: Path, weights_sha256: str,
                 registry: Registry, alias: str | None = None) -> dict | None:
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
        bundle, manifest = pinned_registered_bundle(f"models:/{p.registered_model}/{current.version}",
                                                    registry=registry)
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


def registered_head_to_head(uri: str, prof: Profile, version: str, registry: Registry,
                            alias: str | None = None) -> dict | None:
    """`head_to_head` for a version already in the registry (`dz promote`): its bundle comes from there."""
    from mlflow.exceptions import MlflowException

    if prof.promote.max_regression is None:
        return None
    name = prof.promote.registered_model
    try:
        bundle, _ = pinned_registered_bundle(f"models:/{name}/{version}", registry=registry)
        weights = _client(uri).get_model_version(name, version).tags.get("weights.sha256", "")
    except (RegistryError, OSError, MlflowException) as exc:
        return {"compared": False, "reason": f"v{version}'s bundle could not be fetched: {str(exc).splitlines()[0]}"}
    return head_to_head(uri, prof, version, bundle, weights, registry, alias)


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


def registered_health(uri: str, prof: Profile, version: str, registry: Registry) -> tuple[bool, str]:
    """The health gate of a registered version: its bundle as the registry serves it (the MANIFEST recorded at
    registration: `pinned_registered_bundle`), then `bundle_health`."""
    from mlflow.exceptions import MlflowException

    name = prof.promote.registered_model
    try:
        bundle, manifest = pinned_registered_bundle(f"models:/{name}/{version}", registry=registry)
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


def version_model_id(mv) -> str | None:
    """The id of the logged model a version was registered from: its `model_id` where the store keeps one (a file
    store; a SQL store, behind a server too, keeps none), else its models:/<id> source, else the tag."""
    source = LOGGED_MODEL_SOURCE.match(mv.source or "")
    return getattr(mv, "model_id", None) or (source and source.group(1)) or mv.tags.get("logged_model_id") or None


def register_and_promote(tracker: Tracker, prof: Profile, package_result: dict, registry: Registry,
                         provenance: dict | None = None, log=print) -> dict:
    """Register the packaged model (an unchanged bundle: the version that holds it already), then give it the
    deployment alias only if it passes the gate and is no worse than the model holding the alias, both measured
    on the candidate's held-out episodes. What the flow's task and `dz track` (the DVC path) both call."""
    from mlflow.exceptions import MlflowException

    version, created = register(tracker, prof, package_result, provenance)
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
                           comparison=lambda v: head_to_head(tracker.uri, prof, v, Path(package_result["bundle"]),
                                                              package_result.get("weights_sha256") or "", registry))
    decision["registered"] = "new version" if created else "unchanged: this version holds the same policy"
    log(f"registry: {p.registered_model} v{version} ({decision['registered']}): {decision['reason']}")
    return decision


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
