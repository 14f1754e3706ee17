"""Files by reference in object storage: where they live, how they are uploaded and checked, and how a provider or a
GPU worker gets at them without our credentials.

Keys (inside each queue's own namespace, `offload.storage.namespace`; the `_` makes them reserved):

    results/<queue>:_in/<hex>/<n>-<name>            input files of job <queue>:<hex>
    results/<queue>:_out/<hex>/<attempt>/<n>-<name>  files a GPU worker's handler returned for that job
    results/<queue>:_out/<hex>/run-<n>.json          the output a GPU worker sent under lease number <n>
                                                     (`run_output_key`): the job's record names the one run
                                                     whose complete the store fenced
    results/<queue>:_files/<hex>~r<run>-<n>-<name>   provider files a dispatch worker copied from that job's
                                                     output (offload.storage.outputs; `~` never occurs in an id)

All carry the job id, so the server's sweep (`sweep`) can tell whose a file is without an index: a file whose job
record is gone (retention, purge) and that is older than the upload grace is deleted. The grace covers the window
between an upload and its enqueue, and a producer killed in between leaves a file the sweep removes.

An upload streams the file through a reader that counts, hashes (SHA-256 for the reference; MD5 of the whole and
per 8 MiB part, to predict S3's ETag) and enforces the size limit as it goes, so a 5 GiB file costs a few parts
of memory. After the upload the object is read back with a HEAD: its size must match, and so must its ETag where
the store gives an MD5-style one; a mismatch deletes the object and fails the upload. A failed or cancelled
upload deletes whatever it wrote (boto3 aborts an unfinished multipart upload itself; a process killed
mid-upload leaves parts that `abort_uploads` clears after the grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from offload.errors import ObjectStoreError
from offload.files import (
    DEFAULT_MAX_FILE_BYTES,
    REF_KEY,
    File,
    field_name,
    files_in,
    reference,
    references_in,
    replace,
    safe_name,
)
from offload.storage.base import PART_BYTES, ObjectNotFound, Storage, StorageError
from offload.storage.namespace import own_prefix, space_of

DEFAULT_URL_EXPIRES_S = 86_400
INPUTS = "_in/"
OUTPUTS = "_out/"
COPIED = "_files/"  # provider files the dispatch worker copied from a job's default output, one flat space
COPIED_END = "~"  # ends the job id in a copied file's key: ids (`_HEX`) never contain it
LEGACY_COPIED = "files/"  # where earlier versions copied them: results/<job id>/files/...
# the part of a job id after its queue: hex for ids offload issues; ingested tutorial jobs keep their own ids
_HEX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_ETAG = re.compile(r"^[0-9a-f]{32}(-\d+)?$")
RUN_OUTPUT = "run-"
_RUN = re.compile(r"run-[0-9]{1,20}\.json")


class FileTooLarge(ObjectStoreError, ValueError):
    """A file over `storage.max_input_file_bytes`."""


class UploadCancelled(ObjectStoreError):
    """Raised inside the upload thread when the caller gave up, so boto3 aborts the multipart upload."""


def _split(job_id: str) -> tuple[str, str]:
    queue, _, hex_part = job_id.partition(":")
    if not queue or not _HEX.match(hex_part):
        raise ValueError(f"job id {job_id!r} is not one offload issues (<queue>:<hex>)")
    return queue, hex_part


def inputs_prefix(job_id: str) -> str:
    queue, hex_part = _split(job_id)
    return f"{own_prefix(queue)}{INPUTS}{hex_part}/"


def outputs_prefix(job_id: str) -> str:
    """Where a GPU worker may put files for this job, and nowhere else."""
    queue, hex_part = _split(job_id)
    return f"{own_prefix(queue)}{OUTPUTS}{hex_part}/"


def run_output_key(job_id: str, token: str) -> str:
    """Where the server stores the output a GPU worker sends under lease `token` (`<worker id>/<n>`, the queue's
    lease counter): one object per lease, so a worker whose lease was taken over, however late its write lands,
    writes only its own run's object, never the one the job's record points at (the fenced complete sets that)."""
    number = token.rpartition("/")[2]
    if not (number.isascii() and number.isdigit()):
        raise ValueError(f"lease token {token[:80]!r} does not end in a lease number")
    return f"{outputs_prefix(job_id)}{RUN_OUTPUT}{number}.json"


def run_of(job_id: str, key: str) -> bool:
    """Whether `key` is one of `run_output_key`'s objects of job `job_id`."""
    rest = key.removeprefix(outputs_prefix(job_id))
    return rest != key and _RUN.fullmatch(rest) is not None


