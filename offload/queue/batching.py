"""Coalesce the per-job store calls of thousands of concurrent job tasks into a few batched calls.

With 10,000 jobs in flight, one round trip per checkpoint, cap reservation or ack costs more than the Redis work
itself: every call waits for a pooled connection and an event-loop pass, and checkpoints crawl behind the tasks
(docs/explanation/performance.md, *Batched store calls*). A `Batcher`
lets each task await its own result while one flusher sends whatever has queued up as a single script call.
Under light load a batch is one item and costs what a direct call costs: nothing waits for a batch to fill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

Flush = Callable[[list[T]], Awaitable[Sequence[R]]]


class Batcher(Generic[T, R]):
    """`await batcher(item)` returns that item's result from `flush(items)`, which answers items in order.
    At most `concurrency` flushes run at once; a flush that raises fails every caller of its batch."""

    def __init__(self, flush: Flush[T, R], *, max_batch: int = 1000, concurrency: int = 2) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._tasks: set[asyncio.Task[None]] = set()  # referenced, so a running flush is never collected
        # Counted down by the flusher itself the moment it sees nothing pending, not by a done-callback: a
        # caller resumed by the last flush may call again before such a callback runs, and must then start a
        # new flusher instead of queueing behind one that has already ended.
        self._active = 0
        self._concurrency = concurrency

    def __call__(self, item: T) -> asyncio.Future[R]:
        """The item's result, to await. A future, not a coroutine: one coroutine less per call on the hot path
        (awaiting the future directly is the same to the caller, a cancel included)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, future))
        if self._active < self._concurrency:
            self._active += 1
            task = loop.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    async def _drain(self) -> None:
        try:
            await self._flush_pending()
        finally:
            self._active -= 1

    async def _flush_pending(self) -> None:
        await asyncio.sleep(0)  # let the tasks woken with this one queue their items first
        while self._pending:
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
            live = [(item, fut) for item, fut in batch if not fut.done()]  # skip callers that gave up
            if not live:
                continue
            try:
                results = await self._flush([item for item, _ in live])
            except Exception as exc:  # the callers decide what a failed call means for their job
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            except BaseException:
                for _, fut in live:
                    fut.cancel()
                raise
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
