"""The storage contract the worker relies on for guarantee 5 (results durable before success).

A job is marked succeeded only after its output is written here, so every backend must make a write either fully
visible or not visible at all, and must tell a caller whether a failure is worth retrying:

- `StorageError`: transient (network, timeouts, 5xx, throttling, a provider file that 500s). The worker keeps the
  job and retries the store later; the remote result is not re-bought.
- `StorageConfigError`: the settings are wrong (no such bucket, rejected credentials, bad endpoint). Retrying the
  job cannot help until an operator fixes the named setting, so it is a `ConfigError`, not a `StorageError`.
- `ObjectNotFound`: a read of a key that was never written (not a failure of the store itself).

Messages never contain credentials: they name the setting (`storage.secret_access_key`), never its value.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import orjson

from offload.errors import ConfigError, ObjectStoreError

MAX_KEY_LENGTH = 1024  # S3's limit, in UTF-8 bytes


# Streamed uploads go multipart from this size on, in parts of this size (boto3's defaults, pinned: the expected
# ETag of an upload, checked after it, depends on both; see offload.storage.inputs).
PART_BYTES = 8 * 1024 * 1024


class StorageError(ObjectStoreError):
    """A transient storage failure: retrying the same write later is expected to work.

    `permanent` is a hint for the few failures that are not configuration problems but will not heal either
    (a provider file that 404s because it expired, one that exceeds the size limit). The worker may retry them
    like any other `StorageError`; it can also dead-letter sooner.
    """

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class ClockRefused(StorageError):
    """The storage refused a request for this host's clock: S3 takes none signed more than 15 minutes off its own
    (boto3 does not correct for it). Every request of this host fails alike until its time is fixed; a worker
    stops paying for new jobs meanwhile (offload.worker.storage_gate)."""


class StorageConfigError(ConfigError):
    """The storage settings are wrong; the message names the offending setting, never a secret value."""


class ObjectNotFound(ObjectStoreError, KeyError):
    """`get_bytes` of a key that does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0]) if self.args else "object not found"


class InvalidKey(ObjectStoreError, ValueError):
    """A key that is unsafe as a path (`..`, absolute, NUL) or too long; rejected by every backend alike so a
    key that works on S3 in production also works on the local backend in development, and vice versa."""


@dataclass(frozen=True, slots=True)
class Put:
    """One object of `Storage.put_all`: small bytes, already in memory."""

    key: str
    data: bytes
    content_type: str = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a HEAD or a listing tells about one object. `etag` without quotes (S3's MD5-based tag, or None);
    `modified` in epoch seconds."""

    key: str
    size: int
    etag: str | None
    modified: float


def validate_key(key: str) -> str:
    """Return `key` if it is a safe relative object key, else raise `InvalidKey`."""
    if not isinstance(key, str) or not key:
        raise InvalidKey("storage key must be a non-empty string")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKey(f"storage key {key[:200]!r} must be relative, without backslashes or NUL")
    parts = key.split("/")  # (membership tests, not a generator: this runs once per job in the dispatch worker)
    if "" in parts or "." in parts or ".." in parts:
        raise InvalidKey(f"storage key {key[:200]!r} has an empty, '.' or '..' segment")
    if len(key.encode()) > MAX_KEY_LENGTH:
        raise InvalidKey(f"storage key is longer than {MAX_KEY_LENGTH} bytes")
    return key


def dump_json(obj: Any) -> bytes:
    """Compact UTF-8 JSON. orjson is fast but refuses integers beyond 64 bits, which a provider may well return,
    so those fall back to the standard library; a value that is not JSON at all raises TypeError."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def write_stream(path: Path, chunks: Iterator[bytes]) -> tuple[int, str]:
    """Write `chunks` to a temp file beside `path`, then rename it over `path`: (size, SHA-256 hex). A failure
    part-way leaves no file at `path` (blocking: run it in a thread)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name[:100]}.{os.getpid()}.part")
    digest, size = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as f:
            for chunk in chunks:
                digest.update(chunk)
                size += len(chunk)
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, digest.hexdigest()


def join_prefix(prefix: str, key: str) -> str:
    """`prefix` + `key` with exactly one slash between them; an empty prefix adds nothing."""
    prefix = prefix.strip("/")
    return f"{prefix}/{key}" if prefix else key


@runtime_checkable
class Storage(Protocol):
    """Async object storage addressed by relative keys (`results/<id>.json`).

    Locations returned by writes are what the job record and stored outputs point at: `s3://bucket/prefix/key`
    for S3 (usable as is with `aws s3 cp`), an absolute file path for the local backend.
    """

    def location(self, key: str) -> str:
        """Where `key` lives (or would live), without touching the store."""
        ...

    async def put_json(self, key: str, obj: Any) -> str:
        """Write `obj` as compact UTF-8 JSON (`application/json`) and return its location; TypeError if `obj`
        is not JSON-serialisable (a bug or bad provider data, not a storage failure)."""
        ...

    async def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        """Write `data` atomically and return its location."""
        ...

    async def put_fileobj(self, key: str, fileobj: IO[bytes], content_type: str = "application/octet-stream") -> str:
        """Write a readable binary file object from its current position to EOF; for large copied files, which
        would cost too much memory as `bytes` when thousands of jobs finish at once."""
        ...

    async def put_all(self, puts: Sequence[Put]) -> list[str]:
        """Write each object atomically, and the last only once all the others are written (a job's output JSON
        after the files it links); their locations. Nothing after a failed one is written. Local storage makes
        them durable in one group commit (fsyncs.py), S3 writes the others at once, then the last."""
        ...

    async def get_bytes(self, key: str) -> bytes:
        """The object's bytes; `ObjectNotFound` if it does not exist."""
        ...

    async def exists(self, key: str) -> bool:
        """Whether an object exists at `key`."""
        ...

    async def presigned_url(self, key: str, expires_s: int = 3600) -> str:
        """A URL that reads the object without credentials: an expiring presigned GET for S3, `file://` locally."""
        ...

    async def download(self, key: str, path: Path) -> tuple[int, str]:
        """Stream the object to the file `path` (replaced when complete); its (size, SHA-256 hex).
        `ObjectNotFound` if there is none."""
        ...

    async def head(self, key: str) -> ObjectInfo | None:
        """Size, ETag and modification time of the object at `key`; None when there is none."""
        ...

    async def delete(self, key: str) -> None:
        """Remove the object at `key`; a missing object is not an error (deletes are retried)."""
        ...

    async def list_objects(self, prefix: str, limit: int = 1000, after: str = "") -> list[ObjectInfo]:
        """Up to `limit` objects whose key starts with `prefix`, in key order, from the first key after `after`."""
        ...

    async def presigned_put_url(self, key: str, expires_s: int, content_type: str, size: int) -> str | None:
        """A URL that writes exactly `size` bytes to `key` without credentials; None where the backend cannot
        issue one (the local directory), so callers can say that files over HTTP need S3."""
        ...

    async def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        """Abort multipart uploads under `prefix` started more than `older_than_s` ago (their parts cost storage
        but are invisible to listings); how many. A backend without multipart uploads returns 0."""
        ...

    async def aclose(self) -> None:
        """Release threads and connections; the storage must not be used afterwards."""
        ...
