"""Hostile bundles: files rewritten together with their MANIFEST, a poisoned bundle cache, missing or forged
signatures. Checksums catch accidents; only a signature by the lab's key (`--trust`) catches a rewrite."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tarfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dzmodel.cli import main
from dzmodel.serve.package import PackageError, RobotConfig, build_package, load_package, sign_bundle, verify_package
from tests.serve.test_package import ROBOT, model  # noqa: F401  (the tiny converted model fixture)

FILES = {"robot.json": json.dumps(ROBOT).encode(), "embodiment.json": b"{}", "model/w.bin": b"\x00" * 1000}
EVIL = b"\x66" * 1000


def keypair(folder: Path, name: str = "lab") -> tuple[Path, Path]:
    """What `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` write: PKCS8 and SPKI PEM."""
    key = Ed25519PrivateKey.generate()
    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def regenerate_manifest(root: Path) -> None:
    """What an attacker who rewrites files does next: a MANIFEST that matches them."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in ("MANIFEST", "MANIFEST.sig"))
    (root / "MANIFEST").write_text("".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.stat().st_size}  {p.relative_to(root).as_posix()}\n"
        for p in files))


def make_bundle(root: Path, files: dict[str, bytes] = FILES) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    regenerate_manifest(root)
    return root


def make_tarball(root: Path, path: Path) -> Path:
    """MANIFEST first, as `dz package` writes it."""
    with tarfile.open(path, "w:gz") as tar:
        tar.add(root, arcname=root.name, recursive=False)
        tar.add(root / "MANIFEST", arcname=f"{root.name}/MANIFEST")
        for child in sorted(root.iterdir()):
            if child.name != "MANIFEST":
                tar.add(child, arcname=f"{root.name}/{child.name}")
    return path


def test_rewritten_files_with_a_regenerated_manifest_pass_checksums_but_not_trust(tmp_path):
    key, pub = keypair(tmp_path)
    root = make_bundle(tmp_path / "b-1.0")
    sign_bundle(root, key)
    assert load_package(root, trust=pub).files == len(FILES)
    (root / "model" / "w.bin").write_bytes(EVIL)
    regenerate_manifest(root)
    assert verify_package(root) == len(FILES)  # checksums alone cannot tell
    with pytest.raises(PackageError, match=r"MANIFEST\.sig: not a valid signature of .*MANIFEST by .*lab\.pub"):
        load_package(root, trust=pub)


def test_unsigned_and_foreign_signed_bundles_are_refused_under_trust(tmp_path, monkeypatch):
    _, pub = keypair(tmp_path)
    other_key, _ = keypair(tmp_path, "intruder")
    unsigned = make_bundle(tmp_path / "unsigned-1.0")
    with pytest.raises(PackageError, match=r"unsigned-1\.0/MANIFEST\.sig: missing"):
        load_package(unsigned, trust=pub)
    monkeypatch.setenv("DZ_TRUST_KEY", str(pub))  # the lab-wide setting: every load needs the signature
    with pytest.raises(PackageError, match=r"MANIFEST\.sig: missing"):
        load_package(unsigned)
    foreign = make_bundle(tmp_path / "foreign-1.0")
    sign_bundle(foreign, other_key)
    with pytest.raises(PackageError, match=r"foreign-1\.0/MANIFEST\.sig: not a valid signature"):
        load_package(foreign)
    (foreign / "MANIFEST.sig").write_bytes(b"\x00" * 7)
    with pytest.raises(PackageError, match=r"MANIFEST\.sig: not a valid signature"):
        load_package(foreign)


def test_a_forged_tarball_keeping_the_old_signature_is_refused_under_trust(tmp_path):
    key, pub = keypair(tmp_path)
    root = make_bundle(tmp_path / "src" / "b-1.0")
    sign_bundle(root, key)
    good = make_tarball(root, tmp_path / "b-1.0.tar.gz")
    assert load_package(good, tmp_path / "cache", trust=pub).files == len(FILES)
    (root / "model" / "w.bin").write_bytes(EVIL)
    regenerate_manifest(root)  # MANIFEST.sig is the genuine one, over the old MANIFEST
    (tmp_path / "forged").mkdir()
    forged = make_tarball(root, tmp_path / "forged" / "b-1.0.tar.gz")
    assert load_package(forged, tmp_path / "cache").files == len(FILES)  # self-consistent: checksums pass
    with pytest.raises(PackageError, match=r"MANIFEST\.sig: not a valid signature"):
        load_package(forged, tmp_path / "cache", trust=pub)


