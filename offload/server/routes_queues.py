"""Queue routes: stats with rates, pause/resume/purge, and the dead-letter and held sets."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request

from offload.autoscale.fleet_idle import with_fleet_idle
from offload.caps import cap_reached
from offload.queue.keyspace import STATE_SETS
from offload.server.auth import GuardedRoute, Principal, admin_only, can_read, guard, need_admin, need_read
from offload.server.errors import FieldError
from offload.server.routes_jobs import page, require_queue
from offload.server.schemas import CountReply, JobPage, MoveReply, MoveRequest, PurgeRequest, QueueView
from offload.server.state import ServerState, get_state

router = APIRouter(tags=["queues"], route_class=GuardedRoute)
CursorQ = Annotated[str | None, Query(max_length=15, pattern=r"^\d+$")]
LimitQ = Annotated[int, Query(ge=1, le=1000)]
MOVE_BATCH = 1000


async def queue_view(state: ServerState, queue: str) -> QueueView:
    stats = await state.store.stats(queue)
    capped = await cap_reached(state.store, queue, state.options.settings.cap_limits(queue))
    stats = await with_fleet_idle(state.redis, dataclasses.replace(stats, capped=capped))
    state.rates.observe(queue, stats.totals)
    rates, window = state.rates.rates(queue)
    return QueueView(**stats.to_dict(), rates=rates, rate_window_s=window)


@router.get("/v1/queues", response_model=list[QueueView], summary="Every queue the key may read, with stats")
async def list_queues(request: Request, key: Principal) -> list[QueueView]:
    state = get_state(request)
    names = sorted(set(await state.store.queues()) | set(state.options.settings.queues))
    visible = [q for q in names if can_read(key, q)]
    if not visible and key.scope == "worker":
        raise HTTPException(403, "a worker key may not read queues")
    return list(await asyncio.gather(*(queue_view(state, q) for q in visible)))


@router.get("/v1/queues/{queue}", response_model=QueueView, summary="One queue's counts, totals and rates")
async def get_queue(request: Request, queue: str, key: Principal) -> QueueView:
    need_read(key, queue)
    state = get_state(request)
    await require_queue(state, queue)
    return await queue_view(state, queue)


@router.post("/v1/queues/{queue}/pause", response_model=QueueView, summary="Stop claims (enqueue still works)")
async def pause(request: Request, queue: str, key: Principal) -> QueueView:
    need_admin(key, "pause queues")
    state = get_state(request)
    await state.store.pause(queue)  # also a queue that has no jobs yet: it is listed from now on
    return await queue_view(state, queue)


@router.post("/v1/queues/{queue}/resume", response_model=QueueView, summary="Let workers claim again")
async def resume(request: Request, queue: str, key: Principal) -> QueueView:
    need_admin(key, "resume queues")
    state = get_state(request)
    await require_queue(state, queue)
    await state.store.resume(queue)
    return await queue_view(state, queue)


@router.post("/v1/queues/{queue}/purge", response_model=CountReply, summary="Delete every job in one state")
@guard(admin_only("purge queues"))
async def purge(request: Request, queue: str, body: PurgeRequest, key: Principal) -> CountReply:
    state = get_state(request)
    await require_queue(state, queue)
    if body.state not in STATE_SETS or body.state == "active":
        allowed = ", ".join(s for s in STATE_SETS if s != "active")
        raise FieldError(["body", "state"], f"cannot purge state {body.state!r}; choose one of: {allowed}")
    return CountReply(count=await state.store.purge(queue, body.state))


async def _move(state: ServerState, queue: str, source: str, body: MoveRequest) -> MoveReply:
    """`all` is bounded by the set's size at the start, so jobs that fail straight back cannot loop it."""
    if bool(body.ids) == body.all:
        raise FieldError(["body"], "give ids or all=true (not both)")
    await require_queue(state, queue)
    move = state.store.requeue_dead if source == "dead" else state.store.release
    if body.ids:
        return MoveReply(moved=await move(queue, body.ids))
    budget = (await state.store.stats(queue)).counts[source]
    moved: list[str] = []
    while len(moved) < budget:
        batch = await move(queue, limit=min(MOVE_BATCH, budget - len(moved)))
        if not batch:
            break
        moved += batch
    return MoveReply(moved=moved)


@router.get("/v1/queues/{queue}/dead", response_model=JobPage, summary="Dead-lettered jobs, newest first")
async def dead_list(
    request: Request, queue: str, key: Principal, cursor: CursorQ = None, limit: LimitQ = 50
) -> JobPage:
    need_read(key, queue)
    return await page(get_state(request), queue, "dead", cursor, limit)


@router.post(
    "/v1/queues/{queue}/dead/requeue",
    response_model=MoveReply,
    summary="Dead jobs back to ready with a fresh attempt budget",
)
@guard(admin_only("requeue dead jobs"), big_body=True)  # up to 10,000 ids
async def dead_requeue(request: Request, queue: str, body: MoveRequest, key: Principal) -> MoveReply:
    return await _move(get_state(request), queue, "dead", body)


@router.post("/v1/queues/{queue}/dead/purge", response_model=CountReply, summary="Delete every dead job")
async def dead_purge(request: Request, queue: str, key: Principal) -> CountReply:
    need_admin(key, "purge dead jobs")
    state = get_state(request)
    await require_queue(state, queue)
    return CountReply(count=await state.store.purge(queue, "dead"))


@router.get("/v1/queues/{queue}/held", response_model=JobPage, summary="Jobs held over a cap, oldest first")
async def held_list(
    request: Request, queue: str, key: Principal, cursor: CursorQ = None, limit: LimitQ = 50
) -> JobPage:
    need_read(key, queue)
    return await page(get_state(request), queue, "held", cursor, limit)


@router.post(
    "/v1/queues/{queue}/held/release",
    response_model=MoveReply,
    summary="Held jobs back to ready now, before their cap window resets",
)
@guard(admin_only("release held jobs"), big_body=True)
async def held_release(request: Request, queue: str, body: MoveRequest, key: Principal) -> MoveReply:
    return await _move(get_state(request), queue, "held", body)
