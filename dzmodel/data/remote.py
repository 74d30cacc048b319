"""LeRobot datasets under s3:// URIs, read through a local cache of bounded size.

`open_dataset("s3://bucket/prefix")` lists the dataset's keys once, downloads its `meta/` files (small, kept), and
from then on fetches a data or video file the first time a reader opens it. The cache keeps the files used last
and deletes the oldest ones once it holds more than its budget, so a dataset larger than the disk trains.

- Endpoint and credentials come from boto3's usual sources: `AWS_ENDPOINT_URL` (an S3-compatible server such as
  MinIO), `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, or `~/.aws`.
- `DZ_DATA_CACHE`: the cache directory (default `~/.cache/dz/datasets`); `DZ_DATA_CACHE_GIB`: its budget (default
  20). A dataset's files go under `<cache>/<bucket>/<prefix>/`, with a marker file: eviction deletes only files in
  directories that carry the marker, so it never touches a directory the cache did not create.
- Downloads go to a temporary name and are renamed into place, so concurrent loader workers never read a partial
  file. Another process may evict a file between its fetch and its open; the reader then fetches it again.
- Whole files are fetched, not byte ranges: a LeRobot v3 video file that holds many episodes is fetched once, whole.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import DataError

MARKER = ".dz-remote-cache"  # written by the cache into each dataset's directory; eviction needs it
PINNED = "meta/"             # the index files: fetched at open, never evicted


def is_remote(uri) -> bool:
    return str(uri).startswith("s3://")


def _client():
    try:
        import boto3
    except ImportError as e:  # pragma: no cover - boto3 comes with the pipeline extra
        raise DataError("s3:// datasets need boto3 (pip install boto3, or the project's pipeline extra)") from e
    return boto3.client("s3")


def _plain_relative(rel: str) -> bool:
    """Whether a key relative to the dataset names a file inside it wherever it is joined: no empty, '.' or '..'
    part (so nothing absolute and nothing that climbs), no backslash, no NUL."""
    return bool(rel) and "\\" not in rel and "\0" not in rel and all(
        part not in ("", ".", "..") for part in rel.split("/"))


def _quoted(text: str, limit: int = 120) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + "..."


class S3Mirror:
    """The local mirror of one dataset URI under `root`: `fetch(rel)` has a file there, downloaded if need be."""

    def __init__(self, uri: str, cache_dir: str | Path | None = None, max_bytes: int | None = None):
        if not is_remote(uri):
            raise DataError(f"{uri}: not an s3:// URI")
        bucket, _, prefix = str(uri)[len("s3://"):].partition("/")
        if not bucket:
            raise DataError(f"{uri}: no bucket (s3://BUCKET/PREFIX)")
        self.uri, self.bucket, self.prefix = str(uri), bucket, prefix.strip("/")
        cache = Path(cache_dir or os.environ.get("DZ_DATA_CACHE") or Path.home() / ".cache" / "dz" / "datasets")
        if max_bytes is None:
            try:
                max_bytes = int(float(os.environ.get("DZ_DATA_CACHE_GIB", "20")) * 2**30)
            except ValueError:
                raise DataError(f"DZ_DATA_CACHE_GIB must be a number of GiB, got "
                                f"{os.environ['DZ_DATA_CACHE_GIB']!r}") from None
        if max_bytes <= 0:
            raise DataError(f"the dataset cache budget must be > 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.root = cache / bucket / self.prefix if self.prefix else cache / bucket
        self._s3 = None
        self.sizes = self._list()
        if "meta/info.json" not in self.sizes:
            raise DataError(f"{self.uri}: no meta/info.json under it; it is not a LeRobot dataset "
                            f"({len(self.sizes)} keys listed)")
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / MARKER).touch()
        self.fetches = 0  # downloads by this process (tests and the bench read it)
        for rel in sorted(self.sizes):
            if rel.startswith(PINNED):
                self.fetch(rel)

    def __getstate__(self):  # loader workers: the boto3 client is rebuilt in each process
        state = self.__dict__.copy()
        state["_s3"] = None
        return state

    @property
    def s3(self):
        if self._s3 is None:
            self._s3 = _client()
        return self._s3

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _list(self) -> dict[str, int]:
        """Every key under the prefix, relative to it, with its size (one paginated listing)."""
        out: dict[str, int] = {}
        start = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(start):]
                    if rel and not rel.endswith("/"):  # a key ending in "/" is a folder marker, not a file
                        out[rel] = int(obj["Size"])
        except Exception as e:  # botocore raises many kinds; one clear error names the URI
            raise DataError(f"{self.uri}: cannot list it: {e}") from e
        for rel in out:
            if not _plain_relative(rel):
                raise DataError(f"{self.uri}: key {_quoted(rel)} is not a plain relative path (an empty, '.' or '..' "
                                "part, a backslash or a NUL): its file would land outside the dataset's cache folder")
        return out

    def rel(self, path: str | Path) -> str:
        """A mirror path's key relative to the dataset."""
        try:
            return Path(path).relative_to(self.root).as_posix()
        except ValueError:
            raise DataError(f"{path}: not inside {self.uri}'s cache {self.root}") from None

    def exists(self, rel: str) -> bool:
        return rel in self.sizes

    def fetch(self, rel: str) -> Path:
        """The local file of `rel`, downloaded first if it is not in the cache (or has another size)."""
        if rel not in self.sizes:
            raise DataError(f"{self.uri}: no {rel} in the dataset")
        local = self.root / rel
        try:
            if local.stat().st_size == self.sizes[rel]:
                os.utime(local)  # most recently used
                return local
        except FileNotFoundError:
            pass
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.part")
        try:
            self.s3.download_file(self.bucket, self._key(rel), str(tmp))
            if tmp.stat().st_size != self.sizes[rel]:
                raise DataError(f"{tmp.stat().st_size} bytes arrived, the listing says {self.sizes[rel]}")
            os.chmod(tmp, 0o664)
            os.replace(tmp, local)
        except Exception as e:
            tmp.unlink(missing_ok=True)
            raise DataError(f"{self.uri}/{rel}: download failed: {e}") from e
        self.fetches += 1
        self.evict(keep=local)
        return local

    def cached_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._evictable())

    def _evictable(self) -> list[Path]:
        if not (self.root / MARKER).is_file():  # not a directory this cache made: touch nothing
            return []
        pinned = self.root / PINNED.rstrip("/")
        return [p for p in self.root.rglob("*") if p.is_file() and p.name != MARKER and not p.name.endswith(".part")
                and pinned not in p.parents]

    def evict(self, keep: Path | None = None) -> int:
        """Delete the least recently used files until the cache is within its budget; `keep` stays. Returns the
        number of files deleted."""
        files = []
        for p in self._evictable():
            try:
                st = p.stat()
            except FileNotFoundError:  # another process evicted it
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        deleted = 0
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= size
            deleted += 1
        return deleted
