"""Operator console routes: search a queue's jobs, and the dead letter grouped by error with bulk requeue and
purge of one group (or of chosen ids)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request

from offload.queue.dead_groups import group_ids, own_ids
from offload.queue.keyspace import STATE_SETS
from offload.queue.search import CURSOR_RE, JobFilter
from offload.server.auth import GuardedRoute, Principal, admin_only, guard, need_read
from offload.server.errors import FieldError
from offload.server.routes_jobs import job_view, require_queue
from offload.server.schemas import (
    CountReply,
    DeadGroupsReply,
    DeadGroupView,
    GroupRequest,
    JobPage,
    MoveReply,
)
from offload.server.state import ServerState, get_state

router = APIRouter(tags=["queues"], route_class=GuardedRoute)
TimeQ = Annotated[int | None, Query(ge=0, le=10**15, description="Epoch ms, included.")]
MOVE_CHUNK = 1000


@router.get(
    "/v1/queues/{queue}/search",
    response_model=JobPage,
    summary="Search a queue's jobs: id prefix, state, backend, error text, idempotency key, time range",
)
async def search_jobs(
    request: Request,
    queue: str,
    key: Principal,
    id: Annotated[str, Query(max_length=200, description="A job id or its start (with or without `<queue>:`).")] = "",
    state: Annotated[str | None, Query(description=f"One of: {', '.join(STATE_SETS)}; all by default.")] = None,
    backend: Annotated[str, Query(max_length=100, description="The backend that ran it last, exactly.")] = "",
    error: Annotated[str, Query(max_length=500, description="Text in its error, any case (plain text).")] = "",
    idempotency_key: Annotated[str, Query(max_length=1024)] = "",
    created_from: TimeQ = None,
    created_to: TimeQ = None,
    finished_from: TimeQ = None,
    finished_to: TimeQ = None,
    cursor: Annotated[str | None, Query(max_length=15, pattern=CURSOR_RE)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> JobPage:
    """Reads at most 10,000 jobs per request, matching or not: a page with fewer than `limit` jobs and a
    `next_cursor` means the search goes on from there."""
    need_read(key, queue)
    srv = get_state(request)
    await require_queue(srv, queue)
    if state is not None and state not in STATE_SETS:
        raise FieldError(["query", "state"], f"unknown state {state!r}; choose one of: {', '.join(STATE_SETS)}")
    where = JobFilter(id, state, backend, error, idempotency_key, created_from, created_to, finished_from, finished_to)
    try:
        jobs, nxt = await srv.store.search(queue, where, cursor, limit)
    except ValueError as exc:
        raise FieldError(["query", "cursor"], str(exc)) from None
    views = await asyncio.gather(*(job_view(srv, j, presign=False) for j in jobs))
    return JobPage(jobs=list(views), next_cursor=nxt)


@router.get("/v1/queues/{queue}/dead/groups", response_model=DeadGroupsReply, summary="Dead jobs grouped by error")
async def dead_groups(request: Request, queue: str, key: Principal) -> DeadGroupsReply:
    """Errors that differ only in ids and numbers are one group (offload/queue/dead_groups.py says how)."""
    need_read(key, queue)
    state = get_state(request)
    await require_queue(state, queue)
    groups, scanned, complete = await state.store.dead_groups(queue)
    views = [
        DeadGroupView(pattern=g.pattern, example=g.example, count=g.count, sample_ids=g.sample_ids) for g in groups
    ]
    return DeadGroupsReply(groups=views, scanned=scanned, complete=complete)


async def _chosen(state: ServerState, queue: str, body: GroupRequest) -> list[str]:
    if (body.pattern is None) == (not body.ids):
        raise FieldError(["body"], "give pattern or ids (not both)")
    await require_queue(state, queue)
    if body.pattern is not None:
        return await group_ids(state.store.redis, queue, body.pattern)
    return own_ids(queue, body.ids)


@router.post(
    "/v1/queues/{queue}/dead/groups/requeue",
    response_model=MoveReply,
    summary="One error group's dead jobs (or chosen ids) back to ready",
)
@guard(admin_only("requeue dead jobs"), big_body=True)
async def group_requeue(request: Request, queue: str, body: GroupRequest, key: Principal) -> MoveReply:
    state = get_state(request)
    ids = await _chosen(state, queue, body)
    moved: list[str] = []
    for i in range(0, len(ids), MOVE_CHUNK):
        moved += await state.store.requeue_dead(queue, ids[i : i + MOVE_CHUNK])
    return MoveReply(moved=moved)


@router.post(
    "/v1/queues/{queue}/dead/groups/purge",
    response_model=CountReply,
    summary="Delete one error group's dead jobs (or chosen ids)",
)
@guard(admin_only("purge dead jobs"), big_body=True)
async def group_purge(request: Request, queue: str, body: GroupRequest, key: Principal) -> CountReply:
    state = get_state(request)
    ids = await _chosen(state, queue, body)
    return CountReply(count=await state.store.purge_ids(queue, "dead", ids))
