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

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..dirlock import directory_lock

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST"
SIGNATURE = "MANIFEST.sig"      # optional: ed25519 signature over the MANIFEST bytes, not listed in MANIFEST
TRUST_ENV = "DZ_TRUST_KEY"      # a public key file: when set, every bundle load needs a valid SIGNATURE by it
COMPLETE = ".complete"          # written last: a cache entry without it is an interrupted extraction
MAX_MANIFEST_BYTES = 8 << 20    # 20,000 lines of 400 bytes
MAX_MANIFEST_LINE = 8 << 10     # "sha256  size  path" with a path of up to 4096 bytes
MAX_SIGNATURE_BYTES = 1024
MAX_NAME_BYTES = 4096           # a member's path, as the filesystem takes it
MAX_PATH_DEPTH = 32             # folders and file name of a member or a MANIFEST path (a bundle uses under 8)
MAX_EXTENDED_HEADER = 64 << 10  # one pax or GNU long-name header
MAX_HEADER_BYTES = 16 << 20     # all extended headers of a tarball together
MAX_PAX_RECORDS = 128           # in one pax header (tar writers use a few: path, size, times, owner)
QUOTE_CHARS = 100               # what an error message quotes of a line or a name
MAX_GZIP_MEMBERS = 64           # concatenated gzip members, beyond one per GZIP_BYTES_PER_MEMBER of data
GZIP_BYTES_PER_MEMBER = 1024


class BundleError(ValueError):
    """A bundle that must not be used; the message names the file or member."""


@dataclass(frozen=True)
class ExtractLimits:
    max_total_bytes: int = 64 << 30        # all members together (a 14B model in bf16 is ~30 GB)
    max_member_bytes: int = 40 << 30
    max_members: int = 20_000              # members of a tarball, and folders its files are written into
    keep_free_bytes: int = 1 << 30          # never fill the cache's disk


