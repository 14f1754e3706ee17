"""History routes: a queue's counts, percentiles, spend and gauges over the last hour, day or week, and the same
summed over every queue the key may read (offload/queue/history.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Request

from offload.queue import history
from offload.server.auth import GuardedRoute, Principal, can_read, need_read
from offload.server.routes_jobs import require_queue
from offload.server.schemas import HistoryPointView, HistoryReply
from offload.server.state import ServerState, get_state

router = APIRouter(tags=["queues"], route_class=GuardedRoute)
Range = Literal["hour", "day", "week"]
RangeQ = Annotated[
    Range, Query(alias="range", description="hour: 60 one-minute points; day: 24 hourly; week: 168 hourly.")
]


def _view(p: history.HistoryPoint) -> HistoryPointView:
    return HistoryPointView.model_validate(p.to_dict())


async def _reply(state: ServerState, queues: list[str], range_name: Range, one: str | None) -> HistoryReply:
    step, points = await state.store.history(queues, range_name)  # the store's clock names the buckets
    return HistoryReply(queue=one, range=range_name, step_s=step, points=[_view(p) for p in points])


@router.get(
    "/v1/queues/{queue}/history",
    response_model=HistoryReply,
    summary="A queue's history: counts, wait and run percentiles, spend and gauges per minute or hour",
)
async def queue_history(request: Request, queue: str, key: Principal, span: RangeQ = "hour") -> HistoryReply:
    need_read(key, queue)
    state = get_state(request)
    await require_queue(state, queue)
    return await _reply(state, [queue], span, queue)


@router.get(
    "/v1/history",
    response_model=HistoryReply,
    summary="The history summed over every queue the key may read",
)
async def all_history(request: Request, key: Principal, span: RangeQ = "hour") -> HistoryReply:
    state = get_state(request)
    names = sorted(set(await state.store.queues()) | set(state.options.settings.queues))
    visible = [q for q in names if can_read(key, q)]
    if not visible and key.scope == "worker":
        raise HTTPException(403, "a worker key may not read queues")
    return await _reply(state, visible, span, None)
