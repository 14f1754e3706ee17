"""The GPU-worker protocol: machines that run the work themselves talk to the server, never to Redis or storage.

Each registered GPU worker is one worker id in the job store. Its HTTP heartbeat becomes a store heartbeat
for that id, so a worker that goes silent loses its leases through the store's ordinary reaper, exactly like a
dispatch worker that dies; the server never heartbeats on its own, which would keep a dead machine's jobs
leased. The server writes results to object storage for the worker, so a rented machine holds nothing but a
worker key scoped to its queues.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from fastapi import APIRouter, HTTPException, Request
from redis.exceptions import RedisError

from offload.access.api_keys import ApiKey
from offload.autoscale.instances import claim_problem, machine_price
from offload.connection import is_oom
from offload.errors import StaleLease
from offload.models import ClaimedJob, Job
from offload.queue.keyspace import validate_queue
from offload.queue.store import LeaseRef
from offload.server.auth import (
    GuardedRoute,
    Principal,
    guard,
    need_global_read,
    need_work,
    need_worker_scope,
    revoked,
    still_valid,
    worker_only,
)
from offload.server.file_refs import check_output_refs
from offload.server.routes_jobs import job_queue
from offload.server.schemas import (
    ClaimedView,
    ClaimReply,
    ClaimRequest,
    CompleteReply,
    CompleteRequest,
    DeregisterRequest,
    FailReply,
    FailRequest,
    HeartbeatReplyView,
    HeartbeatRequest,
    RegisterReply,
    RegisterRequest,
    TokenRequest,
    WorkerView,
)
from offload.server.state import ServerState, get_state
from offload.storage import InvalidKey, ObjectNotFound, StorageError
from offload.storage.base import dump_json
from offload.storage.inputs import delete_keys, run_output_key
from offload.storage.results import result_key

log = logging.getLogger("offload.server")
router = APIRouter(tags=["workers"], route_class=GuardedRoute)
T = TypeVar("T")


async def _worker(state: ServerState, key: ApiKey, worker_id: str) -> list[str]:
    """The worker's queues, after checking it exists and belongs to this key (admins may act for any)."""
    need_worker_scope(key)
    record = await state.registry.get(worker_id)
    if record is None:
        raise HTTPException(404, f"unknown worker {worker_id!r} (it expired or never registered: register again)")
    if key.scope != "admin" and record.get("key_id") != key.id:
        raise HTTPException(403, f"worker {worker_id!r} belongs to another key")
    return [q for q in record.get("queues", "").split(",") if q]


def _owned_token(worker_id: str, token: str) -> None:
    """Lease tokens are `<worker id>/<n>`: a worker can only write jobs leased to itself."""
    if not token.startswith(f"{worker_id}/"):
        raise StaleLease("the lease token does not belong to this worker")


@router.get("/v1/workers", response_model=list[WorkerView], summary="Live workers: GPU (HTTP) and dispatch")
async def list_workers(request: Request, key: Principal) -> list[WorkerView]:
    need_global_read(key, "workers")
    state = get_state(request)
    remote = await state.registry.gpu_workers()
    dispatch = await state.registry.dispatch(await state.store.queues(), {w.id for w in remote})
    return remote + dispatch


def _work_path_job(key: ApiKey, params: Mapping[str, Any]) -> None:
    need_work(key, job_queue(params["job_id"]))


@router.post(
    "/v1/workers/register",
    response_model=RegisterReply,
    status_code=201,
    summary="Register a GPU worker (returns its worker id and lease timing)",
)
@guard(worker_only)
async def register(request: Request, body: RegisterRequest, key: Principal) -> RegisterReply:
    for q in body.queues:
        validate_queue(q)
        need_work(key, q)
    state = get_state(request)
    # a machine registers only as the instance it was rented as
    why = await claim_problem(state.redis, body.instance_id, body.instance_token, body.queues)
    if why:
        raise HTTPException(403, why)
    worker_id = await state.registry.register(key.id, body)
    lease = state.options.worker_lease_ms
    log.info(
        "GPU worker %s registered (host %s, queues %s, instance %s)",
        worker_id,
        body.host,
        ",".join(body.queues),
        body.instance_id or "-",
    )
    return RegisterReply(
        worker_id=worker_id, lease_ms=lease, heartbeat_interval_s=lease / 3000, max_wait_s=state.options.max_wait_s
    )


def _draining(record: dict[str, str] | None) -> bool:
    """Set by the autoscaler (offload/autoscale/workers.py) when it drains the worker's instance."""
    return record is not None and record.get("draining") == "1"


def _view(queue: str, job: ClaimedJob) -> ClaimedView:
    return ClaimedView(
        id=job.id,
        token=job.token,
        queue=queue,
        attempt=job.attempt,
        max_attempts=job.max_attempts,
        input=job.input,
        output_key=job.output_key,
        cancel_requested=job.cancel_requested,
    )


