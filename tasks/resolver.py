"""`models:/<name>@<alias>` or `models:/<name>/<version>` -> the bundle the registry pinned, for `dz serve` (the
`dz.bundle_resolvers` entry point) and for the promotion gate's head-to-head.

A version's source must be a model logged in the tracking store or a runs:/ path of it, its bundle's MANIFEST must
have the sha256 recorded at registration, and a bundle registered by reference must lie inside the package folders
of a profile that registers the name (or DZ_BUNDLE_ROOTS). Where those are read from is a `Registry`: built from
the loaded parameters (the pipeline, `dz promote`: any `--set` applies) or from a params.yaml path (`dz serve`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dzmodel.config import Params, StagePaths, load_params
from dzmodel.serve.bundles import MANIFEST, file_sha256

from .tracking import _client, mask_uri, tracking_uri

MANIFEST_SHA256_TAG = "bundle.manifest_sha256"  # on each model version: the sha256 of its bundle's MANIFEST
BUNDLE_ROOTS_ENV = "DZ_BUNDLE_ROOTS"  # more folders (os.pathsep-separated) that registry references may point into
LOGGED_MODEL_SOURCE = re.compile(r"^models:/(m-[0-9a-f]{32})$")

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))$")


class RegistryError(ValueError):
    """A models:/ URI that does not resolve to a servable bundle; the message says what to set."""


def _env_roots() -> list[Path]:
    """The folders DZ_BUNDLE_ROOTS lists."""
    return [Path(p).expanduser().resolve() for p in os.environ.get(BUNDLE_ROOTS_ENV, "").split(os.pathsep) if p]


@dataclass(frozen=True)
class Registry:
    """Where the versions of one registered model are read: the tracking store holding them, and the folders a
    version registered by reference may point into."""
    uri: str
    roots: tuple[Path, ...]

    @classmethod
    def of(cls, name: str, params: Params, project: Path, uri: str | None = None,
           where: str = "the parameters") -> "Registry":
        """From loaded parameters (any `--set` already applied): the store is `uri` when given (the run's own),
        else MLFLOW_TRACKING_URI, else that of the profile registering `name`; the roots are the package stage's
        folders (unkeyed, and the flow's keyed store) of each profile registering `name`, and DZ_BUNDLE_ROOTS."""
        project = Path(project).resolve()
        registering = [(profile, prof) for profile, prof in params.profiles.items()
                       if prof.promote.registered_model == name]
        uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            if not registering:
                raise RegistryError(f"models:/{name}: no profile in {where} registers {name!r}; set MLFLOW_TRACKING_URI")
            profile, prof = registering[0]
            uri = tracking_uri(prof, StagePaths(project, profile).root)
        roots = _env_roots()
        for profile, _ in registering:
            paths = StagePaths(project, profile)
            roots += [paths.stage("package").resolve(), paths.store("package").resolve()]
        return cls(uri, tuple(roots))

    @classmethod
    def from_file(cls, name: str, params_file: str | Path) -> "Registry":
        """`of` the parameters in `params_file` (as written, no overrides): what `dz serve models:/...` has."""
        params_file = Path(params_file)
        if params_file.is_file():
            return cls.of(name, load_params(params_file), params_file.parent, where=str(params_file))
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            raise RegistryError(f"models:/{name}: set MLFLOW_TRACKING_URI, or run from the project (no {params_file})")
        roots = _env_roots()
        return cls(os.environ["MLFLOW_TRACKING_URI"], tuple(roots))


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


def pinned_registered_bundle(uri: str, params_file: str | Path = "params.yaml", cache_dir: Path | None = None,
                             registry: Registry | None = None) -> tuple[Path, str]:
    """`models:/<name>@<alias>` or `models:/<name>/<version>` -> a local bundle directory (downloaded into the
    bundle cache's registry/ folder, once per version), for `dz serve` to verify and serve.

    On every call, the bundle's MANIFEST must have the sha256 recorded at registration (so a cached download
    or a referenced bundle changed since is refused; `load_package` then checks each file against MANIFEST).
    The version's source must be a model logged in the tracking store (models:/<model id>, or its location) or a
    runs:/ path of the store, and a reference (`*.ref.json`, for large bundles) must point inside the package
    folder of a profile that registers the name, or DZ_BUNDLE_ROOTS. Those come from `registry` when given (the
    loaded parameters), else from `params_file` (`Registry.from_file`)."""
    import shutil
    import tempfile

    from mlflow.exceptions import MlflowException

    from dzmodel.serve.bundles import default_cache_dir

    m = MODEL_URI.match(uri)
    if m is None:
        raise RegistryError(f"{uri}: expected models:/<name>@<alias> or models:/<name>/<version>")
    name = m["name"]
    places = registry or Registry.from_file(name, params_file)
    registry = places.uri
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
        bundle, where = _referenced_bundle(refs[0], list(places.roots)), "the referenced bundle"
    else:
        raise RegistryError(f"{uri}: version {mv.version}'s source {source} holds no bundle (no {MANIFEST}, or not "
                            "exactly one reference): re-run the package stage")
    digest = file_sha256(bundle / MANIFEST)
    if digest != expected:
        raise RegistryError(f"{bundle / MANIFEST}: sha256 {digest} does not match {expected}, registered for {uri} "
                            f"(version {mv.version}): {where} was changed after registration; refused")
    print(f"{uri} -> version {mv.version} ({source})", flush=True)
    return bundle, expected  # the loader checks the MANIFEST against it again as it reads the files
