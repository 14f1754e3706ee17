"""Producer routes: enqueue (single and batch), read, wait for, cancel and list jobs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response

from offload.errors import InvalidJob, InvalidTransition, JobNotFound, PayloadTooLarge
from offload.models import Attempt, Job
from offload.queue.keyspace import new_job_id, queue_of, validate_queue
from offload.queue.listing import LISTABLE_STATES
from offload.queue.specs import check_options, encode_input
from offload.redact import mask_url
from offload.server.auth import (
    GuardedRoute,
    Principal,
    guard,
    need_produce,
    need_read,
    produce_path_queue,
    still_valid,
)
from offload.server.errors import FieldError
from offload.server.file_refs import check_input_refs, job_file_urls
from offload.server.schemas import (
    AttemptsReply,
    AttemptView,
    BatchEnqueueReply,
    BatchEnqueueRequest,
    CancelReply,
    EnqueueReply,
    EnqueueRequest,
    JobEvent,
    JobPage,
    JobView,
    WaitReply,
)
from offload.server.state import ServerState, get_state
from offload.storage import StorageError
from offload.storage.namespace import key_problem
from offload.storage.results import result_key
from offload.tracing import request_parent

router = APIRouter(tags=["jobs"], route_class=GuardedRoute)
IdemHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key", max_length=1024, description="A repeat with the same key returns the first job's id."
    ),
]


def job_queue(job_id: str) -> str:
    """The queue of a job id; an id offload could never have issued is simply an unknown job."""
    try:
        return queue_of(job_id)
    except InvalidJob:
        raise JobNotFound(f"job {job_id} not found") from None


async def job_view(state: ServerState, job: Job, presign: bool = True) -> JobView:
    """A presigned URL only for the job's own object: the one its record points at (its output key, or the run
    object a GPU worker's fenced complete stored), in the job's queue's namespace (a record written some other
    way gets no URL to another queue's data)."""
    own = own_object(state, job)
    url = await result_url(state, own) if presign else None
    files = await job_file_urls(state, job, own) if presign else None
    record = job.to_dict()
    if record.get("callback_url"):  # a token in its query or userinfo is the producer's, not every reader's
        record["callback_url"] = mask_url(record["callback_url"])
    return JobView(**record, result_url=url, file_urls=files or None)


async def result_url(state: ServerState, own: str | None) -> str | None:
    """The presigned GET of a job's own stored output (`own_object`), or None."""
    if own is None:
        return None
    with contextlib.suppress(StorageError, ValueError):
        return await state.storage.presigned_url(own, state.options.presign_expires_s)
    return None


def own_object(state: ServerState, job: Job) -> str | None:
    """The key of the succeeded job's stored output, when it is the job's own object; else None."""
    if job.state.value != "succeeded":
        return None
    stored = result_key(state.storage, job.id, job.output_key, job.result)
    if stored == job.output_key and key_problem(job.queue, stored, state.options.settings.output_prefixes()):
        return None
    return stored


def check_callback_url(state: ServerState, url: str | None, loc: list[str | int]) -> None:
    """422 naming the field when a callback URL is malformed or names a host the operator does not allow."""
    if url is not None and (problem := state.options.settings.callbacks.problem(url)):
        raise FieldError(loc, f"callback_url {problem}")


def check_output_key(state: ServerState, queue: str, key: str | None, loc: list[str | int]) -> None:
    """422 naming the field when an output key would leave the queue's storage namespace."""
    if key is not None and (problem := key_problem(queue, key, state.options.settings.output_prefixes())):
        raise FieldError(loc, f"output_key: {problem}")


async def require_queue(state: ServerState, queue: str) -> None:
    validate_queue(queue)
    if not await state.known_queue(queue):
        raise HTTPException(404, f"unknown queue {queue!r}")