@pytest.mark.parametrize("poison", ["modified file", "added file"])
def test_a_poisoned_cache_entry_is_never_served(tmp_path, caplog, poison):
    """Someone rewrites the cached extraction and its MANIFEST to match: the next load checks the cached
    MANIFEST against the tarball's own, refuses the entry, and serves a fresh extraction."""
    tb = make_tarball(make_bundle(tmp_path / "src" / "b-1.0"), tmp_path / "b-1.0.tar.gz")
    cache = tmp_path / "cache"
    root = load_package(tb, cache).root
    if poison == "modified file":
        (root / "model" / "w.bin").write_bytes(EVIL)
    else:
        (root / "model" / "hook.py").write_text("import os\n")
    regenerate_manifest(root)
    with caplog.at_level(logging.WARNING, logger="dzmodel.serve"):
        served = load_package(tb, cache).root
    assert (served / "model" / "w.bin").read_bytes() == FILES["model/w.bin"]
    assert not (served / "model" / "hook.py").exists()
    assert f"{root}/MANIFEST" in caplog.text and "does not match" in caplog.text


def test_a_poisoned_signed_cache_entry_is_refused_under_trust(tmp_path):
    key, pub = keypair(tmp_path)
    root = make_bundle(tmp_path / "src" / "b-1.0")
    sign_bundle(root, key)
    tb = make_tarball(root, tmp_path / "b-1.0.tar.gz")
    cached = load_package(tb, tmp_path / "cache", trust=pub).root
    (cached / "model" / "w.bin").write_bytes(EVIL)
    regenerate_manifest(cached)
    served = load_package(tb, tmp_path / "cache", trust=pub).root
    assert (served / "model" / "w.bin").read_bytes() == FILES["model/w.bin"]


def test_dz_package_sign_and_dz_serve_trust(model, tmp_path, monkeypatch, capsys):
    root, hf = model
    key, pub = keypair(tmp_path)
    assert main(["package", str(hf), "--robot", str(root / "robot.json"), "--version", "1.0.0", "--sign", str(key),
                 "--out", str(tmp_path / "out")]) == 0
    bundle = tmp_path / "out" / "dreamzero-tabletop_pusher-1.0.0"
    tarball = tmp_path / "out" / "dreamzero-tabletop_pusher-1.0.0.tar.gz"
    assert (bundle / "MANIFEST.sig").is_file() and "MANIFEST.sig" not in (bundle / "MANIFEST").read_text()
    assert load_package(tarball, tmp_path / "cache", trust=pub).root.name == bundle.name
    assert load_package(bundle, trust=pub).files > 5

    # `dz serve --trust` refuses an unsigned bundle before it loads anything
    unsigned, _ = build_package(hf, tmp_path / "out", RobotConfig.from_dict(ROBOT), "1.0.1")
    monkeypatch.setenv("DZ_SERVE_TOKEN", "a-long-enough-token")
    monkeypatch.setenv("DZ_TRUST_KEY", "placeholder")
    monkeypatch.delenv("DZ_TRUST_KEY")  # restored to unset after the test, whatever --trust does
    capsys.readouterr()
    assert main(["serve", "--trust", str(pub), str(unsigned)]) == 2
    assert f"{unsigned}/MANIFEST.sig: missing" in capsys.readouterr().err
    # a key file that is not an ed25519 public key is one clear error naming it
    (tmp_path / "junk.pub").write_text("not a key\n")
    assert main(["serve", "--trust", str(tmp_path / "junk.pub"), str(bundle)]) == 2
    assert f"{tmp_path / 'junk.pub'}: not an ed25519 public key" in capsys.readouterr().err
    assert main(["package", str(hf), "--robot", str(root / "robot.json"), "--version", "1.0.2", "--sign", str(pub),
                 "--out", str(tmp_path / "out")]) == 2
    assert f"{pub}: not an ed25519 private key" in capsys.readouterr().err
    assert not (tmp_path / "out" / "dreamzero-tabletop_pusher-1.0.2").exists()


def test_dz_serve_trust_never_turns_auth_off_and_no_auth_still_serves(tmp_path, monkeypatch, capsys):
    """--trust is about the bundle, not the clients: a token is still required, and --no-auth still works."""
    _, pub = keypair(tmp_path)
    monkeypatch.delenv("DZ_SERVE_TOKEN", raising=False)
    monkeypatch.delenv("DZ_TRUST_KEY", raising=False)
    missing = tmp_path / "missing.tar.gz"
    assert main(["serve", "--trust", str(pub), str(missing)]) == 2
    assert "dz serve needs a token" in capsys.readouterr().err
    assert main(["serve", "--no-auth", str(missing)]) == 2  # gets as far as the bundle
    err = capsys.readouterr().err
    assert "needs a token" not in err and str(missing) in err
