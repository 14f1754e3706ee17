"""The server's checks on file references, in one place: what an enqueue over HTTP may refer to, what a GPU worker's
output may refer to, and the presigned URLs a reader of a job gets for its files.

A producer over HTTP holds a key for its queue only, so a reference it sends must name an upload of that queue
(`results/<queue>:_in/<hex>/...`, issued by `POST /v1/queues/{queue}/uploads`) whose object exists with the size
it claims; all references of one job come from uploads for the same job id, which becomes the job's id, so the
files live and die with it. A repeat of an enqueue that went through (its reply lost) answers with that job;
the same files in a different input are refused. Anything else is a 422 naming the field. A GPU worker's output
may refer to files under its job's output prefix (uploaded through URLs the server issued for that job) or to
the job's own inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import orjson

from offload.errors import JobNotFound
from offload.files import REF_KEY, Path_, reference_problem, references_in
from offload.models import Job
from offload.server.errors import FieldError
from offload.server.state import ServerState
from offload.storage import ObjectNotFound, StorageError
from offload.storage.inputs import INPUTS, inputs_prefix, job_of_key, outputs_prefix
from offload.storage.namespace import own_prefix

MAX_OUTPUT_READ = 16 << 20  # a stored output larger than this is not scanned for files on every GET


async def _check_object(state: ServerState, loc: list[str | int], ref: dict[str, Any]) -> None:
    try:
        info = await state.storage.head(ref[REF_KEY])
    except StorageError as exc:
        raise FieldError(loc, f"cannot check file {ref[REF_KEY]}: {exc}") from None
    if info is None:
        raise FieldError(loc, f"file {ref[REF_KEY]} does not exist (upload it first)")
    if ref.get("size") is not None and ref["size"] != info.size:
        raise FieldError(loc, f"file {ref[REF_KEY]} has {info.size} bytes, the reference says {ref['size']}")


async def check_input_refs(
    state: ServerState, queue: str, value: Any, loc: Sequence[str | int]
) -> tuple[str | None, bool]:
    """422 for any bad reference in an HTTP enqueue; returns the job id the references imply (None: no files)
    and whether that job exists already (a resent request)."""
    implied: str | None = None
    for path, ref in references_in(value):
        where = [*loc, *path]
        if problem := reference_problem(ref):
            raise FieldError(where, problem)
        key = ref[REF_KEY]
        owner = job_of_key(queue, key)
        if owner is None or not key.startswith(own_prefix(queue) + INPUTS):
            raise FieldError(where, f"file {key[:200]!r} is not an upload of queue {queue!r}")
        if implied not in (None, owner):
            raise FieldError(where, "all files of one job must be uploads for the same job_id")
        implied = owner
        await _check_object(state, where, ref)
    if implied is not None:
        try:
            existing = await state.store.get(implied)
        except JobNotFound:
            return implied, False
        if existing.input != value:  # the same request again (its reply was lost) answers with that job
            raise FieldError(list(loc), f"these files belong to job {implied} already; upload again for a new job")
        return implied, True
    return None, False


def input_keys(job: Job) -> set[str]:
    try:
        return {ref[REF_KEY] for _, ref in references_in(job.input)}
    except ValueError:  # an input that is not valid JSON has no files
        return set()


async def check_output_refs(state: ServerState, job: Job, output: Any) -> None:
    """422 unless every reference in a GPU worker's output names an existing object of this job."""
    own = outputs_prefix(job.id)
    inputs = input_keys(job)
    for path, ref in references_in(output):
        where: list[str | int] = ["body", "output", *path]
        if problem := reference_problem(ref):
            raise FieldError(where, problem)
        key = ref[REF_KEY]
        if not key.startswith(own) and key not in inputs:
            raise FieldError(where, f"file {key[:200]!r} is outside job {job.id}'s output prefix {own}")
        await _check_object(state, where, ref)


async def job_file_urls(state: ServerState, job: Job, stored_output: bool) -> dict[str, str]:
    """Presigned GETs for every file a job refers to: its input's, and its stored output's when `stored_output`
    (the caller has checked the output is this job's own object)."""
    refs: list[tuple[Path_, dict[str, Any]]] = []
    with contextlib.suppress(ValueError):
        refs += references_in(job.input)
    if stored_output:
        with contextlib.suppress(ObjectNotFound, StorageError, ValueError):
            info = await state.storage.head(job.output_key)
            if info is not None and info.size <= MAX_OUTPUT_READ:
                refs += references_in(orjson.loads(await state.storage.get_bytes(job.output_key)))
    allowed = (inputs_prefix(job.id), outputs_prefix(job.id))
    urls: dict[str, str] = {}
    expires = state.options.presign_expires_s
    for _, ref in refs:
        key = ref[REF_KEY]
        if key not in urls and key.startswith(allowed):  # never a URL to someone else's object
            with contextlib.suppress(StorageError, ValueError):
                urls[key] = await state.storage.presigned_url(key, expires)
    return urls
