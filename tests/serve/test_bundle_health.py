"""The registry's health gate (`tasks.tracking.bundle_health`) on a real tiny bundle: it passes a packaged policy
and refuses one whose files no longer match MANIFEST, or whose weights hold a NaN even with a matching MANIFEST."""

import shutil
import tarfile

import numpy as np
import pytest

pytest.importorskip("mlflow", reason="the registry commands need mlflow (make setup)")


def _unpacked(tarball, dest):
    with tarfile.open(tarball) as t:
        t.extractall(dest, filter="data")
    return next(p.parent for p in dest.rglob("MANIFEST"))


def test_a_packaged_policy_is_healthy_and_a_nan_or_a_changed_file_is_not(libero_bundle, tmp_path):
    from safetensors.numpy import load_file, save_file

    from dzmodel.serve.package import MANIFEST, _manifest_lines
    from tasks.registry import bundle_health

    bundle = _unpacked(libero_bundle, tmp_path / "a")
    ok, why = bundle_health(bundle)
    assert ok and "finite" in why, why

    weights = sorted(bundle.rglob("*.safetensors"))[0]
    tensors = load_file(str(weights))
    key = next(k for k, v in tensors.items() if v.dtype.kind == "f" and v.size)
    tensors[key] = tensors[key].copy()
    tensors[key].flat[0] = np.nan
    save_file(tensors, str(weights))
    ok, why = bundle_health(bundle)  # the file changed under its MANIFEST
    assert not ok and "(the file was modified)" in why and weights.name in why, why

    (bundle / MANIFEST).write_text("\n".join(_manifest_lines(bundle)) + "\n")  # a MANIFEST that lists the NaN
    ok, why = bundle_health(bundle)
    assert not ok and why == f"health: weights not finite ({weights.name}: {key})", why

    half = _unpacked(libero_bundle, tmp_path / "c")  # bf16 weights (the 5B bundles'): checked, and healthy
    import torch
    from safetensors.torch import load_file as load_pt, save_file as save_pt

    for f in half.rglob("*.safetensors"):
        save_pt({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_pt(str(f)).items()}, str(f))
    (half / MANIFEST).write_text("\n".join(_manifest_lines(half)) + "\n")
    ok, why = bundle_health(half)
    assert ok and "finite" in why, why

    empty = _unpacked(libero_bundle, tmp_path / "b")
    for f in empty.rglob("*.safetensors"):
        f.unlink()
    (empty / MANIFEST).write_text("\n".join(_manifest_lines(empty)) + "\n")
    ok, why = bundle_health(empty)
    assert not ok and why.startswith("health: the bundle holds no weights"), why
    shutil.rmtree(tmp_path / "b")
