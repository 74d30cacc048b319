"""Hostile registry entries for `dz serve models:/...`: a poisoned download cache, references that point outside
the project, version sources outside the tracking store, and versions without a recorded MANIFEST digest.
A local sqlite tracking store; no Prefect."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from dzmodel.config import StagePaths, load_params
from dzmodel.serve.bundles import file_sha256
from dzmodel.serve.package import load_package
from tests.hostile.test_bundles_hostile import EVIL, FILES, make_bundle, regenerate_manifest

ROOT = Path(__file__).resolve().parents[2]
NAME = "dreamzero-demo"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project with a tracked parent run and the demo profile's package output."""
    from tasks.tracking import Tracker

    root = tmp_path_factory.mktemp("project")
    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        prof = load_params(root / "params.yaml").selected("demo")
        paths = StagePaths(root, "demo")
        tracker = Tracker.start(prof, "demo", paths)
    return root, prof, paths, tracker


@pytest.fixture
def env(project, tmp_path, monkeypatch):
    root = project[0]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DZ_BUNDLE_ROOTS", raising=False)
    monkeypatch.setenv("DZ_BUNDLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(root)
    return project


def register(project, bundle_name: str) -> tuple[str, Path]:
    """What the pipeline's register step does with a freshly packaged bundle."""
    from tasks import registry

    _, prof, paths, tracker = project
    # its own content: the registry gives an identical bundle the version that holds it already
    bundle = make_bundle(paths.stage("package") / bundle_name, {**FILES, "model/name.txt": bundle_name.encode()})
    version, _ = registry.register(tracker, prof, {"bundle": str(bundle), "tarball": f"{bundle}.tar.gz", "step": 3,
                                                   "version": "1.0.0", "success_rate": 0.5, "action_error": None})
    return version, bundle


def forged_version(project, source: str, manifest_sha256: str | None, ref: dict | None = None) -> str:
    """A version written straight into the registry by someone with write access to it."""
    _, prof, _, tracker = project
    client = tracker.client
    if not client.search_registered_models(f"name = '{NAME}'"):
        client.create_registered_model(NAME)
    run_id = client.create_run(tracker.experiment_id).info.run_id
    if ref is not None:
        client.log_dict(run_id, ref, "bundle/evil/evil.ref.json")
        source = f"runs:/{run_id}/bundle/evil"
    tags = {} if manifest_sha256 is None else {"bundle.manifest_sha256": manifest_sha256}
    return str(client.create_model_version(NAME, source, run_id=run_id, tags=tags).version)


def test_registration_records_the_manifest_digest(env):
    version, bundle = register(env, "dreamzero-demo-3")
    mv = env[3].client.get_model_version(NAME, version)
    assert mv.tags["bundle.manifest_sha256"] == sha256(bundle / "MANIFEST")


def test_a_poisoned_registry_download_is_refused_on_every_load(env):
    from tasks.resolver import RegistryError, resolve_registered_bundle

    version, _ = register(env, "dreamzero-demo-4")
    cached = resolve_registered_bundle(f"models:/{NAME}/{version}")
    assert load_package(cached).files == len(FILES) + 1  # with model/name.txt
    (cached / "model" / "w.bin").write_bytes(EVIL)  # someone rewrites the cached copy and its MANIFEST
    regenerate_manifest(cached)
    with pytest.raises(RegistryError, match=rf"{cached}/MANIFEST: sha256 \w+ does not match"):
        resolve_registered_bundle(f"models:/{NAME}/{version}")


def test_a_reference_resolves_inside_the_runs_folder_and_is_pinned(env, monkeypatch):
    from tasks import resolver

    monkeypatch.setattr("tasks.registry.MAX_ARTIFACT_MB", 0)  # the bundle is logged by reference, as large ones are
    version, packaged = register(env, "dreamzero-demo-5")
    bundle = resolver.resolve_registered_bundle(f"models:/{NAME}/{version}")
    # kept apart from the package folder, which the next package run replaces
    assert bundle.parent.parent == env[2].store("package").resolve() and bundle.name == packaged.name
    assert file_sha256(bundle / "MANIFEST") == file_sha256(packaged / "MANIFEST")
    shutil.rmtree(packaged.parent)  # the next run of the package stage
    assert resolver.resolve_registered_bundle(f"models:/{NAME}/{version}") == bundle
    (bundle / "model" / "w.bin").write_bytes(EVIL)
    regenerate_manifest(bundle)
    with pytest.raises(resolver.RegistryError, match=rf"{bundle.resolve()}/MANIFEST: sha256 \w+ does not match"):
        resolver.resolve_registered_bundle(f"models:/{NAME}/{version}")


@pytest.mark.parametrize("target", ["/etc", "../../", "{runs}/../../../../etc", "{outside}", "{link}"])
def test_a_reference_outside_the_bundle_roots_is_refused(env, tmp_path, target):
    from tasks.resolver import RegistryError, resolve_registered_bundle

    paths = env[2]
    outside = make_bundle(tmp_path / "elsewhere" / "b-1.0")  # a real bundle, its digest even recorded
    link = paths.stage("package") / f"link-{tmp_path.name}"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside)
    target = target.format(runs=paths.stage("package"), outside=outside, link=link)
    version = forged_version(env, "", sha256(outside / "MANIFEST"), ref={"path": target})
    with pytest.raises(RegistryError, match=r"evil\.ref\.json: .*outside the bundle roots"):
        resolve_registered_bundle(f"models:/{NAME}/{version}")


