"""The server's checks on file references, in one place: what an enqueue over HTTP may refer to, what a GPU worker's
output may refer to, and the presigned URLs a reader of a job gets for its files.

A producer over HTTP holds a key for its queue only, so a reference it sends must name an upload of that queue
(`results/<queue>:_in/<hex>/...`, issued by `POST /v1/queues/{queue}/uploads`) whose object exists with the size
it claims; all references of one job come from uploads for the same job id, which becomes the job's id, so the
files live and die with it. A repeat of an enqueue that went through (its reply lost) answers with that job;
the same files in a different input are refused. Anything else is a 422 naming the field. A GPU worker's output
may refer to files under its job's output prefix (uploaded through URLs the server issued for that job) or to
the job's own inputs.

No check may hold the event loop: a value is searched for references only after its size limit passed, and only
when its compact JSON holds the `"$file":` marker (a byte search); the walk that finds where they are runs in a
thread unless the value is small. At most `storage.max_files_per_job` distinct files per value, each checked with
one HEAD, a bounded number at once. The job record keeps its input's keys (`Job.files`), so reads never walk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from offload import exactjson
from offload.errors import JobNotFound
from offload.files import (
    REF_KEY,
    TooManyReferences,
    find_references,
    reference_keys,
    reference_problem,
)
from offload.models import Job
from offload.server.errors import FieldError
from offload.server.state import ServerState
from offload.storage import ObjectInfo, ObjectNotFound, StorageError
from offload.storage.base import dump_json
from offload.storage.inputs import INPUTS, inputs_prefix, job_of_key, outputs_prefix
from offload.storage.namespace import own_prefix

MAX_OUTPUT_READ = 16 << 20  # a stored output larger than this is not scanned for files on every GET
WALK_ON_LOOP_BYTES = 64 << 10  # a value this small is walked in place (about a millisecond); larger in a thread
HEADS_AT_ONCE = 16  # storage HEADs one check runs concurrently
_WALKS = "file_walks"  # ServerState.extra: one walk thread per server at a time, so the loop keeps the GIL often
Loc = Sequence[str | int]
# key -> the size each occurrence claims (None: no claim) -> where the first occurrence with that claim is
Claims = dict[str, dict[int | None, list[str | int]]]


@dataclass(frozen=True)
class InputFiles:
    """What the references of one HTTP enqueue imply: the job id they belong to (None: no files), whether that
    job exists already (a resent request), and the distinct object keys."""

    job_id: str | None = None
    resent: bool = False
    keys: tuple[str, ...] = ()


def _limit(state: ServerState) -> int:
    return state.options.settings.storage.max_files_per_job


def _too_many(loc: Loc, limit: int, found: int | None = None) -> FieldError:
    count = f"{found} different files" if found is not None else f"more than {limit} different files"
    return FieldError(loc, f"refers to {count}: over the limit of {limit} per job (storage.max_files_per_job)")


def _claims(value: Any, loc: Loc, limit: int) -> Claims:
    """Every reference in `value`, checked for shape, grouped by key (runs in a thread for a large value)."""
    try:
        found = find_references(value, limit)
    except TooManyReferences:
        raise _too_many(loc, limit) from None
    claims: Claims = {}
    for path, ref in found:
        where = [*loc, *path]
        if problem := reference_problem(ref):
            raise FieldError(where, problem)
        claims.setdefault(ref[REF_KEY], {}).setdefault(ref.get("size"), where)
    return claims


async def _find(state: ServerState, value: Any, encoded: bytes, loc: Loc) -> Claims:
    """The references of a value whose JSON is `encoded`: none, or too many, by a byte search; else one walk
    (for the paths and fields), off the loop unless the value is small."""
    keys = reference_keys(encoded)
    limit = _limit(state)
    if not keys:
        return {}
    if len(keys) > limit:
        raise _too_many(loc, limit, len(keys))
    if len(encoded) <= WALK_ON_LOOP_BYTES:
        return _claims(value, loc, limit)
    async with state.extra.setdefault(_WALKS, asyncio.Semaphore(1)):
        return await asyncio.to_thread(_claims, value, loc, limit)


async def _check_objects(state: ServerState, claims: Claims) -> None:
    """One HEAD per distinct key, HEADS_AT_ONCE at a time; then every claimed size against the object's."""
    gate = asyncio.Semaphore(HEADS_AT_ONCE)

    async def head(key: str) -> ObjectInfo | StorageError | None:
        async with gate:
            try:
                return await state.storage.head(key)
            except StorageError as exc:
                return exc

    infos = await asyncio.gather(*(head(key) for key in claims))
    for (key, sizes), info in zip(claims.items(), infos, strict=True):
        first = next(iter(sizes.values()))
        if isinstance(info, StorageError):
            raise FieldError(first, f"cannot check file {key}: {info}")
        if info is None:
            raise FieldError(first, f"file {key} does not exist (upload it first)")
        for size, where in sizes.items():
            if size is not None and size != info.size:
                raise FieldError(where, f"file {key} has {info.size} bytes, the reference says {size}")