def copied_prefix(job_id: str) -> str:
    """Where the provider files copied from job `job_id`'s default output go: a name prefix in the queue's one
    copied-files space, not a directory per job (why: offload.storage.outputs)."""
    queue, hex_part = _split(job_id)
    return f"{own_prefix(queue)}{COPIED}{hex_part}{COPIED_END}"


def default_job(output_key: str) -> str | None:
    """The job whose default output key (`results/<job id>.json`) `output_key` is, for an id offload issues;
    None for any other key."""
    queue = space_of(output_key)
    if queue is None or not output_key.endswith(".json"):
        return None
    hex_part = output_key[len(own_prefix(queue)) : -len(".json")]
    return f"{queue}:{hex_part}" if _HEX.match(hex_part) else None  # (`_HEX` starts with no `_`: never reserved)


def job_of_key(queue: str, key: str) -> str | None:
    """The job a file key belongs to: inputs, worker outputs, or provider files copied from a default output key
    (`results/<queue>:_files/<hex>~...`, or `results/<queue>:<hex>/files/...` as earlier versions wrote them) of
    `queue`; None for any other key (a result JSON, a custom output key)."""
    rest = key.removeprefix(own_prefix(queue))
    if rest == key:
        return None
    for space in (INPUTS, OUTPUTS):
        if rest.startswith(space):
            hex_part, slash, tail = rest[len(space) :].partition("/")
            return f"{queue}:{hex_part}" if slash and tail and _HEX.match(hex_part) else None
    if rest.startswith(COPIED):
        hex_part, end, tail = rest[len(COPIED) :].partition(COPIED_END)
        return f"{queue}:{hex_part}" if end and tail and _HEX.match(hex_part) else None
    hex_part, _, tail = rest.partition("/")
    if tail.startswith(LEGACY_COPIED) and len(tail) > len(LEGACY_COPIED) and _HEX.match(hex_part):
        return f"{queue}:{hex_part}"
    return None


def file_key(prefix: str, index: int, name: str) -> str:
    return f"{prefix}{index}-{safe_name(name)}"


