"""The worker's call coalescer, on a real event loop: results per caller, batching under load, failures."""

from __future__ import annotations

import asyncio

import pytest

from offload.eventloop import within
from offload.queue.batching import Batcher


async def test_each_caller_gets_its_own_result_and_concurrent_calls_share_a_flush() -> None:
    batches: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        batches.append(items)
        await asyncio.sleep(0)  # a round trip: more callers queue up meanwhile
        return [n * 10 for n in items]

    batcher: Batcher[int, int] = Batcher(flush, max_batch=100, concurrency=1)
    results = await asyncio.gather(*(batcher(n) for n in range(1000)))
    assert results == [n * 10 for n in range(1000)]
    assert sorted(n for b in batches for n in b) == list(range(1000))  # every item flushed exactly once
    assert len(batches) <= 12, len(batches)  # 1000 callers, batches of at most 100: about ten calls
    assert max(len(b) for b in batches) == 100


async def test_a_lone_call_is_flushed_at_once() -> None:
    batcher: Batcher[str, str] = Batcher(lambda items: _echo(items))
    assert await within(batcher("x"), 10) == "x!"


async def _echo(items: list[str]) -> list[str]:
    return [i + "!" for i in items]


async def test_a_failed_flush_fails_its_callers_and_the_next_batch_still_runs() -> None:
    calls = 0

    async def flush(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("redis went away")
        return items

    batcher: Batcher[int, int] = Batcher(flush, concurrency=1)
    first = await asyncio.gather(batcher(1), batcher(2), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in first), first
    assert await batcher(3) == 3


async def test_a_cancelled_caller_is_skipped_and_the_others_are_answered() -> None:
    gate, started = asyncio.Event(), asyncio.Event()
    seen: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        seen.append(items)
        started.set()
        await gate.wait()
        return items

    batcher: Batcher[int, int] = Batcher(flush, concurrency=1)
    blocking = asyncio.ensure_future(batcher(0))  # occupies the only flusher
    await within(started.wait(), 10)
    doomed = asyncio.ensure_future(batcher(1))
    kept = asyncio.ensure_future(batcher(2))
    await asyncio.sleep(0)
    doomed.cancel()
    gate.set()
    assert await within(kept, 10) == 2
    assert await blocking == 0
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert seen == [[0], [2]]


async def test_a_caller_arriving_as_the_flusher_finishes_is_still_flushed() -> None:
    """The caller woken by a flush calls again before the finished flusher's task is reaped: its item must
    start a new flush instead of waiting forever for one that has already ended."""

    async def flush(items: list[int]) -> list[int]:
        return items  # answers without yielding: the caller resumes before the flusher task is cleaned up

    batcher: Batcher[int, int] = Batcher(flush, concurrency=1)

    async def caller() -> list[int]:
        return [await batcher(n) for n in range(5)]  # awaited directly: resumed in the flush's own pass

    assert await within(caller(), 10) == list(range(5))
