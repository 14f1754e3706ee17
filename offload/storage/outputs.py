"""Store a job's output durably, copying the provider-hosted files it links to first (guarantee 5).

Providers answer with URLs to files they delete soon after (Replicate ~1 h, RunPod `/run` 30 min), so a result
that only holds those URLs is lost by the time anyone reads it. `store_output` therefore:

1. walks the output JSON and picks every string that is, in its entirety, an http(s) URL (only for hosts the
   backend's `file_hosts` names, when it names any); strings that merely contain a URL are text and are left alone;
2. downloads each distinct URL (streamed, size- and time-limited, a few at a time, every connection and redirect
   hop under the backend's egress rule, offload.egress) and stores it with the
   provider's Content-Type: a job's default output `results/<queue>:<id>.json` gets its files at
   `results/<queue>:_files/<id>~r<run>-<n>-<basename>` (the queue's reserved copied-files space,
   offload.storage.inputs, where the server's sweep finds them), any other output key `<stem>.json` at
   `<stem>/files/r<run>-<n>-<basename>` (`<run>` is the job's submission number, so two remote runs of one job
   never share a file key, and `<n>` the URL's position in the output, so a retried store of the same run
   overwrites the same keys; without a run, `<n>-<basename>`). Neither the job nor the run is a directory of
   its own: on local storage each directory is one more inode to allocate per job, which a burst of job ends
   pays in kernel CPU (docs/explanation/performance.md, *Local storage*);
3. asks `before_write` (the worker: is the lease still mine?), then writes the rewritten JSON to the output key,
   last, so an output that exists is always complete and only refers to files of its own run. Small files (up
   to `HOLD_BYTES` in all) wait in memory and are written with the JSON by one `Storage.put_all`, the JSON
   after them: on local storage that is one group commit per job instead of one for the files and another for
   the JSON, each a long wait in a burst (same section).

The stored JSON keeps the output's shape; each copied URL string is replaced by our copy's location
(`s3://bucket/key`, or a file path for local storage), a permanent address that `aws s3 cp` and
`Storage.presigned_url` accept (a presigned URL would expire like the provider's). When the output is a JSON object,
the provenance is added under one reserved key, `"_offload_files": {original_url: location}`; lists and bare
strings (common with Replicate) cannot take an extra key, so their mapping is only in the returned `StoredOutput`.

Any failure raises before the output key is written, so the worker never marks the job succeeded on a partial
result: a network error or a 5xx/429 from the file host is a plain (transient) `StorageError`; a 404/410 (the file
already expired), another 4xx or a file over the size limit is a `StorageError` with `permanent=True`; a URL the
egress rule refuses is a `FileRefused`. The URL is the producer's to choose (outputs echo inputs), so what it
may see of a failure is one generic line whatever happened (refused, closed port, timeout, HTTP status): anything
more would map the worker's network for it. The reason goes to the worker's log, the URL bare of its query.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import re
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import IO, Any, Protocol
from urllib.parse import unquote, urlsplit

import httpx

from offload.egress import POLICY, AddressRefused, FilePolicy, enforced
from offload.redact import bare_url, redact
from offload.storage.base import Put, Storage, StorageError, dump_json
from offload.storage.inputs import copied_prefix, default_job

FILES_KEY = "_offload_files"
DEFAULT_MAX_FILE_BYTES = 512 * 1024 * 1024
DEFAULT_MAX_FILES = 256
DEFAULT_FILE_TIMEOUT_S = 300.0
COPY_CONCURRENCY = 4  # per output; the worker bounds how many outputs are stored at once
SPOOL_BYTES = 8 * 1024 * 1024  # smaller files stay in memory, larger ones go to a temp file
HOLD_BYTES = 1024 * 1024  # per output: copied files up to this much in all are written together with its JSON
_URL = re.compile(r"https?://[^\s\"'<>]+", re.IGNORECASE)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
PUBLIC_ONLY = FilePolicy()
log = logging.getLogger("offload.storage")


class FileRefused(StorageError):
    """An output file whose URL (or a redirect hop of it) the egress rule refuses: the same output would be
    refused again, so the worker ends the job rather than paying for another run."""

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


class PlainAnswer(Protocol):
    """A file's answer on a plain GET (see `PlainGet`)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def chunks(self) -> AsyncIterator[bytes]: ...


