"""One job's hold on one of a dispatch worker's `concurrency` slots (see docs/explanation/architecture.md, *Slots*)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from offload.models import ClaimedJob


class SlotOwner(Protocol):
    def _take_free(self, job: ClaimedJob) -> bool: ...

    async def _enter_remote(self, job: ClaimedJob) -> None: ...

    def _leave_remote(self, job: ClaimedJob) -> None: ...


class Slot:
    """One job's hold on one of the worker's `concurrency` slots: taken at most once, at the job's first remote
    step, and given back once when its remote work ends (or it ends before any)."""

    __slots__ = ("_job", "_path", "held")

    def __init__(self, path: SlotOwner, job: ClaimedJob) -> None:
        self._path, self._job, self.held = path, job, False

    def take_now(self) -> bool:
        """Whether the slot is held now, taking a free one if need be: no coroutine on the common path (a worker
        with room), as `if not slot.take_now(): await slot.take()`. Two coroutines less per job than `take`
        alone (creating and running a coroutine costs ~0.2 us in 3.11; bench/worker_throughput.py's no-op jobs
        lost ~12 % of their rate to 3 us more Python per job)."""
        if not self.held:
            self.held = self._path._take_free(self._job)
        return self.held

    async def take(self) -> None:
        if not self.held:
            await self._path._enter_remote(self._job)
            self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self._path._leave_remote(self._job)


class SlotPool:
    """The worker's `concurrency` slots: a first-come first-served counting semaphore. Not asyncio.Semaphore,
    whose `acquire` (3.11) first asks `locked()`, which scans every waiter: with the jobs claimed ahead waiting
    there, each job paid a scan of them (measured in bench/worker_throughput.py's no-op run: ~3 % of the worker's
    time in `locked`). Invariant: a slot is free only while nobody waits (`release` hands it over first)."""

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
