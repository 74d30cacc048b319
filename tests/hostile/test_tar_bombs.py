"""Tar bombs: bundle tarballs, tiny on disk, whose headers or members would exhaust memory, disk or CPU before
anything in them is verified. Each is refused with one BundleError line, in bounded memory, time and disk:
the tarball is read by a streaming reader of its own (capped headers parsed without regular expressions),
MANIFEST comes first and is capped, and with a trusted key MANIFEST.sig is checked before any payload byte."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dzmodel.serve.bundles import BundleError, cached_bundle, tarball_manifest
from dzmodel.serve.package import PackageError, load_package

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
TOP = "b-1.0"
ROBOT = b"{}"


# --- building hostile tarballs -------------------------------------------------------------------


class Gzip:
    """A gzip file written piece by piece. A long run of one byte is written as one compressed 1 MiB block
    repeated (each block is flushed on its own, so it refers to nothing before it): a 512 MiB header is built
    in a fraction of a second and costs about 1 KB per MiB on disk."""

    def __init__(self, path: Path):
        self.path, self.crc, self.size = path, 0, 0
        self.f = path.open("wb")
        self.f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff")

    def write(self, data: bytes) -> "Gzip":
        z = zlib.compressobj(9, zlib.DEFLATED, -15)
        self.f.write(z.compress(data) + z.flush(zlib.Z_FULL_FLUSH))
        self.crc, self.size = zlib.crc32(data, self.crc), self.size + len(data)
        return self

    def run(self, byte: bytes, count: int) -> "Gzip":
        chunk = byte * MIB
        z = zlib.compressobj(9, zlib.DEFLATED, -15)
        block = z.compress(chunk) + z.flush(zlib.Z_FULL_FLUSH)
        for _ in range(count // MIB):
            self.f.write(block)
            self.crc, self.size = zlib.crc32(chunk, self.crc), self.size + MIB
        return self.write(byte * (count % MIB))

    def close(self) -> Path:
        self.f.write(zlib.compressobj(9, zlib.DEFLATED, -15).flush())
        self.f.write(struct.pack("<II", self.crc, self.size & 0xFFFFFFFF))
        self.f.close()
        return self.path


def header(name: str, size: int = 0, kind: bytes = tarfile.REGTYPE, fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mode = size, kind, 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info.tobuf(fmt)


def pad(size: int) -> bytes:
    return b"\0" * (-size % 512)


def member(name: str, data: bytes) -> bytes:
    return header(name, len(data)) + data + pad(len(data))


def pax_record(key_value: bytes) -> bytes:
    """b"LEN key=value\\n", LEN counting itself."""
    n = len(key_value) + 2
    length = n + len(str(n))
    length += len(str(length)) - len(str(n))
    return b"%d %s\n" % (length, key_value)


def end() -> bytes:
    return b"\0" * 1024


def manifest(files: dict[str, bytes]) -> bytes:
    return "".join(f"{hashlib.sha256(d).hexdigest()}  {len(d)}  {n}\n" for n, d in sorted(files.items())).encode()


def gnu_sparse_header(name: str, realsize: int, stored: int) -> bytes:
    """An old-GNU sparse member ('S'): `stored` bytes of data that extract to a `realsize`-byte file."""
    buf = bytearray(header(name, stored, fmt=tarfile.GNU_FORMAT))
    buf[156:157] = b"S"
    buf[386:398], buf[398:410] = b"%011o\0" % (realsize - stored), b"%011o\0" % stored  # data at the very end
    buf[483:495] = b"%011o\0" % realsize
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf)


def huge_manifest_line(path: Path) -> Path:
    """A 128 MiB MANIFEST that is one line (no newline): a sha256, a size and a 128 MiB path."""
    size = 128 * MIB
    lead = b"0" * 64 + b"  1  "
    return (Gzip(path).write(header(TOP, kind=tarfile.DIRTYPE) + header(f"{TOP}/MANIFEST", size) + lead)
            .run(b"a", size - len(lead)).write(end()).close())


def sparse_before_manifest(path: Path) -> Path:
    """A 2 GiB sparse member first, then a MANIFEST that lists it."""
    listing = b"0" * 64 + b"  %d  model/w.bin\n" % (2 << 30)
    return (Gzip(path).write(header(TOP, kind=tarfile.DIRTYPE) + gnu_sparse_header(f"{TOP}/model/w.bin", 2 << 30, 512)
                             + b"x" * 512 + member(f"{TOP}/MANIFEST", listing) + end()).close())


FILES = {"robot.json": ROBOT}


def huge_extended_header(path: Path, kind: str) -> Path:
    """A valid MANIFEST, then a member whose pax 'x' header (a 512 MiB path record) or GNU 'L' long name is
    512 MiB."""
    size = 512 * MIB
    gz = Gzip(path).write(header(TOP, kind=tarfile.DIRTYPE) + member(f"{TOP}/MANIFEST", manifest(FILES)))
    if kind == "pax":
        record_head = b"%d path=" % size
        gz.write(header("././@PaxHeader", size, tarfile.XHDTYPE) + record_head).run(b"a", size - len(record_head) - 1)
        gz.write(b"\n")
    else:
        gz.write(header("././@LongLink", size, tarfile.GNUTYPE_LONGNAME, tarfile.GNU_FORMAT)).run(b"a", size - 1)
        gz.write(b"\0")
    return gz.write(pad(size) + member(f"{TOP}/robot.json", ROBOT) + end()).close()


def digit_pax_header(path: Path, digits: int) -> Path:
    """A pax header that is nothing but digits, for the next member: the case that sends the regular expressions
    of Python's own pax parser (before 3.11.10) into quadratic backtracking."""
    return (Gzip(path).write(header("././@PaxHeader", digits, tarfile.XHDTYPE) + b"1" * digits + pad(digits)
                             + header(f"{TOP}/MANIFEST") + end()).close())