class PlainGet(Protocol):
    """A shorter road for the common file copy than httpx's (the worker's aiohttp transport:
    `offload.backends.transport.AiohttpTransport.get_plain`): None when httpx must take the request after all."""

    def get_plain(
        self, url: str, *, headers: Mapping[str, str], timeout: httpx.Timeout, policy: FilePolicy | None = None
    ) -> AbstractAsyncContextManager[PlainAnswer | None]: ...


@dataclass(frozen=True)
class CopiedFile:
    """One provider file copied into our storage."""

    url: str
    key: str
    location: str
    content_type: str
    size: int


@dataclass(frozen=True)
class StoredOutput:
    """Where the output went and which files were copied alongside it (in the order they appear)."""

    location: str
    key: str
    files: list[CopiedFile] = field(default_factory=list)

    @property
    def file_map(self) -> dict[str, str]:
        return {f.url: f.location for f in self.files}


def files_prefix(output_key: str) -> str:
    """A job's default output key `results/q:abc.json` -> `results/q:_files/abc~`; any other `results/abc.json`
    -> `results/abc/files/`, and a key without `.json` gets `<key>.files/` instead, so the prefix never collides
    with the output itself (a file and a directory of the same name, on local storage)."""
    if (job_id := default_job(output_key)) is not None:
        return copied_prefix(job_id)
    stem = output_key.removesuffix(".json")
    return f"{stem}/files/" if stem != output_key else f"{output_key}.files/"


def find_file_urls(output: Any, policy: FilePolicy = PUBLIC_ONLY) -> list[str]:
    """Distinct candidate URLs in document order (dict insertion order, then list order): whole-string http(s)
    URLs whose host the policy lists (any host, without `file_hosts`). Whether one may be fetched is decided at
    its connection (offload.egress)."""
    seen: dict[str, None] = {}
    for s in _strings(output):
        if s not in seen and _URL.fullmatch(s) and policy.listed(_host(s)):
            seen[s] = None
    return list(seen)


def _host(url: str) -> str:
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def rewrite(value: Any, mapping: Mapping[str, str]) -> Any:
    """A copy of `value` with every string that is a key of `mapping` replaced; the input is not mutated."""
    if isinstance(value, str):
        return mapping.get(value, value)
    if isinstance(value, Mapping):
        return {k: rewrite(v, mapping) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rewrite(v, mapping) for v in value]
    return value


def file_name(url: str, index: int, content_type: str) -> str:
    """`<index>-<basename>`, the basename made safe for any store; an extension is added from the Content-Type
    when the URL has none, so downloaded copies open with the right program."""
    raw = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    base = _UNSAFE.sub("_", raw).strip("._")[-100:] or "file"
    if "." not in base:
        ext = mimetypes.guess_extension(content_type.split(";")[0].strip()) or ""
        base += ext
    return f"{index}-{base}"