def default_cache_dir() -> Path:
    if os.environ.get("DZ_BUNDLE_CACHE"):
        return Path(os.environ["DZ_BUNDLE_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dzmodel" / "bundles"


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


def open_regular(path: str | Path, follow: bool = True):
    """`path` opened for reading as a binary file object, only if it is a regular file (and, unless `follow`, not
    a symbolic link). The open itself cannot block (O_NONBLOCK, cleared once fstat shows a regular file), so a
    FIFO or device put at the name is refused rather than waited on. Raises BundleError naming the path, and
    OSError for a missing or unreadable file."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise BundleError(f"{shown(path)}: a symbolic link, not a regular file; refused") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a plain file")
            raise BundleError(f"{shown(path)}: not a regular file ({kind}); refused")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_sha256(path: str | Path, follow: bool = True) -> str:
    """The sha256 of a regular file (`open_regular`: a FIFO or device is refused, never waited on)."""
    h = hashlib.sha256()
    with open_regular(path, follow) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _quote(text: str | bytes) -> str:
    """repr of the start of `text`: an error message never carries a whole hostile line or name."""
    if len(text) <= QUOTE_CHARS:
        return repr(text)
    return f"{text[:QUOTE_CHARS]!r}... ({len(text)} in all)"


_HEX = frozenset("0123456789abcdefABCDEF")


def _clip(text: str) -> str:
    """`text` as it is, or its start if it is long; quoted if it holds a line break, an escape sequence or any
    other character a terminal would not print as it is."""
    if not text.isprintable():
        return _quote(text)
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}... ({len(text)} characters)"


def shown(path: str | Path) -> str:
    """A path for an error message: as it is, or quoted (repr) if a part of it would break the message over
    lines or act on the terminal (a newline, a carriage return, an escape sequence)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def parse_manifest(text: str, source: str) -> dict[str, tuple[str, int]]:
    """MANIFEST lines "sha256  size  path" -> {path: (sha256, size)}."""
    entries = {}
    for i, line in enumerate(text.splitlines(), 1):
        if len(line) > MAX_MANIFEST_LINE:
            raise BundleError(f"{source}:{i}: MANIFEST line of {len(line)} characters, over the limit of "
                              f"{MAX_MANIFEST_LINE}: {_quote(line)}")
        parts = line.split("  ", 2)
        if (len(parts) != 3 or len(parts[0]) != 64 or not set(parts[0]) <= _HEX
                or not (parts[1].isascii() and parts[1].isdigit() and len(parts[1]) <= 20) or not parts[2]):
            raise BundleError(f"{source}:{i}: malformed MANIFEST line {_quote(line)}")
        if parts[2].count("/") >= MAX_PATH_DEPTH:
            raise BundleError(f"{source}:{i}: path {_quote(parts[2])} is {parts[2].count('/') + 1} levels deep, "
                              f"over the limit of {MAX_PATH_DEPTH}")
        entries[parts[2]] = (parts[0], int(parts[1]))
    return entries


def _member_path(tarball: Path, name: str) -> tuple[str, ...]:
    """The parts of a member's path, as PurePosixPath splits it (empty and "." parts dropped), checked: relative,
    without "..", within the name and depth limits. Plain string operations: a tarball may hold 20,000 names."""
    parts = tuple(part for part in name.split("/") if part not in ("", "."))
    if name.startswith("/") or ".." in parts or not parts or "\\" in name:
        raise BundleError(f"{tarball}: member {_quote(name)} escapes the extraction directory")
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > MAX_NAME_BYTES or size > 255 and any(len(part.encode("utf-8", "surrogateescape")) > 255
                                                   for part in parts):
        raise BundleError(f"{tarball}: member name {_quote(name)} is too long for a file name")
    if len(parts) - 1 > MAX_PATH_DEPTH:   # below the bundle's top-level folder
        raise BundleError(f"{tarball}: member {_quote(name)} is {len(parts) - 1} levels deep, over the limit "
                          f"of {MAX_PATH_DEPTH}; refused")
    return parts


# --- reading a tarball ----------------------------------------------------------------------------


BLOCK = 512
_FILE, _DIR = "file", "dir"
_LINK_TYPES = frozenset(b"12346")  # hard link, symlink, character and block device, fifo
_USTAR, _GNU = b"ustar\x0000", b"ustar  \x00"


@dataclass(frozen=True)
class _Member:
    name: str
    kind: str       # _FILE or _DIR
    size: int


class _TarReader:
    """The members of a gzip tarball, in order, from its decompressed stream.

    Only the ustar subset that tar writers use for plain files is read: regular files and directories, with
    pax ('x', 'g') and GNU long-name ('L', 'K') headers of at most MAX_EXTENDED_HEADER bytes each, parsed by
    plain code (no regular expressions). Header checksums are checked; links, devices and sparse files are
    refused. Nothing is read ahead of what the caller asks for, so memory stays within a header and a block of
    data, and a member can be refused from its header before any of its data is decompressed."""

    def __init__(self, f, source: str):
        self._f, self._source = f, source
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)   # gzip
        self._out = 0                # decompressed bytes so far
        self._left = 0               # unread data bytes of the current member
        self._size = 0               # the current member's size (its data is padded to a whole block)
        self._header_bytes = 0       # extended header bytes so far
        self._globals: dict[str, bytes] = {}
        self._members = 1            # gzip members started
        self.index = 0               # the current header's number, counting every header from 1

    def _refuse(self, what: str) -> BundleError:
        return BundleError(f"{self._source}: {what}; refused")

    def _read(self, n: int) -> bytes:
        """Exactly n decompressed bytes (fewer only at the end of the gzip stream)."""
        out = bytearray()
        while len(out) < n:
            if self._z.eof:
                rest = self._z.unused_data or self._f.read(1 << 16)
                if not rest:
                    break
                self._next_gzip_member()
                data = rest
            else:
                data = self._z.unconsumed_tail or self._f.read(1 << 16)
            try:
                got = self._z.decompress(data, n - len(out))     # never more than asked for
            except zlib.error as exc:
                what = "corrupt or truncated tarball" if self._out else "not a gzip tarball"
                raise BundleError(f"{self._source}: {what} ({exc})") from None
            if not got and not data and not self._z.eof:
                raise BundleError(f"{self._source}: corrupt or truncated tarball (the gzip stream ends early)")
            out += got
            self._out += len(got)
        return bytes(out)

    def _next_gzip_member(self) -> None:
        """Start the next gzip member of a concatenated stream. Block writers (bgzip) put up to 64 KiB in each;
        far more members than the data they hold (empty ones, or a byte each) would only cost time."""
        self._members += 1
        if self._members > MAX_GZIP_MEMBERS + self._out // GZIP_BYTES_PER_MEMBER:
            raise self._refuse(f"more gzip members ({self._members}) than its {self._out} bytes of data need")
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def _exact(self, n: int, what: str) -> bytes:
        data = self._read(n)
        if len(data) != n:
            raise BundleError(f"{self._source}: corrupt or truncated tarball ({what} ends early)")
        return data

    def read(self, n: int) -> bytes:
        """Up to n bytes of the current member's data; b"" once it is all read."""
        n = min(n, self._left)
        if n == 0:
            return b""
        data = self._exact(n, "a member's data")
        self._left -= n
        if self._left == 0:
            self._exact(-self._size % BLOCK, "a member's padding")
        return data

    def next(self) -> _Member | None:
        """The next member's header (after the current member's data, which must have been read), or None at the
        end of the archive."""
        if self._left:
            raise RuntimeError("the current member's data was not read")
        records: dict[str, bytes] = {}
        long_name: bytes | None = None
        while True:
            block = self._read(BLOCK)
            if not block.strip(b"\0"):
                if records or long_name is not None:
                    raise self._refuse(f"header #{self.index}: an extended header with no member after it")
                return None                                     # the end-of-archive blocks (or the stream's end)
            if len(block) != BLOCK:
                raise BundleError(f"{self._source}: corrupt or truncated tarball (a header ends early)")
            self.index += 1
            name, kind, size = self._header(block)
            if kind in b"xgLK":
                data = self._extended(kind, size)
                if kind == ord("x"):
                    records.update(self._pax_records(data))
                elif kind == ord("g"):
                    self._globals.update(self._pax_records(data))
                elif kind == ord("L"):
                    long_name = data.split(b"\0", 1)[0]
                continue
            return self._member(name, kind, size, {**self._globals, **records}, long_name)

    def _header(self, block: bytes) -> tuple[bytes, int, int]:
        """(name, type byte, size) of a checked ustar header block."""
        stored = _number(block[148:156])
        unsigned = sum(block) - sum(block[148:156]) + 8 * 32
        if stored != unsigned and stored != _signed_checksum(block, unsigned):
            raise self._refuse(f"header #{self.index}: header checksum mismatch (not a tar header, or a damaged one)")
        magic = block[257:265]
        if magic not in (_USTAR, _GNU):
            raise self._refuse(f"header #{self.index}: not a ustar header")
        name = block[:100].split(b"\0", 1)[0]
        prefix = block[345:500].split(b"\0", 1)[0] if magic == _USTAR else b""
        if prefix:
            name = prefix + b"/" + name
        size = _number(block[124:136])
        if size is None or stored is None:
            raise self._refuse(f"header #{self.index} ({_quote(name)}): a malformed number field")
        return name, block[156], size

    def _extended(self, kind: int, size: int) -> bytes:
        what = "pax" if kind in b"xg" else "GNU long-name"
        if size > MAX_EXTENDED_HEADER:
            raise self._refuse(f"header #{self.index}: {what} extended header of {size} bytes, over the limit of "
                               f"{MAX_EXTENDED_HEADER}")
        self._header_bytes += BLOCK + size
        if self._header_bytes > MAX_HEADER_BYTES:
            raise self._refuse(f"header #{self.index}: more than {MAX_HEADER_BYTES} bytes of extended headers")
        data = self._exact(size, f"{what} extended header")
        self._exact(-size % BLOCK, "a header's padding")
        return data

    def _pax_records(self, data: bytes) -> dict[str, bytes]:
        """pax records "LEN key=value\\n" (LEN counts the whole record), read by position."""
        records, pos = {}, 0
        while pos < len(data):
            if data[pos] == 0 and not data[pos:].strip(b"\0"):
                break                                           # padding after the last record
            space = data.find(b" ", pos, pos + 21)
            digits = data[pos:space] if space > pos else b""
            end = pos + int(digits) if digits.isdigit() else -1
            key, eq, value = data[space + 1:end - 1].partition(b"=") if space + 1 < end <= len(data) else (b"",) * 3
            if not (key and eq and data[end - 1] == 0x0A):
                raise self._refuse(f"header #{self.index}: malformed pax header at byte {pos} "
                                   f"({_quote(data[pos:pos + QUOTE_CHARS])})")
            if len(records) == MAX_PAX_RECORDS:
                raise self._refuse(f"header #{self.index}: a pax header of more than {MAX_PAX_RECORDS} records")
            records[key.decode("utf-8", "replace")] = value
            pos = end
        return records

    def _member(self, name: bytes, kind: int, size: int, records: dict[str, bytes],
                long_name: bytes | None) -> _Member:
        name = records.get("path") or long_name or name
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            raise self._refuse(f"member {_quote(name)}: its name is not UTF-8") from None
        if "\0" in text or not text:
            raise self._refuse(f"member {_quote(text)}: an empty name or one with a NUL byte")
        if kind == ord("S") or any(key.startswith("GNU.sparse.") for key in records):
            raise self._refuse(f"member {_quote(text)} is a sparse file")
        if "size" in records:
            value = records["size"]
            if not (value.isdigit() and len(value) <= 20):
                raise self._refuse(f"member {_quote(text)}: malformed pax size {_quote(value)}")
            size = int(value)
        if kind in _LINK_TYPES:
            raise BundleError(f"{self._source}: member {_quote(text)} is a link or device; refused")
        if kind == ord("5") or (kind == 0 and text.endswith("/")):
            if size:
                raise self._refuse(f"member {_quote(text)}: a directory with {size} bytes of data")
            return _Member(text, _DIR, 0)
        if kind not in b"0\0":
            raise self._refuse(f"member {_quote(text)}: unsupported tar member type {bytes([kind])!r}")
        self._left = self._size = size
        return _Member(text, _FILE, size)


_LOW_BYTES = bytes(range(128))


def _signed_checksum(block: bytes, unsigned: int) -> int:
    """The header checksum as old tar writers computed it, with bytes over 127 counted as negative."""
    high = len(block[:148].translate(None, _LOW_BYTES)) + len(block[156:].translate(None, _LOW_BYTES))
    return unsigned - 256 * high


def _number(field: bytes) -> int | None:
    """A header's numeric field: octal digits (NUL- or space-terminated) or GNU's base-256; None if malformed."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    if digits.translate(None, b"01234567"):
        return None
    return int(digits, 8)


# --- extracting -----------------------------------------------------------------------------------


def _read_small(tar: _TarReader, m: _Member, limit: int, tarball: Path, what: str) -> bytes:
    if m.size > limit:
        raise BundleError(f"{tarball}: {what} has {m.size} bytes, over the limit of {limit}; refused")
    return tar.read(m.size)


def _write_member(tar: _TarReader, target: Path) -> str:
    """Stream the current member into `target` (a new file in an existing folder); returns its sha256."""
    h = hashlib.sha256()
    with open(target, "xb") as out:
        for block in iter(lambda: tar.read(1 << 20), b""):
            h.update(block)
            out.write(block)
    return h.hexdigest()


def _verify_signature(key, signature: bytes, manifest: bytes, where: str, manifest_name: str,
                      trusted_key_file: str | Path) -> None:
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(signature[:MAX_SIGNATURE_BYTES + 1], manifest)
    except (InvalidSignature, ValueError):
        raise BundleError(f"{where}: not a valid signature of {manifest_name} by {trusted_key_file}: the bundle "
                          "was changed after it was signed, or another key signed it") from None


class _Extraction:
    """One tarball streamed into `dest`: MANIFEST first (capped), then, under a trusted key, MANIFEST.sig
    (verified), then the files MANIFEST lists, each capped at its listed size as it arrives. Directory members
    are checked like any member and otherwise ignored: only the folders of listed files are made, and they
    count against max_members as the members do."""

    def __init__(self, tarball: Path, dest: Path, limits: ExtractLimits, trusted_key: str | Path | None):
        self.tarball, self.dest, self.limits, self.trusted_key = tarball, dest, limits, trusted_key
        self.key = load_trusted_key(trusted_key) if trusted_key else None  # a bad key file fails first
        self.budget = min(limits.max_total_bytes, shutil.disk_usage(dest).free - limits.keep_free_bytes)
        self.top: str | None = None
        self.manifest_bytes: bytes | None = None
        self.manifest: dict[str, tuple[str, int]] = {}
        self.signed = False
        self.written: dict[str, tuple[str, int]] = {}
        self.folders: set[PurePosixPath] = set()
        self.total = self.members = 0

    def run(self) -> Path:
        try:
            with open_regular(self.tarball) as f:
                tar = _TarReader(f, str(self.tarball))
                while (m := tar.next()) is not None:
                    self._member(tar, m)
        except OSError as exc:
            raise BundleError(f"{self.tarball}: could not extract ({_quote(str(exc))})") from None
        return self._finish()

    def _member(self, tar: _TarReader, m: _Member) -> None:
        tarball = self.tarball
        self.members += 1
        if self.members > self.limits.max_members:
            raise BundleError(f"{tarball}: more than {self.limits.max_members} members; refused")
        parts = _member_path(tarball, m.name)
        if self.top is None:
            if parts[0] == COMPLETE:
                raise BundleError(f"{tarball}: its bundle folder is named {COMPLETE}, the name of the cache's "
                                  "marker of a finished extraction; refused")
            self.top = parts[0]
        elif parts[0] != self.top:
            raise BundleError(f"{tarball}: expected one top-level bundle directory, found {_quote(self.top)} and "
                              f"{_quote(parts[0])}")
        rel = "/".join(parts[1:])
        if m.kind == _DIR and (not rel or self.manifest_bytes is not None and (self.key is None or self.signed)):
            return                                  # folders are made with MANIFEST and the listed files
        target = self.dest.joinpath(*parts)
        if self.manifest_bytes is None:
            if rel == MANIFEST and m.kind == _FILE:
                self._read_manifest(tar, m, target)
            else:
                raise BundleError(f"{tarball}: no {MANIFEST} before member {_quote(m.name)}: a bundle tarball "
                                  f"starts with {MANIFEST} (`dz package` writes it first), and nothing before it "
                                  "is extracted; refused")
            return
        if self.key is not None and not self.signed and rel != SIGNATURE:
            raise BundleError(f"{tarball}: {SIGNATURE}: missing right after {MANIFEST}: the bundle is not signed, "
                              f"and bundles must be signed by the key {self.trusted_key} (--trust or {TRUST_ENV})")
        if m.kind == _DIR:
            pass                                    # a listed file's folders are made with it
        elif rel == SIGNATURE:
            self._read_signature(tar, m, target)
        else:
            self._payload(tar, m, rel, target)

    def _read_manifest(self, tar: _TarReader, m: _Member, target: Path) -> None:
        data = _read_small(tar, m, MAX_MANIFEST_BYTES, self.tarball, MANIFEST)
        self.manifest = parse_manifest(data.decode("utf-8", errors="replace"), f"{self.tarball}:{MANIFEST}")
        if not self.manifest:
            raise BundleError(f"{self.tarball}: {MANIFEST} lists no files (not a dz package); refused")
        listed = sum(size for _, size in self.manifest.values())
        if listed > self.budget:
            raise BundleError(f"{self.tarball}: {MANIFEST} lists {listed} bytes, more than the extraction cap "
                              f"({self.budget} bytes); refused")
        self.budget = listed                     # every later file is one MANIFEST lists, at its listed size
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        self.manifest_bytes = data

    def _read_signature(self, tar: _TarReader, m: _Member, target: Path) -> None:
        if target.exists():
            raise BundleError(f"{self.tarball}: {SIGNATURE} appears twice")
        data = _read_small(tar, m, MAX_SIGNATURE_BYTES, self.tarball, SIGNATURE)
        if self.key is not None:
            _verify_signature(self.key, data, self.manifest_bytes, f"{self.tarball}:{SIGNATURE}", MANIFEST,
                              self.trusted_key)
            self.signed = True
        target.write_bytes(data)

    def _payload(self, tar: _TarReader, m: _Member, rel: str, target: Path) -> None:
        tarball = self.tarball
        if rel not in self.manifest:
            raise BundleError(f"{tarball}: {_clip(rel)} is not listed in {MANIFEST} (an added file)")
        if self.manifest[rel][1] != m.size:
            raise BundleError(f"{tarball}: {_clip(rel)} has {m.size} bytes, {MANIFEST} says {self.manifest[rel][1]}")
        if rel in self.written or rel == MANIFEST:
            raise BundleError(f"{tarball}: {_clip(rel)} appears twice")
        if m.size > self.limits.max_member_bytes or self.total + m.size > self.budget:
            raise BundleError(f"{tarball}: member {_quote(m.name)} ({m.size} bytes) exceeds the extraction cap "
                              f"({self.budget} bytes in all, {self.limits.max_member_bytes} per file); refused")
        self.total += m.size
        self._make_folders(PurePosixPath(rel).parent, target.parent)
        self.written[rel] = (_write_member(tar, target), m.size)

    def _make_folders(self, rel: PurePosixPath, target: Path) -> None:
        """Make the folder `rel` of the bundle (at `target`) and those above it, counting each new one."""
        new = [p for p in (rel, *rel.parents) if p.parts and p not in self.folders]
        if len(self.folders) + len(new) > self.limits.max_members:
            raise BundleError(f"{self.tarball}: its files are spread over more than {self.limits.max_members} "
                              "folders; refused")
        self.folders.update(new)
        target.mkdir(parents=True, exist_ok=True)

    def _finish(self) -> Path:
        tarball = self.tarball
        if self.top is None:
            raise BundleError(f"{tarball}: empty tarball")
        if self.manifest_bytes is None:
            raise BundleError(f"{tarball}: no {MANIFEST} (not a dz package)")
        if self.key is not None and not self.signed:
            raise BundleError(f"{tarball}: {SIGNATURE}: missing right after {MANIFEST}: the bundle is not signed, "
                              f"and bundles must be signed by the key {self.trusted_key} (--trust or {TRUST_ENV})")
        for rel in sorted(set(self.manifest) - set(self.written)):
            raise BundleError(f"{tarball}: {_clip(rel)} is listed in {MANIFEST} but missing")
        for rel, got in sorted(self.written.items()):
            if got != self.manifest[rel]:
                raise BundleError(f"{tarball}: {_clip(rel)}: checksum mismatch against {MANIFEST} (the file was "
                                  "modified)")
        return self.dest / self.top


def _extract_verified(tarball: Path, dest: Path, limits: ExtractLimits,
                      trusted_key: str | Path | None = None) -> Path:
    """Stream the tarball into `dest` (empty), checking every member; returns the bundle directory.
    trusted_key: an ed25519 public key file; MANIFEST.sig must then follow MANIFEST and be its valid signature,
    checked before any other file is written."""
    return _Extraction(tarball, dest, limits, trusted_key).run()


def cached_bundle(tarball: str | Path, cache_dir: str | Path | None = None,
                  limits: ExtractLimits = ExtractLimits(), trusted_key: str | Path | None = None) -> tuple[Path, bool]:
    """The bundle directory of `tarball` in the cache, extracting and verifying it if needed.

    Returns (bundle directory, fresh): fresh is True when it was extracted (and verified) just now; a cached
    directory is for the caller to verify, against the tarball's own MANIFEST (`tarball_manifest`), since anyone
    who can write the cache can rewrite its files and MANIFEST together; drop it with `evict` if it fails.
    trusted_key: an ed25519 public key file; an extraction then needs MANIFEST.sig right after MANIFEST, and a
    valid signature by that key, before any other file is written."""
    tarball = Path(tarball)
    if not tarball.is_file():
        raise BundleError(f"{tarball}: no such bundle tarball")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / file_sha256(tarball)
    # one process at a time finds, extracts or replaces an entry: a second `dz serve` of the same tarball waits
    # for the first one's extraction and uses it, rather than removing it from under the first
    with directory_lock(cache, waiting=lambda: log.info(f"waiting for another process extracting into {cache}")):
        return _cached_entry(tarball, entry, limits, trusted_key)


def _cached_entry(tarball: Path, entry: Path, limits: ExtractLimits,
                  trusted_key: str | Path | None) -> tuple[Path, bool]:
    cache = entry.parent
    if (entry / COMPLETE).is_file():
        tops = [p for p in entry.iterdir() if p.is_dir()]
        if len(tops) == 1:
            return tops[0], False
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name[:16]}.", suffix=".tmp", dir=cache))
    try:
        root = _extract_verified(tarball, tmp, limits, trusted_key)
        (tmp / COMPLETE).write_text(f"{tarball.resolve()}\n")
        _evict(entry)                          # a stale or interrupted entry of the same tarball
        os.replace(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry / root.name, True


def evict(entry: Path, seen: os.stat_result | None = None) -> None:
    """Remove a cache entry (a bundle's <sha256> directory) that failed verification or is stale. seen: the
    entry's stat when it was checked; an entry another process has extracted again since then is left alone."""
    with directory_lock(entry.parent):
        try:
            now = os.stat(entry)
        except FileNotFoundError:
            return
        if seen is None or (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino):
            _evict(entry)


def _evict(entry: Path) -> None:
    if entry.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{entry.name[:16]}.old-", dir=entry.parent))
        os.replace(entry, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)


def tarball_manifest(tarball: str | Path) -> bytes:
    """The MANIFEST inside a tarball, read without extracting anything (it is the first file: `dz package` writes
    it first, and an extraction refuses a tarball that does not start with it)."""
    tarball = Path(tarball)
    try:
        with open_regular(tarball) as f:
            tar = _TarReader(f, str(tarball))
            while (m := tar.next()) is not None and tar.index <= ExtractLimits.max_members:
                parts = PurePosixPath(m.name).parts
                if m.kind == _DIR and len(parts) == 1:
                    continue                    # the top-level folder (an extraction counts these too)
                if len(parts) == 2 and parts[1] == MANIFEST and m.kind == _FILE:
                    return _read_small(tar, m, MAX_MANIFEST_BYTES, tarball, MANIFEST)
                break
    except OSError as exc:
        raise BundleError(f"{tarball}: could not read ({_quote(str(exc))})") from None
    raise BundleError(f"{tarball}: no {MANIFEST} first (not a dz package)")


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
    key = load_trusted_key(trusted_key_file)
    sig = root / SIGNATURE
    if not sig.is_file():
        raise BundleError(f"{sig}: missing: the bundle is not signed, and bundles must be signed by the key "
                          f"{trusted_key_file} (--trust or {TRUST_ENV})")
    with open_regular(sig, follow=False) as f:
        signature = f.read(MAX_SIGNATURE_BYTES + 1)
    _verify_signature(key, signature, manifest, str(sig), str(root / MANIFEST), trusted_key_file)