@router.post(
    "/v1/queues/{queue}/jobs",
    status_code=201,
    response_model=EnqueueReply,
    summary="Enqueue one job",
    responses={200: {"description": "Idempotent repeat: the first job's id"}},
)
@guard(produce_path_queue, big_body=True)
async def enqueue(
    request: Request,
    response: Response,
    queue: str,
    body: EnqueueRequest,
    key: Principal,
    idempotency_key: IdemHeader = None,
) -> EnqueueReply:
    state = get_state(request)
    state.store_watch.require_safe()  # a store that may evict would lose what we acknowledge: 503
    check_output_key(state, queue, body.output_key, ["body", "output_key"])
    check_callback_url(state, body.callback_url, ["body", "callback_url"])
    spec = body.spec(idempotency_key)
    payload = encode_input(spec, state.store.max_payload)  # the size limit, before any search for files
    check_options(spec)
    files = await check_input_refs(state, queue, body.input, payload, ["body", "input"])
    fresh = files.job_id or new_job_id(queue)
    with request_parent(request.headers):  # the jobs join the producer's trace, if it sent one
        (done,) = await state.store.enqueue_results(queue, [dataclasses.replace(spec, job_id=fresh)])
    duplicate = done.id != fresh or files.resent
    if duplicate:
        response.status_code = 200
    return EnqueueReply(id=done.id, duplicate=duplicate, record_gone=done.record_gone)


@router.post(
    "/v1/queues/{queue}/jobs/batch",
    status_code=201,
    response_model=BatchEnqueueReply,
    summary="Enqueue many jobs in one request (up to the server's batch limit)",
)
@guard(produce_path_queue, big_body=True)
async def enqueue_batch(
    request: Request, queue: str, body: BatchEnqueueRequest, key: Principal, idempotency_key: IdemHeader = None
) -> BatchEnqueueReply:
    """With an Idempotency-Key header, item i gets the key `<header>:<i>` unless it names its own, so a
    retried batch returns the same ids instead of enqueueing twice."""
    state = get_state(request)
    state.store_watch.require_safe()
    specs = [job.spec(f"{idempotency_key}:{i}" if idempotency_key else None) for i, job in enumerate(body.jobs)]
    payloads = []
    for i, spec in enumerate(specs):  # every size limit before any search for files
        check_output_key(state, queue, spec.output_key, ["body", "jobs", i, "output_key"])
        check_callback_url(state, spec.callback_url, ["body", "jobs", i, "callback_url"])
        try:
            payloads.append(encode_input(spec, state.store.max_payload))
            check_options(spec)
        except (InvalidJob, PayloadTooLarge) as exc:
            if isinstance(exc, PayloadTooLarge):
                raise PayloadTooLarge(f"jobs.{i}: {exc}") from None
            field = [exc.field] if isinstance(exc, InvalidJob) and exc.field else []
            raise FieldError(["body", "jobs", i, *field], str(exc)) from None
    for i, (spec, payload) in enumerate(zip(specs, payloads, strict=True)):
        files = await check_input_refs(state, queue, spec.input, payload, ["body", "jobs", i, "input"])
        if files.job_id:
            specs[i] = dataclasses.replace(spec, job_id=files.job_id)
    with request_parent(request.headers):
        done = await state.store.enqueue_results(queue, specs)
    return BatchEnqueueReply(ids=[d.id for d in done], record_gone=[d.id for d in done if d.record_gone])


@router.get("/v1/jobs/{job_id}", response_model=JobView, summary="A job's record (and a presigned URL to its result)")
async def get_job(
    request: Request,
    job_id: str,
    key: Principal,
    presign: Annotated[bool, Query(description="Include result_url for succeeded jobs.")] = True,
) -> JobView:
    need_read(key, job_queue(job_id))
    state = get_state(request)
    return await job_view(state, await state.store.get(job_id), presign)


@router.get(
    "/v1/jobs/{job_id}/attempts",
    response_model=AttemptsReply,
    summary="A job's attempts: who ran it, where, how it ended",
)
async def job_attempts(request: Request, job_id: str, key: Principal) -> AttemptsReply:
    """Apart from the job's record, which `wait`, the listings and every client poll read: up to 50 attempts would
    make each of those reads many times larger for a view that only the job's page and `offload job` need."""
    need_read(key, job_queue(job_id))
    state = get_state(request)
    kept, made = await state.store.attempts(job_id)
    events = [
        JobEvent(at=int(eid.split("-")[0]), state=f.get("state", ""), detail=_detail(f))
        for eid, f in await state.store.job_events(job_id)
    ]
    return AttemptsReply(id=job_id, made=made, attempts=[attempt_view(state, a) for a in kept], events=events)