def test_a_version_source_outside_the_tracking_store_is_refused(env, tmp_path):
    from tasks.resolver import RegistryError, resolve_registered_bundle

    outside = make_bundle(tmp_path / "elsewhere" / "b-1.0")
    version = forged_version(env, outside.as_uri(), sha256(outside / "MANIFEST"))
    with pytest.raises(RegistryError, match=rf"version {version}'s source {outside.as_uri()} is neither a model logged"):
        resolve_registered_bundle(f"models:/{NAME}/{version}")
    assert not list((tmp_path / "cache").glob(f"registry/*/{NAME}/{version}"))
    # a path shaped like a logged model's, but not the location of any model of the store
    lookalike = make_bundle(tmp_path / "elsewhere" / "models" / f"m-{'0' * 32}" / "artifacts")
    version = forged_version(env, lookalike.as_uri(), sha256(lookalike / "MANIFEST"))
    with pytest.raises(RegistryError, match="is neither a model logged in this tracking store"):
        resolve_registered_bundle(f"models:/{NAME}/{version}")


def test_a_version_without_a_recorded_digest_is_refused(env):
    from tasks.resolver import RegistryError, resolve_registered_bundle

    _, bundle = register(env, "dreamzero-demo-6")
    tracker = env[3]
    version = forged_version(env, f"runs:/{tracker.run_id}/bundle/{bundle.name}", None)
    with pytest.raises(RegistryError, match=rf"version {version} has no bundle.manifest_sha256 tag"):
        resolve_registered_bundle(f"models:/{NAME}/{version}")


def test_promotion_finds_a_referenced_version_through_the_parameters_the_run_loaded(env, monkeypatch):
    """A run with `--set promote.registered_model=NAME` registers under NAME, which no profile of params.yaml
    names. Its head-to-head and health gates fetch that version's bundle (here registered by reference) through the
    parameters the run loaded, overrides included; read again from params.yaml, the name is unknown."""
    from tasks import registry
    from tasks.resolver import Registry, RegistryError, pinned_registered_bundle

    root, _, paths, tracker = env
    monkeypatch.setattr("tasks.registry.MAX_ARTIFACT_MB", 0)  # registered by reference, as large bundles are
    params = load_params(root / "params.yaml", ["promote.registered_model=lab-policy"], "demo")
    prof = params.selected("demo")
    bundle = make_bundle(paths.stage("package") / "lab-1", {**FILES, "model/name.txt": b"lab-1"})
    version, created = registry.register(tracker, prof, {"bundle": str(bundle), "tarball": f"{bundle}.tar.gz",
                                                         "step": 3, "version": "1.0.0", "success_rate": 0.5,
                                                         "action_error": None})
    assert created
    uri = f"models:/lab-policy/{version}"
    with pytest.raises(RegistryError, match="no profile in .*params.yaml registers 'lab-policy'"):
        pinned_registered_bundle(uri, root / "params.yaml")
    found, digest = pinned_registered_bundle(uri, registry=Registry.of("lab-policy", params, root, tracker.uri))
    assert found.name == "lab-1" and found.parent.parent == paths.store("package").resolve()
    assert digest == file_sha256(found / "MANIFEST")
    ok, why = registry.registered_health(tracker.uri, prof, version, Registry.of("lab-policy", params, root))
    assert "could not be fetched" not in why, why