async def store_output(
    storage: Storage,
    output_key: str,
    output: Any,
    http: httpx.AsyncClient,
    *,
    copy_files: bool = True,
    policy: FilePolicy = PUBLIC_ONLY,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
    file_timeout_s: float = DEFAULT_FILE_TIMEOUT_S,
    auth_headers: Mapping[str, Mapping[str, str]] | None = None,
    run: str | None = None,
    before_write: Callable[[], Awaitable[None]] | None = None,
    plain: PlainGet | None = None,
) -> StoredOutput:
    """Copy the output's files, then write the (rewritten) output JSON to `output_key`; see the module docstring.
    `run` names the remote run (its files are `<prefix>r<run>-<n>-<name>`); `before_write` runs right before the JSON is
    written and may raise to stop it (a worker that lost its lease must not overwrite a newer run's output).

    `http` must be an egress client (`new_client(egress=True)`): `policy` (the backend's FilePolicy) is applied
    to each of its connections and redirect hops. It must carry no provider credentials in its default headers,
    since file URLs may point anywhere. Pass them in `auth_headers` instead: host -> headers sent only to that
    host (Replicate's file host wants the API token). On a redirect to another origin httpx drops
    `Authorization`, but not other headers. `plain`: a shorter road for a file whose URL and answer need nothing
    of httpx (no redirect, no encoded body).
    """
    urls = find_file_urls(output, policy) if copy_files else []
    if urls and not enforced(http):
        raise TypeError("store_output copies provider files only through an egress client (new_client(egress=True))")
    if len(urls) > max_files:
        raise StorageError(f"output links {len(urls)} files, more than the limit of {max_files}", permanent=True)
    if urls:
        files, held = await _copy_files(
            storage,
            _Road(http, plain, policy),
            urls,
            output_key,
            run=run,
            max_file_bytes=max_file_bytes,
            file_timeout_s=file_timeout_s,
            auth_headers=auth_headers,
        )
        mapping = {f.url: f.location for f in files}
        stored = rewrite(output, mapping)
        if isinstance(stored, dict):
            previous = stored.get(FILES_KEY)
            stored[FILES_KEY] = {**(previous if isinstance(previous, dict) else {}), **mapping}
    else:
        files, held, stored = [], [], output
    if before_write is not None:
        await before_write()
    document = Put(output_key, dump_json(stored), "application/json")
    location = (await storage.put_all([*held, document]))[-1]
    return StoredOutput(location=location, key=output_key, files=files)


async def _copy_files(
    storage: Storage,
    road: _Road,
    urls: list[str],
    output_key: str,
    *,
    run: str | None,
    max_file_bytes: int,
    file_timeout_s: float,
    auth_headers: Mapping[str, Mapping[str, str]] | None,
) -> tuple[list[CopiedFile], list[Put]]:
    """Copy every file, COPY_CONCURRENCY at a time, each within `file_timeout_s`: the copies in URL order, and
    the small ones' bytes (up to HOLD_BYTES in all) held back to be written with the JSON."""
    host_headers = {host.lower(): dict(h) for host, h in (auth_headers or {}).items()}
    prefix = files_prefix(output_key) + (f"r{run}-" if run else "")
    gate = asyncio.Semaphore(COPY_CONCURRENCY)
    room = HOLD_BYTES

    def hold(size: int) -> bool:
        nonlocal room
        if size > room:
            return False
        room -= size
        return True

    async def copy(index: int, url: str) -> tuple[CopiedFile, bytes | None]:
        async with gate:
            headers = host_headers.get(_host(url).lower(), {})
            try:
                async with asyncio.timeout(file_timeout_s):
                    return await _copy_file(storage, road, url, index, prefix, max_file_bytes, headers, hold)
            except (StorageError, AddressRefused, TimeoutError) as exc:
                raise _not_copied(output_key, index, url, exc, file_timeout_s) from None

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(copy(i, url)) for i, url in enumerate(urls)]
    except BaseExceptionGroup as eg:
        raise _first_error(eg) from None
    files: list[CopiedFile] = []
    held: list[Put] = []
    for task in tasks:
        copied, data = task.result()
        files.append(copied)
        if data is not None:
            held.append(Put(copied.key, data, copied.content_type))
    return files, held


