"""Job state changes, live: one reader per process multiplexes the event streams of every queue anyone in the
process follows (SSE clients, long-polling waits and claims) in one XREAD, and fans them out.

One reader matters because a blocking XREAD holds a Redis connection for its whole block: a reader per queue
(or per request) would exhaust the connection pool as soon as a few streams follow many queues, or a few
hundred GPU workers long-poll at once, and every other call would queue behind them. On a Redis Cluster, where
one XREAD cannot span slots, the reader polls each slot's streams without blocking instead.
Subscribers get bounded queues; one that falls behind gets a `resync` marker instead of unbounded memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from offload.access.api_keys import ApiKey
from offload.eventloop import within
from offload.queue import keyspace
from offload.queue.keyspace import validate_queue
from offload.queue.store import QueueStore
from offload.server.auth import GuardedRoute, Principal, can_read, guard, need_read
from offload.server.errors import FieldError
from offload.server.state import get_state

log = logging.getLogger("offload.server")
Event = tuple[str, str, dict[str, str]]  # (queue, stream id, fields)
RESYNC: Event = ("", "", {"state": "resync"})
STOPPING: Event = ("", "", {"state": "stopping"})  # wakes a waiting subscriber at the server's stop (never sent)
SUBSCRIBER_BUFFER = 1000
FOLLOW_INTERVAL_S = 2.0
CLUSTER_POLL_S = 0.25
START_WAIT_S = 5.0  # how long a new stream waits for its start ids before it says `connected`


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
        """The next event; None at the timeout, and at once once the server stops (`EventHub.stop_waits`)."""
        if self.hub.stopping:
            return None
        try:
            event = await within(self.inbox.get(), timeout)
        except TimeoutError:
            return None
        return None if event is STOPPING else event

    def close(self) -> None:
        self.hub._unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventHub:
    def __init__(self, store: QueueStore, block_ms: int = 250) -> None:
        self.store = store
        self.block_ms = block_ms
        self._subs: dict[str, set[Subscription]] = {}
        self._last: dict[str, str] = {}  # per followed queue: the last stream id read
        self._reader: asyncio.Task[None] | None = None
        self._starting: dict[str, asyncio.Task[None]] = {}  # per newly followed queue: its start-id lookup
        self._closed = False
        self._stop = asyncio.Event()
        self.reads = 0  # XREAD calls made (tests count them)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop_waits(self) -> None:
        """The server stops: every long poll and event stream answers now (no job, timed out, the stream's end;
        clients come back to the next server by design) instead of being cancelled at the end of uvicorn's
        grace, a claim perhaps between taking jobs and answering with them."""
        self._stop.set()
        for sub in {sub for subs in self._subs.values() for sub in subs}:
            with contextlib.suppress(asyncio.QueueFull):  # a full inbox wakes it anyway
                sub.inbox.put_nowait(STOPPING)

    async def pause(self, seconds: float) -> None:
        """Sleep `seconds`, or until the server stops."""
        with contextlib.suppress(TimeoutError):
            await within(self._stop.wait(), seconds)

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
        fresh = queue not in self._subs
        self._subs.setdefault(queue, set()).add(sub)
        if self._closed:
            return
        if fresh:  # where it starts, fixed by this lookup: events after it are not lost (see `started`)
            task = asyncio.create_task(self._start_ids([queue]))
            self._starting[queue] = task
            task.add_done_callback(functools.partial(self._started_one, queue))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(), name="events")

    def _started_one(self, queue: str, task: asyncio.Task[None]) -> None:
        if self._starting.get(queue) is task:
            del self._starting[queue]

    async def started(self, sub: Subscription) -> None:
        """Wait until every queue of `sub` has its start fixed (at most START_WAIT_S: a Redis blip leaves it to the
        reader). A stream says `connected` only then: a client that acts on it (enqueues, say) must see the events
        that follow. Before, `connected` went out while the start was still being looked up, and an event written
        in between was skipped (seen under load: the SSE test's one event, lost)."""
        pending = [task for q in sub.queues if (task := self._starting.get(q)) is not None]
        if pending:
            await asyncio.wait(pending, timeout=START_WAIT_S)

    def _unsubscribe(self, sub: Subscription) -> None:
        for q in sub.queues:
            subs = self._subs.get(q)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[q]
                    self._last.pop(q, None)

    async def last_id(self, queue: str) -> str:
        newest = await self.store.redis.xrevrange(keyspace.events(queue), count=1)
        return str(newest[0][0]) if newest else "0-0"

    async def _start_ids(self, queues: list[str]) -> None:
        """Where newly followed queues start: their newest entry now (history is replayed by `_stream`)."""
        try:
            ids = await asyncio.gather(*(self.last_id(q) for q in queues))
        except Exception as exc:  # the reader resolves it on its next pass
            log.debug("event start ids: %s", type(exc).__name__)
            return
        for q, i in zip(queues, ids, strict=True):
            if q in self._subs:
                self._last.setdefault(q, i)

    async def _read(self) -> None:
        cluster = isinstance(self.store.redis, RedisCluster)
        while self._subs and not self._closed:
            try:
                if fresh := [q for q in self._subs if q not in self._last]:
                    await self._start_ids(fresh)
                streams = {keyspace.events(q): i for q, i in self._last.items() if q in self._subs}
                self.reads += 1
                replies = await (self._read_cluster(streams) if cluster else self._read_one(streams))
            except Exception as exc:  # Redis blip: subscribers time out and re-read; keep trying
                if self._closed:  # a cancel that redis-py turned into a timeout error
                    return
                log.warning("event reader: %s", type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            for key, entries in replies:
                queue = key.split("{", 1)[1].rsplit("}", 1)[0]
                for eid, fields in entries:
                    if queue in self._last:
                        self._last[queue] = eid
                    for sub in list(self._subs.get(queue, ())):
                        sub.push((queue, eid, fields))

    async def _read_one(self, streams: dict[str, str]) -> list[Any]:
        reply = await self.store.redis.xread(streams, count=500, block=self.block_ms)
        return list(reply.items()) if isinstance(reply, dict) else [(k, e) for k, e in reply or []]

    async def _read_cluster(self, streams: dict[str, str]) -> list[Any]:
        """One XREAD per slot, none of them blocking (a cluster XREAD cannot span slots)."""
        redis = self.store.redis
        by_slot: dict[int, dict[str, str]] = {}
        for key, last in streams.items():
            by_slot.setdefault(key_slot(key.encode()), {})[key] = last
        found: list[Any] = []
        for reply in await asyncio.gather(*(redis.xread(s, count=500) for s in by_slot.values())):
            found += list(reply.items()) if isinstance(reply, dict) else list(reply or [])
        if not any(entries for _, entries in found):
            await asyncio.sleep(CLUSTER_POLL_S)
        return found

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._starting.values()):
            task.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None


def event_doc(event: Event) -> dict[str, Any]:
    queue, eid, fields = event
    jobs = fields.get("jobs", "")
    doc = {
        "queue": queue,
        "state": fields.get("state"),
        "jobs": jobs.split() if jobs else [],
        "at": _sid(eid)[0] if eid else None,
    }
    if "why" in fields:  # a `routed` entry: the backend a submission went to, and why (begin.lua)
        doc["backend"], doc["why"] = fields.get("backend"), fields["why"]
    return doc


def _frame(event: Event) -> bytes:
    _, eid, _ = event
    kind = "resync" if event is RESYNC else "jobs"
    head = f"id: {eid}\n" if eid else ""
    return f"{head}event: {kind}\ndata: ".encode() + orjson.dumps(event_doc(event)) + b"\n\n"


router = APIRouter(tags=["events"], route_class=GuardedRoute)


async def _stream(
    request: Request, key: ApiKey, queues: list[str], since: str | None, follow: bool = False
) -> AsyncIterator[bytes]:
    """`follow`: an all-queues stream, which also picks up queues created later that this key may read (up to
    the server's max_stream_queues). The key is re-checked every key_recheck_s: revoked, the stream ends."""
    state = get_state(request)
    opts = state.options
    keepalive = opts.sse_keepalive_s
    tick = min(keepalive, opts.key_recheck_s, FOLLOW_INTERVAL_S if follow else keepalive)
    quiet_since = recheck_at = time.monotonic()
    with state.hub.subscribe(queues) as sub:
        await state.hub.started(sub)
        yield b": connected\n\n"
        floor = (0, 0)
        if since is not None and len(queues) == 1:  # replay what the client missed, then go live
            backlog = await state.redis.xrange(keyspace.events(queues[0]), f"({since}", "+", count=10_000)
            for eid, fields in backlog:
                floor = _sid(eid)
                yield _frame((queues[0], eid, fields))
        while True:
            if time.monotonic() - recheck_at >= opts.key_recheck_s:
                recheck_at = time.monotonic()
                if not await state.keys.alive(key):
                    yield b"event: revoked\ndata: {}\n\n"
                    return
            event = await sub.next(tick)
            if event is None:
                if state.hub.stopping or await request.is_disconnected():
                    return
                if follow:
                    for q in await state.store.queues():
                        if len(sub.queues) >= opts.max_stream_queues:
                            break
                        if can_read(key, q):
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
@guard(stream=True)
async def all_events(
    request: Request,
    key: Principal,
    queue: Annotated[
        list[str] | None,
        Query(description="Only these queues (repeatable; known queues, at most the server's max_stream_queues)."),
    ] = None,
) -> StreamingResponse:
    state = get_state(request)
    limit = state.options.max_stream_queues
    if not queue:
        if key.scope == "worker":
            raise HTTPException(403, "a worker key may not read events")
        visible = [q for q in await state.store.queues() if can_read(key, q)][:limit]
        return _sse(_stream(request, key, visible, None, follow=True))
    wanted = list(dict.fromkeys(queue))
    if len(wanted) > limit:
        raise FieldError(["query", "queue"], f"{len(wanted)} queues: one stream follows at most {limit}")
    for q in wanted:
        validate_queue(q)
        need_read(key, q)
    for q in wanted:
        if not await state.known_queue(q):
            raise HTTPException(404, f"unknown queue {q!r}")
    return _sse(_stream(request, key, wanted, None))


@router.get("/v1/queues/{queue}/events", summary="Server-sent events of one queue (resumable: Last-Event-ID)")
@guard(stream=True)
async def queue_events(
    request: Request,
    queue: str,
    key: Principal,
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
    return _sse(_stream(request, key, [queue], since))
