"""A fault loop beside the schedule's own (faults.py): the hostile clients (hostile.py) and the server's deploys
(hooks.Deploys), which need the run's server. Each action runs as a task of its own, every `every` s (mean, drawn
from the schedule's seeded stream); `stop` ends the loop and waits for the actions under way: a trickled body ends
by itself, and a restart must not leave the server down for the settle phase."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.chaos.faults import Schedule

log = logging.getLogger("chaos")


class FaultLoop:
    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()

    def start(self, every: float) -> None:
        self._task = asyncio.create_task(self._every(every))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._pending, return_exceptions=True)

    async def act(self) -> None:
        raise NotImplementedError

    async def _every(self, mean: float) -> None:
        while True:
            await asyncio.sleep(mean * self.schedule.rng.uniform(0.5, 1.5))
            task = asyncio.create_task(self.act())
            self._pending.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        """An action that failed (a hostile client that found no server) is said once, not left for asyncio's
        "Task exception was never retrieved" at garbage collection."""
        self._pending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("%s: an action failed: %s: %s", type(self).__name__, type(exc).__name__, exc)