@router.post(
    "/v1/workers/{worker_id}/claim",
    response_model=ClaimReply,
    summary="Lease up to `max` jobs, long-polling up to `wait` seconds when none is ready",
)
@guard(worker_only, stream=True)
async def claim(request: Request, worker_id: str, body: ClaimRequest, key: Principal) -> ClaimReply:
    """The key is re-checked right before each claim and again before the jobs go out: once it is revoked, no
    job is handed out (what the last claim took goes back to ready) and the long-poll ends with 401."""
    need_work(key, body.queue)
    state = get_state(request)
    if body.queue not in await _worker(state, key, worker_id):
        raise HTTPException(403, f"worker {worker_id!r} did not register for queue {body.queue!r}")
    lease = state.options.worker_lease_ms
    deadline = time.monotonic() + min(body.wait, state.options.max_wait_s)
    if _draining(await state.registry.get(worker_id)):  # the autoscaler is retiring its machine: no new work
        await state.hub.pause(min(body.wait, state.options.max_wait_s))
        return ClaimReply(jobs=[])
    with state.hub.subscribe([body.queue]) as sub:
        while True:
            await still_valid(state, key)
            if not state.store_watch.safe:  # the store may evict: no new work (the server says why, loudly)
                await state.hub.pause(max(deadline - time.monotonic(), 0.0))
                return ClaimReply(jobs=[])
            # a GPU worker never takes a job a dispatch worker may have sent (a queue with overflow: pick.lua)
            jobs = await state.store.claim(body.queue, worker_id, body.max, lease, mode="fleet")
            if jobs and not await state.keys.alive(key):  # revoked during the claim: hand back what it took
                await state.store.release_leases(body.queue, worker_id, [j.id for j in jobs])
                raise revoked()
            record = await state.registry.get(worker_id)
            if record is None:  # deregistered (or expired) meanwhile: hand back what this call claimed. Only that:
                # a worker that died holding jobs must lose them by lease expiry, which counts against each
                # job's crash budget (a poison job that kills its workers goes dead instead of looping). A worker
                # left with nothing is forgotten: this claim must not list a deregistered worker as alive again.
                await state.store.release_leases(body.queue, worker_id, [j.id for j in jobs], forget_idle=True)
                return ClaimReply(jobs=[])
            if _draining(record):  # drained meanwhile: hand back only what this call claimed
                if jobs:
                    await state.store.release_leases(body.queue, worker_id, [j.id for j in jobs])
                return ClaimReply(jobs=[])
            jobs = await _storable(state, jobs)
            if jobs:
                if await request.is_disconnected():  # nobody will receive them: hand them straight back
                    await state.store.release_leases(body.queue, worker_id, [j.id for j in jobs])
                    return ClaimReply(jobs=[])
                return ClaimReply(jobs=[_view(body.queue, j) for j in jobs])
            left = deadline - time.monotonic()
            if left <= 0 or state.hub.stopping or await request.is_disconnected():
                return ClaimReply(jobs=[])
            end = time.monotonic() + min(left, 1.0)
            while (remaining := end - time.monotonic()) > 0:
                event = await sub.next(remaining)
                if event is None or event[2].get("state") in ("queued", "resync"):
                    break


async def _storable(state: ServerState, jobs: list[ClaimedJob]) -> list[ClaimedJob]:
    """Jobs whose output key no storage accepts (`..`, absolute: a producer with Redis access wrote it) fail
    permanently here, before a GPU runs them, instead of failing at complete and being re-run forever."""
    keep = []
    for job in jobs:
        try:
            state.storage.location(job.output_key)
        except InvalidKey as exc:
            await state.store.fail(job.id, job.token, f"output_key cannot be stored: {exc}", retryable=False)
            continue
        keep.append(job)
    return keep


