"""The dispatch worker's `concurrency` slots, one per job at the provider (see docs/explanation/architecture.md,
*Slots*): the pool, the count of jobs in flight, and each job's hold on one."""

from __future__ import annotations

import asyncio
from collections import deque

from offload.worker.context import WorkerContext
from offload.worker.job_run import JobRun
from offload.worker.prefetch import Prefetch


class Slots:
    """The slots and what follows from them: jobs in flight (and the peak), the pace the prefetch reads, and
    `room`, set whenever a job leaves its slot or its task ends (the claim loop waits for it)."""

    def __init__(self, ctx: WorkerContext, prefetch: Prefetch) -> None:
        self.ctx, self.prefetch = ctx, prefetch
        self.pool = SlotPool(ctx.options.concurrency)
        self.in_flight = 0
        self.peak_in_flight = 0  # the most remote jobs at once (slots taken), at most `concurrency`
        self.room = asyncio.Event()

    def take_free(self) -> bool:
        """A slot now, if one is free; False, taking nothing, if the job must wait."""
        if not self.pool.try_take():
            return False
        self._entered()
        return True

    async def enter(self, run: JobRun) -> None:
        """Take a slot: at most `concurrency` jobs are past this point (submitting, at the provider, polled). A
        job that must wait is one of the jobs ahead (a drain cancels those at once)."""
        if self.take_free():
            return
        await self.ctx.wait_ahead(run.job, self.pool.acquire())
        self._entered()

    def _entered(self) -> None:
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight = self.in_flight

    def leave(self, run: JobRun) -> None:
        self.in_flight -= 1
        self.pool.release()
        self.prefetch.left()
        self.ctx.runs.mark_past(run)
        self.room.set()

    def to_claim(self) -> int:
        """Jobs to claim now. Up to `leased_max` jobs that are before or in their remote work (prefetch.py: how
        many ahead of the slots); the ones past it (storing an output, acking: a round trip or two) do not hold
        back the next claim, but they have an allowance of their own, `concurrency`, so that a storage outage
        stops the claiming (and paying) soon. Jobs waiting in provider batches count in neither."""
        runs = self.ctx.runs
        most = self.prefetch.leased_max()
        held = len(runs) - runs.batched  # jobs in batches have a pool of their own (worker/packing.py)
        return min(most - (held - runs.past), most + self.ctx.options.concurrency - held)


class Slot:
    """One job's hold on one of the worker's `concurrency` slots: taken at most once, at the job's first remote
    step, and given back once when its remote work ends (or it ends before any)."""

    __slots__ = ("_run", "_slots", "held")

    def __init__(self, slots: Slots, run: JobRun) -> None:
        self._slots, self._run, self.held = slots, run, False

    def take_now(self) -> bool:
        """Whether the slot is held now, taking a free one if need be: no coroutine on the common path (a worker
        with room), as `if not slot.take_now(): await slot.take()` (see docs/explanation/performance.md)."""
        if not self.held:
            self.held = self._slots.take_free()
        return self.held

    async def take(self) -> None:
        if not self.held:
            await self._slots.enter(self._run)
            self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self._slots.leave(self._run)


class SlotPool:
    """The worker's `concurrency` slots: a first-come first-served counting semaphore. Not asyncio.Semaphore,
    whose `acquire` scans every waiter, the jobs claimed ahead included (see docs/explanation/performance.md).
    Invariant: a slot is free only while nobody waits (`release` hands it over first)."""

    __slots__ = ("_free", "_waiters")

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        """A slot now if one is free (no waiting, no coroutine: the common path of a worker with room)."""
        if self._free > 0:
            self._free -= 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_take():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot, then cancelled: it goes to the next
                self.release()
            raise  # (a cancelled waiter stays queued: `release` skips it)

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1
