"""The states a command may name (to list, to purge), and which job ids a listing shows: one state's set in its
own order, the submitted jobs, or every state newest first.

A state's set is read a page at a time (ZRANGE by index). Submitted jobs are active jobs also named in a plain set
(no order of its own): few by nature (bounded by the queues' submit concurrency), they are read whole and shown
oldest first by id. No index orders a queue's jobs by creation across states, so the all-states listing reads every
id and its `created_at` in chunks (one script call per chunk, created.lua: Redis never works on more than a chunk at
once) and keeps only the page's worth of newest ones: time grows with the queue (docs/explanation/performance.md,
*Listing jobs*), memory with the page.
"""

from __future__ import annotations

import heapq

from offload.errors import InvalidJob
from offload.queue import keyspace
from offload.queue.keyspace import STATE_SETS, validate_queue
from offload.queue.scripts import SCRIPTS
from offload.redis_client import RedisClient

#: The states `offload jobs --state` and the API accept: a set each, plus `submitted` (active jobs already sent).
LISTABLE_STATES: tuple[str, ...] = (*STATE_SETS, "submitted")
NEWEST_FIRST = frozenset({"succeeded", "dead", "cancelled"})
SCAN_CHUNK = 2_000

Page = tuple[list[str], int | None]  # ids, and the next page's cursor (None: this was the last page)


def check_state(state: str | None) -> None:
    if state is not None and state not in LISTABLE_STATES:
        raise InvalidJob(f"unknown state {state!r}; choose one of: {', '.join(LISTABLE_STATES)}")


def check_purgeable(state: str) -> None:
    """Every set but `active`: a job there is held by a worker, which would go on running it."""
    if state not in STATE_SETS or state == "active":
        allowed = ", ".join(s for s in STATE_SETS if s != "active")
        raise InvalidJob(f"cannot purge state {state!r}; choose one of: {allowed}")


async def page_ids(redis: RedisClient, queue: str, state: str | None, cursor: int, limit: int) -> Page:
    """The ids of one page: `state` None means every state, newest first."""
    check_state(state)
    validate_queue(queue)
    if state is None:
        return await _newest(redis, queue, cursor, limit)
    if state == "submitted":
        ids = sorted(await redis.smembers(keyspace.submitted(queue)))[cursor : cursor + limit + 1]
        return ids[:limit], cursor + limit if len(ids) > limit else None
    ids = await redis.zrange(keyspace.state_set(queue, state), cursor, cursor + limit - 1, desc=state in NEWEST_FIRST)
    return ids, cursor + limit if len(ids) == limit else None


async def _newest(redis: RedisClient, queue: str, cursor: int, limit: int) -> Page:
    keep = cursor + limit + 1  # one more than the page says whether another follows
    best: list[tuple[float, str]] = []  # a min-heap of (created_at, id): the `keep` newest seen so far
    seen: set[str] = set()  # a job that moved sets between two reads is counted once
    for state in STATE_SETS:
        start = 0
        while True:
            read, flat = await SCRIPTS.created(
                redis, [keyspace.prefix(queue)], ["", STATE_SETS[state], start, SCAN_CHUNK]
            )
            start += int(read)
            for job_id, created in zip(flat[::2], flat[1::2], strict=True):
                if job_id in seen:
                    continue
                seen.add(job_id)
                heapq.heappush(best, (float(created), job_id))
                if len(best) > keep:
                    seen.discard(heapq.heappop(best)[1])
            if int(read) < SCAN_CHUNK:
                break
    ordered = [job_id for _, job_id in sorted(best, reverse=True)][cursor:]
    return ordered[:limit], cursor + limit if len(ordered) > limit else None