def _detail(fields: dict[str, str]) -> dict[str, str]:
    """A stream entry's fields but its state and job ids (a batch's entry names up to 100 other jobs)."""
    return {k: v for k, v in fields.items() if k not in ("state", "jobs")}


def attempt_view(state: ServerState, attempt: Attempt) -> AttemptView:
    """An attempt, with its remote job's page in the provider's console where one is built from the id alone."""
    settings = state.options.settings.backends.get(attempt.backend or "")
    console = settings.console_url(attempt.remote_id) if settings is not None and attempt.remote_id else None
    return AttemptView(**attempt.to_dict(), console_url=console)


@router.get(
    "/v1/jobs/{job_id}/wait", response_model=WaitReply, summary="Long-poll until the job finishes or the timeout passes"
)
@guard(stream=True)
async def wait_job(
    request: Request,
    job_id: str,
    key: Principal,
    timeout: Annotated[float, Query(ge=0, le=3600, description="Seconds (capped by the server).")] = 30,
) -> WaitReply:
    """Wakes on the queue's event stream, so a finished job answers within milliseconds; a slow re-read
    every two seconds covers events lost to a Redis failover."""
    queue = job_queue(job_id)
    need_read(key, queue)
    state = get_state(request)
    deadline = time.monotonic() + min(timeout, state.options.max_wait_s)
    with state.hub.subscribe([queue]) as sub:
        while True:
            await still_valid(state, key)  # a key revoked meanwhile reads no more
            job = await state.store.get(job_id)
            left = deadline - time.monotonic()
            if job.state.terminal or left <= 0 or state.hub.stopping:
                view = await job_view(state, job)
                return WaitReply(**view.model_dump(), timed_out=not job.state.terminal)
            end = time.monotonic() + min(left, 2.0)
            while (remaining := end - time.monotonic()) > 0:
                event = await sub.next(remaining)
                if event is None or not event[2].get("jobs") or job_id in event[2]["jobs"].split():
                    break


@router.post("/v1/jobs/{job_id}/cancel", response_model=CancelReply, summary="Cancel a job")
async def cancel_job(request: Request, job_id: str, key: Principal) -> CancelReply:
    need_produce(key, job_queue(job_id), "cancel jobs")
    try:
        result = await get_state(request).store.cancel(job_id)
    except InvalidTransition as exc:
        raise HTTPException(409, str(exc)) from None
    return CancelReply(id=job_id, result=result)


@router.get("/v1/queues/{queue}/jobs", response_model=JobPage, summary="Jobs of a queue in one state, paginated")
async def list_jobs(
    request: Request,
    queue: str,
    key: Principal,
    state: Annotated[str, Query(description=f"One of: {', '.join(LISTABLE_STATES)}")] = "queued",
    cursor: Annotated[str | None, Query(max_length=15, pattern=r"^\d+$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> JobPage:
    need_read(key, queue)
    return await page(get_state(request), queue, state, cursor, limit)


async def page(state: ServerState, queue: str, job_state: str, cursor: str | None, limit: int) -> JobPage:
    """Waiting states oldest first, finished ones newest first. The cursor is opaque to clients."""
    await require_queue(state, queue)
    if job_state not in LISTABLE_STATES:
        raise FieldError(
            ["query", "state"], f"unknown state {job_state!r}; choose one of: {', '.join(LISTABLE_STATES)}"
        )
    jobs, nxt = await state.store.list_jobs(queue, job_state, cursor=int(cursor or 0), limit=limit)
    views = await asyncio.gather(*(job_view(state, j, presign=False) for j in jobs))
    return JobPage(jobs=list(views), next_cursor=None if nxt is None else str(nxt))