def _first_error(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """TaskGroup wraps failures in a group; the worker wants the first real one (cancellations are fallout)."""
    for exc in eg.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return eg


def _not_copied(output_key: str, index: int, url: str, exc: BaseException, timeout_s: float) -> StorageError:
    """The one line a producer sees for any failed copy, the reason logged for the operator (see the module
    docstring); transient or permanent as the reason is, and FileRefused for a refusal."""
    if isinstance(exc, AddressRefused):
        reason = f"copying {bare_url(url)}: refused, {exc.address} is {exc.why}"
    elif isinstance(exc, TimeoutError):
        reason = f"copying {bare_url(url)}: took longer than {timeout_s:g}s"
    else:
        reason = str(exc)  # the URL in it bare already (`_copy_file`)
    log.warning("output %s: file %d not copied: %s", output_key, index + 1, redact(reason))
    message = f"output file {index + 1} could not be copied (the worker's log says why)"
    if isinstance(exc, AddressRefused):
        return FileRefused(message)
    return StorageError(message, permanent=isinstance(exc, StorageError) and exc.permanent)


@dataclass(frozen=True)
class _Road:
    """How one output's files are fetched: the egress client, its aiohttp fast path, and the backend's policy."""

    http: httpx.AsyncClient
    plain: PlainGet | None
    policy: FilePolicy


async def _copy_file(
    storage: Storage,
    road: _Road,
    url: str,
    index: int,
    prefix: str,
    limit: int,
    headers: dict[str, str],
    hold: Callable[[int], bool],
) -> tuple[CopiedFile, bytes | None]:
    """Copy one file: written now, or (when `hold` takes its size) its bytes returned, for the caller to write."""
    shown = bare_url(url)  # signed provider URLs carry tokens in the query, some carry userinfo
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
        try:
            got: tuple[int, str] | None = None
            http = road.http
            if road.plain is not None:
                agent = http.headers.get("user-agent")
                sent = {**({"User-Agent": agent} if agent else {}), **headers}
                async with road.plain.get_plain(url, headers=sent, timeout=http.timeout, policy=road.policy) as answer:
                    if answer is not None:
                        got = await _receive(answer.status, answer.headers, answer.chunks(), spool, url, shown, limit)
            if got is None:
                # every hop carries the policy to the transport, which checks it on the hop's own URL
                hops = {POLICY: road.policy}
                async with http.stream("GET", url, headers=headers, follow_redirects=True, extensions=hops) as resp:
                    # aiter_bytes: decoded, since a gzip transfer is not the file
                    got = await _receive(resp.status_code, resp.headers, resp.aiter_bytes(), spool, url, shown, limit)
        except httpx.HTTPError as exc:
            raise StorageError(f"copying {shown}: {type(exc).__name__}") from None
        size, content_type = got
        spool.seek(0)
        key = prefix + file_name(url, index, content_type)
        if hold(size):
            data: bytes | None = spool.read()
            location = storage.location(key)
        else:
            data = None
            location = await storage.put_fileobj(key, spool, content_type)
    return CopiedFile(url=url, key=key, location=location, content_type=content_type, size=size), data


async def _receive(
    status: int,
    headers: Mapping[str, str],
    chunks: AsyncIterator[bytes],
    spool: IO[bytes],
    url: str,
    shown: str,
    limit: int,
) -> tuple[int, str]:
    """One answer for a provider file, spooled: its (size, content type), or the StorageError it deserves."""
    if status != 200:
        transient = status >= 500 or status in (408, 425, 429)
        expired = " (the provider's file has expired)" if status in (404, 410) else ""
        raise StorageError(f"copying {shown}: HTTP {status}{expired}", permanent=not transient)
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(shown, limit)
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise _too_large(shown, limit)
        spool.write(chunk)
    return size, headers.get("content-type") or _guess_type(url)


def _too_large(shown: str, limit: int) -> StorageError:
    return StorageError(f"copying {shown}: larger than the {limit}-byte limit", permanent=True)


def _guess_type(url: str) -> str:
    return mimetypes.guess_type(urlsplit(url).path)[0] or "application/octet-stream"
