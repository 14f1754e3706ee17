"""Job state changes, live: one reader per queue per process fans the queue's event stream out to every
subscriber (SSE clients, long-polling waits and claims).

One shared reader matters because a blocking XREAD holds a Redis connection for its whole block: a reader per
waiting HTTP request would exhaust the connection pool as soon as a few hundred GPU workers long-poll at once.
Subscribers get bounded queues; one that falls behind gets a `resync` marker instead of unbounded memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from offload.queue.keys import prefix, validate_queue
from offload.queue.store import QueueStore
from offload.server.auth import Principal, can_read, need_read
from offload.server.keys import ApiKey
from offload.server.state import get_state

log = logging.getLogger("offload.server")
Event = tuple[str, str, dict[str, str]]  # (queue, stream id, fields)
RESYNC: Event = ("", "", {"state": "resync"})
SUBSCRIBER_BUFFER = 1000
FOLLOW_INTERVAL_S = 2.0


def _sid(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    def __init__(self, hub: EventHub, queues: list[str]) -> None:
        self.hub, self.queues = hub, queues
        self.inbox: asyncio.Queue[Event] = asyncio.Queue(SUBSCRIBER_BUFFER)

    def push(self, event: Event) -> None:
        try:
            self.inbox.put_nowait(event)
        except asyncio.QueueFull:  # a slow reader: drop the backlog, tell it to re-read state
            while not self.inbox.empty():
                self.inbox.get_nowait()
            self.inbox.put_nowait(RESYNC)

    async def next(self, timeout: float) -> Event | None:
        try:
            return await asyncio.wait_for(self.inbox.get(), timeout)
        except TimeoutError:
            return None

    def close(self) -> None:
        self.hub._unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventHub:
    def __init__(self, store: QueueStore, block_ms: int = 1000) -> None:
        self.store = store
        self.block_ms = block_ms
        self._subs: dict[str, set[Subscription]] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    def subscribe(self, queues: list[str]) -> Subscription:
        sub = Subscription(self, [])
        for q in queues:
            self.add(sub, q)
        return sub

    def add(self, sub: Subscription, queue: str) -> None:
        """Also follow `queue` (a queue created after an all-queues stream started)."""
        if queue in sub.queues:
            return
        sub.queues.append(queue)
        self._subs.setdefault(queue, set()).add(sub)
        if queue not in self._readers or self._readers[queue].done():
            self._readers[queue] = asyncio.create_task(self._read(queue), name=f"events:{queue}")

    def _unsubscribe(self, sub: Subscription) -> None:
        for q in sub.queues:
            subs = self._subs.get(q)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[q]
                    task = self._readers.pop(q, None)
                    if task:
                        task.cancel()

    async def last_id(self, queue: str) -> str:
        newest = await self.store.redis.xrevrange(prefix(queue) + "events", count=1)
        return str(newest[0][0]) if newest else "0-0"

    async def _read(self, queue: str) -> None:
        last = await self.last_id(queue)
        while self._subs.get(queue) and not self._closed:
            try:
                entries = await self.store.events(queue, last, block_ms=self.block_ms, count=500)
            except Exception as exc:  # Redis blip: subscribers time out and re-read; keep trying
                if self._closed:  # a cancel that redis-py turned into a timeout error
                    return
                log.warning("event reader for %s: %s", queue, type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            for eid, fields in entries:
                last = eid
                for sub in list(self._subs.get(queue, ())):
                    sub.push((queue, eid, fields))

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._readers.values())
        self._readers.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def event_doc(event: Event) -> dict[str, Any]:
    queue, eid, fields = event
    jobs = fields.get("jobs", "")
    return {"queue": queue, "state": fields.get("state"), "jobs": jobs.split() if jobs else [],
            "at": _sid(eid)[0] if eid else None}


def _frame(event: Event) -> bytes:
    _, eid, _ = event
    kind = "resync" if event is RESYNC else "jobs"
    head = f"id: {eid}\n" if eid else ""
    return f"{head}event: {kind}\ndata: ".encode() + orjson.dumps(event_doc(event)) + b"\n\n"


router = APIRouter(tags=["events"])


async def _stream(request: Request, queues: list[str], since: str | None,
                  follow: ApiKey | None = None) -> AsyncIterator[bytes]:
    """`follow`: an all-queues stream, which also picks up queues created later that this key may read."""
    state = get_state(request)
    keepalive = state.options.sse_keepalive_s
    tick = min(keepalive, FOLLOW_INTERVAL_S) if follow else keepalive
    quiet_since = time.monotonic()
    with state.hub.subscribe(queues) as sub:
        yield b": connected\n\n"
        floor = (0, 0)
        if since is not None and len(queues) == 1:  # replay what the client missed, then go live
            backlog = await state.redis.xrange(prefix(queues[0]) + "events", f"({since}", "+", count=10_000)
            for eid, fields in backlog:
                floor = _sid(eid)
                yield _frame((queues[0], eid, fields))
        while True:
            event = await sub.next(tick)
            if event is None:
                if await request.is_disconnected():
                    return
                if follow is not None:
                    for q in await state.store.queues():
                        if can_read(follow, q):
                            state.hub.add(sub, q)
                if time.monotonic() - quiet_since >= keepalive:
                    quiet_since = time.monotonic()
                    yield b": keepalive\n\n"
            elif event is RESYNC or _sid(event[1]) > floor:
                quiet_since = time.monotonic()
                yield _frame(event)


def _sse(gen: AsyncIterator[bytes]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(gen, media_type="text/event-stream", headers=headers)


@router.get("/v1/events", summary="Server-sent events of job state changes on every queue the key may read")
async def all_events(
    request: Request, key: Principal,
    queue: Annotated[list[str] | None, Query(description="Only these queues (repeatable).")] = None,
) -> StreamingResponse:
    state = get_state(request)
    wanted = queue or await state.store.queues()
    for q in wanted:
        validate_queue(q)
        if queue:
            need_read(key, q)
    visible = [q for q in wanted if can_read(key, q)]
    if not queue and key.scope == "worker":
        raise HTTPException(403, "a worker key may not read events")
    return _sse(_stream(request, visible, None, follow=None if queue else key))


@router.get("/v1/queues/{queue}/events", summary="Server-sent events of one queue (resumable: Last-Event-ID)")
async def queue_events(
    request: Request, queue: str, key: Principal,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    need_read(key, queue)
    state = get_state(request)
    if not await state.known_queue(queue):
        raise HTTPException(404, f"unknown queue {queue!r}")
    since = None
    if last_event_id:
        with contextlib.suppress(ValueError):
            _sid(last_event_id)
            since = last_event_id
    return _sse(_stream(request, [queue], since))
