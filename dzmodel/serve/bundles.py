"""Bundle tarballs, extracted once into a content-addressed cache and verified while they are extracted.

    <cache>/<sha256 of the tarball>/<bundle name>/...     default cache: ~/.cache/dzmodel/bundles
                                                          (DZ_BUNDLE_CACHE, else $XDG_CACHE_HOME/dzmodel/bundles)

Nothing is written beside the tarball (it may be a DVC or Prefect output). Each member is checked as it
arrives: a plain file or directory under one top-level folder, within the size caps, listed in MANIFEST with
the same size and, once written, the same sha256. Extraction goes to a temporary directory inside the cache;
a refused tarball leaves nothing behind, and a cached directory that no longer verifies is replaced by a
fresh extraction rather than blocking the good tarball.

Checksums catch accidents, not someone who rewrites files and MANIFEST together. For that, a bundle may carry
MANIFEST.sig, a detached ed25519 signature over the MANIFEST bytes by the lab's key; a loader given the public
key (`dz serve --trust`, or DZ_TRUST_KEY) refuses a bundle without a valid one. Keys are the usual files:

    openssl genpkey -algorithm ed25519 -out lab.key        # private, stays with whoever releases bundles
    openssl pkey -in lab.key -pubout -out lab.pub          # public, goes to every robot PC

(an unencrypted OpenSSH ed25519 key pair, `ssh-keygen -t ed25519 -N ""`, works too). The signature is the raw
64 bytes, so `openssl pkeyutl -verify -pubin -inkey lab.pub -rawin -in MANIFEST -sigfile MANIFEST.sig` checks it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MANIFEST = "MANIFEST"
SIGNATURE = "MANIFEST.sig"      # optional: ed25519 signature over the MANIFEST bytes, not listed in MANIFEST
TRUST_ENV = "DZ_TRUST_KEY"      # a public key file: when set, every bundle load needs a valid SIGNATURE by it
COMPLETE = ".complete"          # written last: a cache entry without it is an interrupted extraction
MAX_MANIFEST_BYTES = 64 << 20
MAX_SIGNATURE_BYTES = 1024


class BundleError(ValueError):
    """A bundle that must not be used; the message names the file or member."""


@dataclass(frozen=True)
class ExtractLimits:
    max_total_bytes: int = 64 << 30        # all members together (a 14B model in bf16 is ~30 GB)
    max_member_bytes: int = 40 << 30
    max_members: int = 20_000
    keep_free_bytes: int = 1 << 30          # never fill the cache's disk


def default_cache_dir() -> Path:
    if os.environ.get("DZ_BUNDLE_CACHE"):
        return Path(os.environ["DZ_BUNDLE_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dzmodel" / "bundles"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_manifest(text: str, source: str) -> dict[str, tuple[str, int]]:
    """MANIFEST lines "sha256  size  path" -> {path: (sha256, size)}."""
    entries = {}
    for i, line in enumerate(text.splitlines(), 1):
        parts = line.split("  ", 2)
        if len(parts) != 3 or len(parts[0]) != 64 or not parts[1].isdigit():
            raise BundleError(f"{source}:{i}: malformed MANIFEST line {line!r}")
        entries[parts[2]] = (parts[0], int(parts[1]))
    return entries


def _member_path(tarball: Path, name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts or "\\" in name:
        raise BundleError(f"{tarball}: member {name!r} escapes the extraction directory")
    return path


def _extract_verified(tarball: Path, dest: Path, limits: ExtractLimits) -> Path:
    """Stream the tarball into `dest` (empty), checking every member; returns the bundle directory."""
    budget = min(limits.max_total_bytes, shutil.disk_usage(dest).free - limits.keep_free_bytes)
    top: str | None = None
    manifest: dict[str, tuple[str, int]] | None = None
    written: dict[str, tuple[str, int]] = {}
    total = members = 0
    try:
        tar = tarfile.open(tarball, "r|gz")     # streaming: a member is read once, in order, never seeked
    except (tarfile.TarError, OSError) as exc:
        raise BundleError(f"{tarball}: not a gzip tarball ({exc})") from None
    with tar:
        try:
            for m in tar:
                members += 1
                if members > limits.max_members:
                    raise BundleError(f"{tarball}: more than {limits.max_members} members; refused")
                path = _member_path(tarball, m.name)
                if top is None:
                    top = path.parts[0]
                elif path.parts[0] != top:
                    raise BundleError(f"{tarball}: expected one top-level bundle directory, found {top!r} and "
                                      f"{path.parts[0]!r}")
                target = dest.joinpath(*path.parts)
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if not m.isfile():
                    raise BundleError(f"{tarball}: member {m.name!r} is a link or device; refused")
                rel = PurePosixPath(*path.parts[1:]).as_posix()
                if rel == SIGNATURE:
                    if m.size > MAX_SIGNATURE_BYTES:
                        raise BundleError(f"{tarball}: {SIGNATURE} has {m.size} bytes; a signature has 64")
                elif manifest is not None:
                    if rel not in manifest:
                        raise BundleError(f"{tarball}: {rel} is not listed in {MANIFEST} (an added file)")
                    if manifest[rel][1] != m.size:
                        raise BundleError(f"{tarball}: {rel} has {m.size} bytes, {MANIFEST} says {manifest[rel][1]}")
                if m.size > limits.max_member_bytes or total + m.size > budget:
                    raise BundleError(f"{tarball}: member {m.name!r} ({m.size} bytes) exceeds the extraction cap "
                                      f"({budget} bytes in all, {limits.max_member_bytes} per file); refused")
                if rel in written or (rel in (MANIFEST, SIGNATURE) and target.exists()):
                    raise BundleError(f"{tarball}: {rel} appears twice")
                total += m.size
                target.parent.mkdir(parents=True, exist_ok=True)
                h = hashlib.sha256()
                src = tar.extractfile(m)
                with open(target, "wb") as out:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        out.write(block)
                if rel == MANIFEST:
                    manifest = parse_manifest(target.read_text(), f"{tarball}:{MANIFEST}")
                    # members written before MANIFEST are checked against it now, the rest as they come
                    if sum(size for _, size in manifest.values()) > budget:
                        raise BundleError(f"{tarball}: {MANIFEST} lists more than the extraction cap ({budget} bytes)")
                    budget = min(budget, total + sum(size for _, size in manifest.values()) + MAX_SIGNATURE_BYTES)
                elif rel != SIGNATURE:
                    written[rel] = (h.hexdigest(), m.size)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise BundleError(f"{tarball}: corrupt or truncated tarball ({exc})") from None
    if top is None:
        raise BundleError(f"{tarball}: empty tarball")
    if manifest is None:
        raise BundleError(f"{tarball}: no {MANIFEST} (not a dz package)")
    for rel in sorted(set(manifest) - set(written)):
        raise BundleError(f"{tarball}: {rel} is listed in {MANIFEST} but missing")
    for rel, got in sorted(written.items()):
        if rel not in manifest:
            raise BundleError(f"{tarball}: {rel} is not listed in {MANIFEST} (an added file)")
        if got != manifest[rel]:
            raise BundleError(f"{tarball}: {rel}: checksum mismatch against {MANIFEST} (the file was modified)")
    return dest / top


def cached_bundle(tarball: str | Path, cache_dir: str | Path | None = None,
                  limits: ExtractLimits = ExtractLimits()) -> tuple[Path, bool]:
    """The bundle directory of `tarball` in the cache, extracting and verifying it if needed.

    Returns (bundle directory, fresh): fresh is True when it was extracted (and verified) just now; a cached
    directory is for the caller to verify, against the tarball's own MANIFEST (`tarball_manifest`), since anyone
    who can write the cache can rewrite its files and MANIFEST together; drop it with `evict` if it fails."""
    tarball = Path(tarball)
    if not tarball.is_file():
        raise BundleError(f"{tarball}: no such bundle tarball")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / file_sha256(tarball)
    if (entry / COMPLETE).is_file():
        tops = [p for p in entry.iterdir() if p.is_dir()]
        if len(tops) == 1:
            return tops[0], False
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name[:16]}.", suffix=".tmp", dir=cache))
    try:
        root = _extract_verified(tarball, tmp, limits)
        (tmp / COMPLETE).write_text(f"{tarball.resolve()}\n")
        evict(entry)                           # a stale or interrupted entry of the same tarball
        os.replace(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry / root.name, True


def evict(entry: Path) -> None:
    """Remove a cache entry (a bundle's <sha256> directory) that failed verification or is stale."""
    if entry.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{entry.name[:16]}.old-", dir=entry.parent))
        os.replace(entry, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)


def tarball_manifest(tarball: str | Path) -> bytes:
    """The MANIFEST inside a tarball, read without extracting anything else (`dz package` writes it first)."""
    tarball = Path(tarball)
    try:
        with tarfile.open(tarball, "r|gz") as tar:
            for m in tar:
                parts = PurePosixPath(m.name).parts
                if len(parts) == 2 and parts[1] == MANIFEST and m.isfile():
                    if m.size > MAX_MANIFEST_BYTES:
                        raise BundleError(f"{tarball}: {MANIFEST} has {m.size} bytes; refused")
                    return tar.extractfile(m).read()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BundleError(f"{tarball}: corrupt or truncated tarball ({exc})") from None
    raise BundleError(f"{tarball}: no {MANIFEST} (not a dz package)")


# --- signatures -----------------------------------------------------------------------------------


def _read_key_file(path: Path, kind: str) -> bytes:
    if not path.is_file():
        raise BundleError(f"{path}: {kind} key file not found")
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise BundleError(f"{path}: bundle signatures need the cryptography package (the serve extra)") from None
    return path.read_bytes()


def load_signing_key(path: str | Path):
    """An unencrypted ed25519 private key: PEM (`openssl genpkey -algorithm ed25519`) or OpenSSH."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    data = _read_key_file(path, "private")
    try:
        if b"-----BEGIN OPENSSH PRIVATE KEY-----" in data:
            key = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise BundleError(f"{path}: not an ed25519 private key in PEM or OpenSSH form, or it is encrypted ({exc}); "
                          "make one with `openssl genpkey -algorithm ed25519 -out lab.key`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError(f"{path}: not an ed25519 private key (a {type(key).__name__})")
    return key


def load_trusted_key(path: str | Path):
    """An ed25519 public key: PEM (`openssl pkey -in lab.key -pubout`) or an OpenSSH `ssh-ed25519 ...` line."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    path = Path(path)
    data = _read_key_file(path, "public")
    try:
        if data.lstrip().startswith(b"ssh-"):
            key = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise BundleError(f"{path}: not an ed25519 public key in PEM or OpenSSH form ({exc}); "
                          "make it with `openssl pkey -in lab.key -pubout -out lab.pub`") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BundleError(f"{path}: not an ed25519 public key (a {type(key).__name__})")
    return key


def sign_manifest(manifest: bytes, key) -> bytes:
    """The detached signature (raw 64 bytes) of a MANIFEST's exact bytes."""
    return key.sign(manifest)


def check_signature(root: Path, manifest: bytes, trusted_key_file: str | Path) -> None:
    """Raise BundleError unless root/MANIFEST.sig is a valid signature of `manifest` by the trusted key."""
    from cryptography.exceptions import InvalidSignature

    key = load_trusted_key(trusted_key_file)
    sig = root / SIGNATURE
    if not sig.is_file():
        raise BundleError(f"{sig}: missing: the bundle is not signed, and bundles must be signed by the key "
                          f"{trusted_key_file} (--trust or {TRUST_ENV})")
    try:
        key.verify(sig.read_bytes()[:MAX_SIGNATURE_BYTES + 1], manifest)
    except (InvalidSignature, ValueError):
        raise BundleError(f"{sig}: not a valid signature of {root / MANIFEST} by {trusted_key_file}: the bundle "
                          "was changed after it was signed, or another key signed it") from None