async def check_input_refs(state: ServerState, queue: str, value: Any, encoded: bytes, loc: Loc) -> InputFiles:
    """422 for any bad reference in an HTTP enqueue whose input `value` encodes to `encoded` (checked against the
    size limit first); what the references imply."""
    claims = await _find(state, value, encoded, loc)
    implied: str | None = None
    for key, sizes in claims.items():
        where = next(iter(sizes.values()))
        owner = job_of_key(queue, key)
        if owner is None or not key.startswith(own_prefix(queue) + INPUTS):
            raise FieldError(where, f"file {key[:200]!r} is not an upload of queue {queue!r}")
        if implied not in (None, owner):
            raise FieldError(where, "all files of one job must be uploads for the same job_id")
        implied = owner
    if implied is None:
        return InputFiles()
    await _check_objects(state, claims)
    try:
        existing = await state.store.get(implied)
    except JobNotFound:
        return InputFiles(implied, False, tuple(claims))
    if existing.input != value:  # the same request again (its reply was lost) answers with that job
        raise FieldError(list(loc), f"these files belong to job {implied} already; upload again for a new job")
    return InputFiles(implied, True, tuple(claims))


async def input_keys(job: Job) -> tuple[str, ...]:
    """The object keys the job's input refers to: as its record keeps them, else (a record from before the
    field, or ingested) read off the compact JSON of its input by a byte search, never a walk."""
    if job.files is not None:
        return job.files
    try:
        return tuple(reference_keys(exactjson.dumps(job.input)))
    except TypeError:
        return ()


async def check_output_refs(state: ServerState, job: Job, output: Any) -> None:
    """422 unless every reference in a GPU worker's output names an existing object of this job."""
    try:
        encoded = dump_json(output)
    except (TypeError, ValueError):  # not JSON: the store refuses it, with its own 422
        return
    claims = await _find(state, output, encoded, ["body", "output"])
    if not claims:
        return
    own = outputs_prefix(job.id)
    inputs = set(await input_keys(job))
    for key, sizes in claims.items():
        if not key.startswith(own) and key not in inputs:
            where = next(iter(sizes.values()))
            raise FieldError(where, f"file {key[:200]!r} is outside job {job.id}'s output prefix {own}")
    await _check_objects(state, claims)


async def job_file_urls(state: ServerState, job: Job, stored_output: str | None) -> dict[str, str]:
    """Presigned GETs for every file a job refers to: its input's, and those of its stored output at key
    `stored_output` (the caller has checked it is this job's own object). The output is searched as bytes, not
    parsed."""
    keys = list(await input_keys(job))
    if stored_output is not None:
        with contextlib.suppress(ObjectNotFound, StorageError, ValueError):
            info = await state.storage.head(stored_output)
            if info is not None and info.size <= MAX_OUTPUT_READ:
                keys += reference_keys(await state.storage.get_bytes(stored_output))
    allowed = (inputs_prefix(job.id), outputs_prefix(job.id))
    urls: dict[str, str] = {}
    expires = state.options.presign_expires_s
    most = 2 * _limit(state)  # what an input and an output may each hold
    for key in dict.fromkeys(keys):
        if len(urls) >= most:
            break
        if key.startswith(allowed):  # never a URL to someone else's object
            with contextlib.suppress(StorageError, ValueError):
                urls[key] = await state.storage.presigned_url(key, expires)
    return urls