@router.post(
    "/v1/workers/{worker_id}/heartbeat",
    response_model=HeartbeatReplyView,
    summary="Keep the worker's leases alive; learn which it lost and which were cancelled",
)
@guard(worker_only, big_body=True)  # a busy worker names every job it holds
async def heartbeat(request: Request, worker_id: str, body: HeartbeatRequest, key: Principal) -> HeartbeatReplyView:
    """Leases are judged by (job id, token) when the worker sends `tokens` (a job claimed again under another
    token is lost to the old lease). Jobs the store leases to this worker that it does not list (a claim reply
    lost on the way, a task that ended without reporting) are handed back once they are a lease period old:
    a claim reply may still be in flight while this heartbeat is sent."""
    state = get_state(request)
    queues = await _worker(state, key, worker_id)
    if body.instance_id is not None and body.instance_id != await state.registry.instance_of(worker_id):
        raise HTTPException(403, f"worker {worker_id!r} registered as another instance_id: register again")
    if body.tokens is not None and len(body.tokens) != len(body.jobs):
        raise HTTPException(422, "tokens must have one entry per job in jobs")
    by_queue: dict[str, list[LeaseRef]] = {q: [] for q in queues}
    lost: list[str] = []
    for i, job_id in enumerate(body.jobs):
        q = job_queue(job_id)
        ref: LeaseRef = (job_id, body.tokens[i]) if body.tokens is not None else job_id
        if q in by_queue:
            by_queue[q].append(ref)
        else:
            lost.append(job_id)
    cancels: list[str] = []
    timed_out: list[str] = []
    lease = state.options.worker_lease_ms
    for q, refs in by_queue.items():
        need_work(key, q)
        reply = await state.store.heartbeat(q, worker_id, refs, lease, grace_ms=lease)
        lost += reply.lost
        cancels += reply.cancel_requested
        if reply.released:
            log.warning("worker %s: released %d leased job(s) it does not know about", worker_id, reply.released)
        gone = set(reply.lost)
        timed_out += await _time_out(state, q, worker_id, [r if isinstance(r, str) else r[0] for r in refs], gone)
    # in flight: the listed jobs the store really leases to this worker, not what it claims (a worker reporting
    # 100k jobs would look busy to the autoscaler forever)
    held = len(set(body.jobs) - set(lost) - set(timed_out))
    try:
        registered = await state.registry.touch(worker_id, held, body.protected)
    except RedisError as exc:  # at maxmemory the record's TTL still moves on (the script may run there); the
        if not is_oom(exc):  # leases were extended above, and the worker must hear which it lost
            raise
        state.store_watch.oom_seen()
        registered = True
    if not registered:  # deregistered while this heartbeat ran: it must not leave the worker listed as alive
        for q in queues:
            await state.store.release_leases(q, worker_id, [], forget_idle=True)
        raise HTTPException(404, f"unknown worker {worker_id!r} (it deregistered or expired: register again)")
    # a timed-out lease is lost too: a worker that does not know `timed_out` still lets go of it
    return HeartbeatReplyView(lost=lost + timed_out, cancel_requested=cancels, timed_out=timed_out)


async def _time_out(state: ServerState, queue: str, worker_id: str, ids: list[str], lost: set[str]) -> list[str]:
    """The worker's leases that have run past their queue's `timeout`: each attempt fails with the reason (retried
    with backoff, or dead when it was the last), and the worker is told to abandon the run. Fenced by the lease
    token: a job that finished meanwhile is left alone, and a late complete of an ended run is refused."""
    timeout = getattr(state.options.settings.queues.get(queue), "timeout", None)
    held = [i for i in ids if i not in lost]
    if timeout is None or not held:
        return []
    ended: list[str] = []
    reason = f"timed out after {timeout:g} s"
    overdue = await state.store.overdue(queue, worker_id, held, int(timeout * 1000))
    price = await _price(state, worker_id) if overdue else None
    for job_id, token, attempt in overdue:
        try:
            verdict = await state.store.fail(
                job_id, token, reason, retryable=True, attempt=max(attempt, 1), kind="fleet", price=price
            )
        except StaleLease:  # completed, failed or cancelled between the two steps
            continue
        log.warning("job %s: %s on worker %s -> %s; the worker is told to abandon it",
                    job_id, reason, worker_id, verdict)  # fmt: skip
        ended.append(job_id)
    return ended


async def _job_for(request: Request, key: ApiKey, worker_id: str, job_id: str, token: str) -> ServerState:
    queue = job_queue(job_id)
    need_work(key, queue)
    state = get_state(request)
    await _worker(state, key, worker_id)
    _owned_token(worker_id, token)
    return state


