"""A bundle's files swapped between verification and loading: `dz serve` serves exactly the bytes it verified.

The swap happens at the worst moment: right after the bundle has passed its checks (load_package returned) and
before the policy is built from it. Another safetensors file is renamed over model/model.safetensors, as a
process with write access to the bundle (or to the bundle cache) could do."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import dzmodel.serve.package as package
import dzmodel.serve.server as server
from dzmodel.model.sampler import SolverConfig
from dzmodel.model.state_dict import strip_prefix
from dzmodel.serve.package import RobotConfig, build_package
from tests.hostile.test_bundles_hostile import keypair, regenerate_manifest
from tests.serve.test_package import ROBOT, model  # noqa: F401  (the tiny converted model fixture)

WEIGHTS = Path("model") / "model.safetensors"
VAE = Path("model") / "encoders" / "vae.safetensors"
SOLVER = SolverConfig(num_steps=2, cfg_scale=1.0)


@pytest.fixture(scope="module")
def bundles(model, tmp_path_factory):  # noqa: F811
    """(an unsigned bundle, a signed bundle, the lab's public key, a safetensors file of other weights)."""
    _, hf = model
    tmp = tmp_path_factory.mktemp("swap")
    key, pub = keypair(tmp)
    unsigned, _ = build_package(hf, tmp / "out", RobotConfig.from_dict(ROBOT), "1.0.0")
    signed, _ = build_package(hf, tmp / "out", RobotConfig.from_dict(ROBOT), "1.0.1", sign_key=key)
    for name, rel in (("other", WEIGHTS), ("other-vae", VAE)):
        other = {k: v + 1 if v.is_floating_point() else v for k, v in load_file(unsigned / rel).items()}
        save_file(other, tmp / f"{name}.safetensors", metadata={"format": "pt"})
    return unsigned, signed, pub, tmp


def swapped_over(target: Path, source: Path) -> None:
    """Rename a copy of `source` over `target`, as an attacker would (atomically, a new inode)."""
    copy = target.with_name(f"{target.name}.incoming")
    copy.write_bytes(source.read_bytes())
    os.replace(copy, target)


def swap_both(bundle: Path, others: Path) -> None:
    swapped_over(bundle / WEIGHTS, others / "other.safetensors")
    swapped_over(bundle / VAE, others / "other-vae.safetensors")


def serve(monkeypatch, tmp_path: Path, bundle: Path, swap, **kwargs):
    """`dz serve BUNDLE` up to the port opening, with `swap(Package)` run the moment verification has returned;
    returns the served BundlePolicy, after checking that dz left nothing in the temporary folder."""
    private = tmp_path / "tmpdir"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    verified = package.load_package

    def load_then_swap(*args, **kw):
        pkg = verified(*args, **kw)
        swap(pkg)
        return pkg

    served = {}
    monkeypatch.setattr(package, "load_package", load_then_swap)
    monkeypatch.setattr(server, "run_server", lambda srv, *a, **k: served.setdefault("policy", srv.policy))
    monkeypatch.setattr(server, "freeze_heap", lambda: 0)
    monkeypatch.setattr(server, "configure_logging", lambda: None)
    server.serve_bundle(str(bundle), token=None, solver=SOLVER, **kwargs)
    assert not list(private.iterdir())
    return served["policy"]


def different(got: dict, expected: dict) -> list[str]:
    assert expected and set(expected) <= set(got)
    return [k for k, v in expected.items() if not torch.equal(got[k], v)]


def assert_serves(policy, verified_bundle: Path) -> None:
    """Every tensor of the served model and of its VAE is bit-equal to the verified bundle's, and it predicts."""
    from dzmodel.policy.policy import load_policy

    expected = strip_prefix(load_file(verified_bundle / WEIGHTS))
    bad = different(policy.embodied.policy.model.state_dict(), expected)
    assert not bad, f"{len(bad)} of {len(expected)} tensors are not the verified ones: {bad[:3]}"
    vae = load_policy(verified_bundle / "model", solver=SOLVER).policy.vae.state_dict()
    assert not different(policy.embodied.policy.vae.state_dict(), vae)
    emb = policy.embodied
    views = {v: np.zeros((64, 64, 3), np.uint8) for v in emb.embodiment.views}
    chunk = emb.predict("s", views, np.zeros(emb.policy.state_stats.q01.shape[0]), "Push the block.")
    assert chunk.shape == (emb.action_horizon, emb.action_dim) and np.isfinite(chunk).all()


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trusted"])
def test_weights_renamed_over_a_bundle_directory_after_verification_are_not_served(bundles, tmp_path, monkeypatch,
                                                                                   trusted):
    unsigned, signed, pub, others = bundles
    source = signed if trusted else unsigned
    bundle = shutil.copytree(source, tmp_path / source.name)
    policy = serve(monkeypatch, tmp_path, bundle, lambda pkg: swap_both(bundle, others),
                   trust=str(pub) if trusted else None)
    assert_serves(policy, source)
    assert (bundle / WEIGHTS).read_bytes() == (others / "other.safetensors").read_bytes()  # the swap did happen


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trusted"])
def test_weights_renamed_over_the_bundle_cache_after_verification_are_not_served(bundles, tmp_path, monkeypatch,
                                                                                 trusted):
    unsigned, signed, pub, others = bundles
    source = signed if trusted else unsigned
    tarball = source.with_name(f"{source.name}.tar.gz")
    cache = tmp_path / "cache"
    monkeypatch.setenv("DZ_BUNDLE_CACHE", str(cache))

    def swap(pkg):
        cached = list(cache.glob(f"*/{source.name}"))
        assert len(cached) == 1
        swap_both(cached[0], others)

    policy = serve(monkeypatch, tmp_path, tarball, swap, trust=str(pub) if trusted else None)
    assert_serves(policy, source)


def test_a_bundle_naming_encoder_files_outside_itself_is_refused(bundles, tmp_path, monkeypatch):
    """Everything served comes from the verified bundle: encoder weights named by a path outside it are not."""
    import json

    unsigned, _, _, others = bundles
    bundle = shutil.copytree(unsigned, tmp_path / unsigned.name)
    outside = tmp_path / "vae.safetensors"
    shutil.move(bundle / VAE, outside)
    shutil.rmtree(bundle / VAE.parent)
    config = bundle / "model" / "experiment_cfg" / "train_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "encoder_weights": {"vae": str(outside)}}))
    regenerate_manifest(bundle)
    with pytest.raises(server.ServeError, match=rf"^{bundle}/model: no encoders/.*vae weights are files outside"):
        serve(monkeypatch, tmp_path, bundle, lambda pkg: None)


def test_a_plain_converted_directory_still_loads(model):  # noqa: F811
    """`dz eval` loads a converted model directory as it is, with no MANIFEST."""
    from dzmodel.policy.policy import load_policy

    _, hf = model
    policy = load_policy(hf, solver=SOLVER)
    expected = strip_prefix(load_file(hf / WEIGHTS.name))
    got = policy.policy.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