class _Counting(io.RawIOBase):
    """Reads through `inner`, hashing and counting; raises past `limit` or once `cancel` is set."""

    def __init__(self, inner: IO[bytes], limit: int, what: str, cancel: threading.Event) -> None:
        self._inner, self._limit, self._what, self._cancel = inner, limit, what, cancel
        self.size = 0
        self.sha256 = hashlib.sha256()
        self.parts: list[bytes] = []
        self._part = hashlib.md5(usedforsecurity=False)
        self._in_part = 0
        self._whole = hashlib.md5(usedforsecurity=False)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if self._cancel.is_set():
            raise UploadCancelled("upload cancelled")
        data = self._inner.read(size if size is not None and size >= 0 else PART_BYTES)
        if not isinstance(data, bytes | bytearray):
            raise TypeError(f"{self._what}: the file object must be opened in binary mode")
        self.size += len(data)
        if self.size > self._limit:
            raise FileTooLarge(f"{self._what}: larger than the {self._limit}-byte limit (storage.max_input_file_bytes)")
        self.sha256.update(data)
        self._whole.update(data)
        view = memoryview(data)
        while view:
            take = min(len(view), PART_BYTES - self._in_part)
            self._part.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self._in_part == PART_BYTES:
                self.parts.append(self._part.digest())
                self._part, self._in_part = hashlib.md5(usedforsecurity=False), 0
        return bytes(data)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def etags(self) -> set[str]:
        """The ETags a store may give this content: the MD5 of the whole (a single PUT, and servers that store
        plain files, like rclone), or S3's MD5-of-part-MD5s with the part count for a multipart upload."""
        whole = self._whole.hexdigest()
        if self.size < PART_BYTES:
            return {whole}
        parts = [*self.parts, *([self._part.digest()] if self._in_part else [])]
        return {whole, f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"}


@dataclass(frozen=True)
class Uploaded:
    key: str
    ref: dict[str, Any]


async def upload(storage: Storage, key: str, file: File, *, max_bytes: int, what: str) -> Uploaded:
    """Stream `file` to `key`, verify it, and return its reference. Any failure (unreadable, too large, storage
    error, cancellation) leaves nothing at `key`."""
    hint = file.size_hint()
    if hint is not None and hint > max_bytes:
        raise FileTooLarge(f"{what}: {hint} bytes, over the {max_bytes}-byte limit (storage.max_input_file_bytes)")
    cancel = threading.Event()
    source = file.open()
    reader = _Counting(source, max_bytes, what, cancel)
    task = asyncio.ensure_future(storage.put_fileobj(key, reader, file.content_type))  # type: ignore[arg-type]
    try:
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancel.set()  # the upload thread stops at its next read and boto3 aborts the multipart upload
            with contextlib.suppress(BaseException):
                await task
            raise
        finally:
            source.close()
        info = await storage.head(key)
        if info is None or info.size != reader.size:
            raise StorageError(f"{what}: the stored object's size does not match what was sent", permanent=True)
        if info.etag and _ETAG.match(info.etag) and info.etag not in reader.etags():
            raise StorageError(f"{what}: checksum mismatch after upload (ETag {info.etag})", permanent=True)
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.shield(storage.delete(key))
        raise
    return Uploaded(key, reference(key, reader.size, reader.sha256.hexdigest(), file.content_type))


async def upload_input_files(
    storage: Storage, job_id: str, value: Any, *, max_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> tuple[Any, list[str]]:
    """Upload every `File` in a job input (one at a time: memory stays at a few parts) and return the input with
    references in their place, and the keys written. On any failure the files already uploaded are deleted."""
    found = files_in(value)
    if not found:
        return value, []
    prefix = inputs_prefix(job_id)
    refs: dict[int, dict[str, Any]] = {}
    keys: list[str] = []
    try:
        for index, (path, file) in enumerate(found):
            if id(file) in refs:  # the same File object twice: one upload
                continue
            done = await upload(
                storage, file_key(prefix, index, file.name), file, max_bytes=max_bytes, what=field_name(path)
            )
            keys.append(done.key)
            refs[id(file)] = done.ref
    except BaseException:
        await delete_keys(storage, keys)
        raise
    return replace(value, lambda v: refs[id(v)] if isinstance(v, File) else v), keys


async def delete_keys(storage: Storage, keys: Sequence[str]) -> None:
    """Best effort, never raising: used on the way out of a failure (the sweep catches what this misses)."""
    for key in keys:
        with contextlib.suppress(Exception):
            await asyncio.shield(storage.delete(key))


async def presign_references(storage: Storage, value: Any, expires_s: int) -> Any:
    """The input a provider gets: every reference replaced by a presigned GET URL of its object. A missing object
    raises `ObjectNotFound` naming the field, before anything is paid for."""
    urls: dict[str, str] = {}
    for path, ref in references_in(value):
        key = ref[REF_KEY]
        if key in urls:
            continue
        if await storage.head(key) is None:
            raise ObjectNotFound(f"{field_name(path)}: input file {key} no longer exists")
        urls[key] = await storage.presigned_url(key, expires_s)
    return replace(value, lambda v: urls[v[REF_KEY]] if not isinstance(v, File) else v)