@router.post(
    "/v1/workers/{worker_id}/jobs/{job_id}/complete",
    response_model=CompleteReply,
    summary="Store the handler's output (server-side) and mark the job succeeded",
)
@guard(_work_path_job, big_body=True)
async def complete(
    request: Request, worker_id: str, job_id: str, body: CompleteRequest, key: Principal
) -> CompleteReply:
    """The output is written before the job is marked succeeded (guarantee 5), to an object of this lease's own
    (`run_output_key`), and the fenced complete (complete.lua checks the token atomically) points the record at
    it. A worker whose lease was taken over, even one that passed the checks here and paused before its write,
    writes only its own run's object, which the record never names: its complete is a 409 StaleLease and the
    object is deleted. Only then is the output copied to the job's `output_key`, for readers of the bucket, by
    the run the record names and no other. A repeat of a complete that went through (its reply was lost)
    answers 200 again and makes the copy again."""
    state = await _job_for(request, key, worker_id, job_id, body.token)
    job = await state.store.get(job_id)
    if job.state.value == "succeeded" and job.result:
        await state.store.complete(job_id, body.token, job.result)  # OK for the same token, else StaleLease
        await _copy_again(state, job)
        return CompleteReply(id=job_id, result=job.result)
    if job.lease_token != body.token:
        raise StaleLease(f"job {job_id}: lease token is stale (another worker owns it or it finished)")
    await check_output_refs(state, job, body.output)  # files only under this job's own prefix, all present
    try:
        data = dump_json(body.output)
    except (TypeError, ValueError) as exc:
        raise HTTPException(422, f"output is not JSON-serialisable: {exc}") from None
    try:
        state.storage.location(job.output_key)
        run_key = run_output_key(job_id, body.token)
    except InvalidKey as exc:  # can never be stored: dead now, not released to run again
        await state.store.fail(job_id, body.token, f"output_key cannot be stored: {exc}", retryable=False)
        raise HTTPException(422, f"job {job_id}: output_key cannot be stored ({exc}); the job is dead") from None
    except ValueError:
        raise StaleLease(f"job {job_id}: not a lease token of this job") from None
    location = await _storage_call(job_id, state.storage.put_bytes(run_key, data, "application/json"))
    price = await _price(state, worker_id)
    try:
        await state.store.complete(job_id, body.token, location, kind="fleet", price=price)
    except StaleLease:  # taken over meanwhile: this run's object is nobody's result
        await delete_keys(state.storage, [run_key])
        raise
    await _copy_out(state, job, data)
    return CompleteReply(id=job_id, result=location)


async def _price(state: ServerState, worker_id: str) -> float | None:
    """The worker's machine's price per hour (None: not a rented instance): a fleet job's cost is its run time's
    share of it, worked out by the store on its own clock."""
    return await machine_price(state.redis, await state.registry.instance_of(worker_id))


async def _copy_out(state: ServerState, job: Job, data: bytes) -> None:
    """The output at the job's `output_key` as well, where readers of the bucket (the tutorial's) look for it."""
    await _storage_call(job.id, state.storage.put_bytes(job.output_key, data, "application/json"))


async def _copy_again(state: ServerState, job: Job) -> None:
    """A repeated complete: the copy at `output_key`, when the first one died before making it (a HEAD first, so
    repeats cost no read and write of the output)."""
    stored = result_key(state.storage, job.id, job.output_key, job.result)
    if stored is None or stored == job.output_key:
        return
    if await _storage_call(job.id, state.storage.head(job.output_key)) is None:
        with contextlib.suppress(ObjectNotFound):  # (only a purge removes it; the record is then gone too)
            await _copy_out(state, job, await _storage_call(job.id, state.storage.get_bytes(stored)))


async def _storage_call(job_id: str, call: Awaitable[T]) -> T:
    """A storage call of the complete route: a failure is a 503 the worker retries the complete on."""
    try:
        return await call
    except StorageError as exc:
        log.warning("storing the output of %s failed: %s", job_id, exc)
        raise HTTPException(
            503, "storing the output failed; retry the complete", headers={"Retry-After": "1"}
        ) from None


@router.post(
    "/v1/workers/{worker_id}/jobs/{job_id}/fail",
    response_model=FailReply,
    summary="Report a failed attempt: retried with backoff per the job's policy, else dead",
)
@guard(_work_path_job)
async def fail(request: Request, worker_id: str, job_id: str, body: FailRequest, key: Principal) -> FailReply:
    state = await _job_for(request, key, worker_id, job_id, body.token)
    job = await state.store.get(job_id)
    result = await state.store.fail(
        job_id,
        body.token,
        body.error,
        retryable=body.retryable,
        attempt=max(job.attempts, 1),
        kind="fleet",
        price=await _price(state, worker_id),
    )
    return FailReply(id=job_id, state=result)


@router.post(
    "/v1/workers/{worker_id}/jobs/{job_id}/cancelled",
    response_model=FailReply,
    summary="Acknowledge a requested cancel: the job ends cancelled",
)
@guard(_work_path_job)
async def cancelled(request: Request, worker_id: str, job_id: str, body: TokenRequest, key: Principal) -> FailReply:
    state = await _job_for(request, key, worker_id, job_id, body.token)
    await state.store.ack_cancel(job_id, body.token)
    return FailReply(id=job_id, state="cancelled")


@router.post(
    "/v1/workers/{worker_id}/deregister",
    status_code=204,
    summary="A draining worker leaves: its remaining leases go back to ready at once",
)
@guard(worker_only)
async def deregister(request: Request, worker_id: str, body: DeregisterRequest, key: Principal) -> None:
    state = get_state(request)
    queues = await _worker(state, key, worker_id)
    await state.registry.remove(worker_id)  # first: a claim still running sees it gone and lets go
    for q in queues:
        if body.release:
            await state.store.release_leases(q, worker_id)
