"""One job's hold on one of a dispatch worker's `concurrency` slots (see docs/architecture.md, *Slots*)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from offload.models import ClaimedJob


class SlotOwner(Protocol):
    async def _enter_remote(self, job: ClaimedJob, task: asyncio.Task[None]) -> None: ...

    def _leave_remote(self, job: ClaimedJob) -> None: ...


class Slot:
    """One job's hold on one of the worker's `concurrency` slots: taken at most once, at the job's first remote
    step, and given back once when its remote work ends (or it ends before any)."""

    __slots__ = ("_job", "_path", "_task", "held")

    def __init__(self, path: SlotOwner, job: ClaimedJob, task: asyncio.Task[None]) -> None:
        self._path, self._job, self._task, self.held = path, job, task, False

    async def take(self) -> None:
        if not self.held:
            await self._path._enter_remote(self._job, self._task)
            self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self._path._leave_remote(self._job)