# --- measuring, in a child process -----------------------------------------------------------------

PROBE = """
import json, resource, signal, sys, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, 256 << 20))   # a safety net: no file past 256 MiB
from dzmodel.serve.bundles import BundleError, cached_bundle

def peak_kib():  # this process's own peak (VmHWM); ru_maxrss also counts the parent's size at fork
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

def written():
    for line in open("/proc/self/io"):
        if line.startswith("wchar:"):
            return int(line.split()[1])

rss, wrote, start = peak_kib(), written(), time.perf_counter()
try:
    cached_bundle(sys.argv[1], sys.argv[2], **({"trusted_key": sys.argv[3]} if sys.argv[3] else {}))
    error = None
except BundleError as exc:
    error = str(exc)
except BaseException as exc:
    error = f"NOT A BundleError: {type(exc).__name__}: {str(exc)[:200]}"
result = {"error": error, "seconds": time.perf_counter() - start, "written": written() - wrote,
          "rss_mb": (peak_kib() - rss) / 1024}
print(json.dumps(result))
"""


def probe(tarball: Path, cache: Path, trusted_key: Path | None = None, timeout: float = 20) -> dict:
    """cached_bundle(tarball) in a child: its error, seconds, bytes written and peak memory growth (MB)."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, str(tarball), str(cache), str(trusted_key or "")],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{tarball.name}: still reading after {timeout} s")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def assert_refused(result: dict, match: str, tarball: Path, cache: Path) -> None:
    error = result["error"]
    assert error is not None and not error.startswith("NOT A BundleError"), error
    assert "\n" not in error and len(error) < 600, error[:1000]
    assert str(tarball) in error and match in error, error
    assert result["rss_mb"] < 300, result
    assert not cache.exists() or list(cache.iterdir()) == []


# --- the four tarballs -------------------------------------------------------------------------------


def test_a_128_mib_manifest_line_is_refused_from_its_header(tmp_path):
    tb = huge_manifest_line(tmp_path / "line.tar.gz")
    assert tb.stat().st_size < 160_000  # about 128 KB on disk
    result = probe(tb, tmp_path / "cache")
    assert_refused(result, "MANIFEST", tb, tmp_path / "cache")
    assert result["written"] < 4096  # nothing of it reaches the cache


def test_a_long_manifest_line_under_the_byte_cap_is_quoted_short(tmp_path):
    line = b"0" * 64 + b"  1  " + b"a" * MIB
    tb = Gzip(tmp_path / "b.tar.gz").write(header(TOP, kind=tarfile.DIRTYPE) + member(f"{TOP}/MANIFEST", line)
                                           + end()).close()
    with pytest.raises(BundleError) as err:
        cached_bundle(tb, tmp_path / "cache")
    assert "MANIFEST" in str(err.value) and len(str(err.value)) < 400 and "\n" not in str(err.value)


def test_a_2_gib_sparse_member_before_manifest_writes_nothing(tmp_path):
    tb = sparse_before_manifest(tmp_path / "sparse.tar.gz")
    assert tb.stat().st_size < 1200  # a few hundred bytes on disk
    with tarfile.open(tb, "r|gz") as tar:  # what Python's tarfile makes of it: a 2 GiB file
        tar.next()
        sparse = tar.next()
        assert sparse.issparse() and sparse.size == 2 << 30
    result = probe(tb, tmp_path / "cache")
    assert_refused(result, "w.bin", tb, tmp_path / "cache")
    assert result["written"] < 4096


@pytest.mark.parametrize("kind", ["pax", "gnu"])
def test_a_512_mib_extended_header_is_refused_from_its_size(tmp_path, kind):
    tb = huge_extended_header(tmp_path / f"{kind}.tar.gz", kind)
    assert tb.stat().st_size < 700_000
    result = probe(tb, tmp_path / "cache")
    assert_refused(result, "extended header", tb, tmp_path / "cache")
    assert result["written"] <= len(manifest(FILES)) + len(ROBOT) + 4096  # MANIFEST and at most its total
    assert result["seconds"] < 2


@pytest.mark.parametrize("digits, on_disk", [(200_000, 400), (1_000_000, 1200)])
def test_a_pax_header_of_digits_is_refused_in_under_a_second(tmp_path, digits, on_disk):
    tb = digit_pax_header(tmp_path / "digits.tar.gz", digits)
    assert tb.stat().st_size < on_disk  # a few hundred bytes, about 1 KB
    result = probe(tb, tmp_path / "cache")
    assert_refused(result, "pax extended header", tb, tmp_path / "cache")
    assert result["seconds"] < 1


def test_a_pax_header_of_digits_under_the_header_cap_is_refused_in_under_a_second(tmp_path):
    tb = digit_pax_header(tmp_path / "digits.tar.gz", 60_000)
    start = time.perf_counter()
    with pytest.raises(BundleError, match="malformed pax header"):
        cached_bundle(tb, tmp_path / "cache")
    assert time.perf_counter() - start < 1


# --- the reader's other refusals ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["gnu after MANIFEST", "pax after MANIFEST"])
def test_sparse_members_are_refused_wherever_they_are(tmp_path, where):
    listing = b"0" * 64 + b"  %d  robot.json\n" % (2 << 30)
    gz = Gzip(tmp_path / "b.tar.gz").write(header(TOP, kind=tarfile.DIRTYPE) + member(f"{TOP}/MANIFEST", listing))
    if where.startswith("gnu"):
        gz.write(gnu_sparse_header(f"{TOP}/robot.json", 2 << 30, 512) + b"x" * 512)
    else:
        records = b"".join(map(pax_record, (b"GNU.sparse.major=1", b"GNU.sparse.minor=0",
                                            b"GNU.sparse.realsize=2147483648")))
        gz.write(header("././@PaxHeader", len(records), tarfile.XHDTYPE) + records + pad(len(records))
                 + header(f"{TOP}/robot.json", 512) + b"x" * 512)
    tb = gz.write(end()).close()
    with pytest.raises(BundleError, match="a sparse file"):
        cached_bundle(tb, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_header_with_a_bad_checksum_is_refused_by_name(tmp_path):
    bad = bytearray(header(f"{TOP}/MANIFEST", 10))
    bad[0:1] = b"c"  # the stored checksum no longer matches
    tb = Gzip(tmp_path / "b.tar.gz").write(header(TOP, kind=tarfile.DIRTYPE) + bytes(bad) + b"x" * 10 + pad(10)
                                           + end()).close()
    with pytest.raises(BundleError, match=r"header checksum"):
        cached_bundle(tb, tmp_path / "cache")
    with pytest.raises(BundleError, match=r"header checksum"):
        tarball_manifest(tb)


# --- MANIFEST first, MANIFEST.sig right after it ----------------------------------------------------------


def keypair(folder: Path, name: str = "lab") -> tuple[Ed25519PrivateKey, Path]:
    key = Ed25519PrivateKey.generate()
    public = folder / f"{name}.pub"
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return key, public


BIG = {"robot.json": ROBOT, "model/w.bin": b"\0" * (8 * MIB)}  # 8 MiB of payload, a few KB compressed


def signed_tarball(path: Path, signature: bytes | None, sig_first: bool = True) -> Path:
    listing = manifest(BIG)
    sig = member(f"{TOP}/MANIFEST.sig", signature) if signature is not None else b""
    payload = b"".join(member(f"{TOP}/{n}", d) for n, d in BIG.items())
    body = sig + payload if sig_first else payload + sig
    return Gzip(path).write(header(TOP, kind=tarfile.DIRTYPE) + member(f"{TOP}/MANIFEST", listing) + body
                            + end()).close()


def test_a_payload_member_before_manifest_is_refused_before_it_is_written(tmp_path):
    tb = Gzip(tmp_path / "b.tar.gz").write(header(TOP, kind=tarfile.DIRTYPE) + member(f"{TOP}/model/w.bin", BIG["model/w.bin"])
                                           + member(f"{TOP}/MANIFEST", manifest(BIG))
                                           + member(f"{TOP}/robot.json", ROBOT) + end()).close()
    result = probe(tb, tmp_path / "cache")
    assert_refused(result, "no MANIFEST before", tb, tmp_path / "cache")
    assert result["written"] < 4096


@pytest.mark.parametrize("case", ["unsigned", "another key", "signature after the payload"])
def test_under_a_trusted_key_the_signature_is_checked_before_any_payload_byte(tmp_path, case):
    key, pub = keypair(tmp_path)
    other, _ = keypair(tmp_path, "intruder")
    signature = {"unsigned": None, "another key": other.sign(manifest(BIG))}.get(case, key.sign(manifest(BIG)))
    tb = signed_tarball(tmp_path / "b.tar.gz", signature, sig_first=case != "signature after the payload")
    result = probe(tb, tmp_path / "cache", trusted_key=pub)
    assert_refused(result, "MANIFEST.sig", tb, tmp_path / "cache")
    assert result["written"] < len(manifest(BIG)) + 4096  # MANIFEST at most, none of the 8 MiB


def test_a_signed_tarball_extracts_under_its_key_and_an_unsigned_one_leaves_no_cache_entry(tmp_path):
    key, pub = keypair(tmp_path)
    good = signed_tarball(tmp_path / "good.tar.gz", key.sign(manifest(BIG)))
    root, fresh = cached_bundle(good, tmp_path / "cache", trusted_key=pub)
    assert fresh and (root / "model" / "w.bin").stat().st_size == 8 * MIB and (root / "MANIFEST.sig").is_file()
    (tmp_path / "unsigned").mkdir()
    unsigned = signed_tarball(tmp_path / "unsigned" / "b.tar.gz", None)
    with pytest.raises(PackageError, match=r"MANIFEST\.sig: missing"):
        load_package(unsigned, tmp_path / "cache2", trust=pub)
    assert list((tmp_path / "cache2").iterdir()) == []


LONG = "model/" + "tokenizer_" * 16 + "/vocab.json"  # fits neither a ustar name nor its prefix


@pytest.mark.parametrize("writer", ["tarfile pax", "tarfile gnu", "tar posix", "tar gnu"])
def test_tarballs_of_tar_writers_with_long_names_extract_under_a_trusted_key(tmp_path, writer):
    """What the reader must keep reading: ustar headers with pax or GNU long names, MANIFEST and MANIFEST.sig
    first, as `dz package` (Python's tarfile) or GNU tar writes them."""
    if writer.startswith("tar ") and shutil.which("tar") is None:
        pytest.skip("no tar command")
    key, pub = keypair(tmp_path)
    files = {**BIG, LONG: b'{"a": 1}'}
    root = tmp_path / "src" / TOP
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "MANIFEST").write_bytes(manifest(files))
    (root / "MANIFEST.sig").write_bytes(key.sign(manifest(files)))
    order = [TOP, f"{TOP}/MANIFEST", f"{TOP}/MANIFEST.sig"] + [f"{TOP}/{rel}" for rel in sorted(files)]
    tb = tmp_path / "b.tar.gz"
    if writer.startswith("tarfile"):
        with tarfile.open(tb, "w:gz", format=tarfile.PAX_FORMAT if "pax" in writer else tarfile.GNU_FORMAT) as tar:
            for name in order:
                tar.add(tmp_path / "src" / name, arcname=name, recursive=False)
    else:
        subprocess.run(["tar", "-czf", str(tb), f"--format={writer.split()[1]}", "--no-recursion",
                        "-C", str(tmp_path / "src"), *order], check=True)
    assert any(t in gzip.decompress(tb.read_bytes()) for t in (b"path=", b"././@LongLink"))  # an extended header
    out, fresh = cached_bundle(tb, tmp_path / "cache", trusted_key=pub)
    assert fresh and all((out / rel).read_bytes() == data for rel, data in files.items())
    assert len(tarball_manifest(tb)) == len(manifest(files))
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(tb.read_bytes()[: tb.stat().st_size // 2])
    with pytest.raises(BundleError, match="corrupt or truncated"):
        cached_bundle(cut, tmp_path / "cache", trusted_key=pub)


def test_a_bundle_folders_huge_manifest_is_refused_without_reading_it(tmp_path):
    """A bundle directory (not a tarball) whose MANIFEST is a 2 GiB sparse file: refused after reading at most the
    cap, not read whole."""
    from tests.hostile.guarded import run_guarded

    root = tmp_path / "b-1.0"
    root.mkdir()
    with open(root / "MANIFEST", "wb") as f:
        f.truncate(2 << 30)
    outcome = run_guarded(
        "from dzmodel.serve.package import PackageError, verify_package",
        f"    try:\n        verify_package({str(root)!r})\n    except PackageError as exc:\n        print(exc)\n")
    assert not outcome.killed, outcome.killed
    lines = outcome.lines()
    assert len(lines) == 1 and "MANIFEST: over the limit of" in lines[0], lines
    assert outcome.growth_mb < 300 and outcome.elapsed < 1.0, (outcome.growth_mb, outcome.elapsed)
