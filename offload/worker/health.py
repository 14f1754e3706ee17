"""Riding out a job-store outage: one view per process of whether Redis/Valkey answers.

A dispatch worker holds thousands of jobs whose next step is a store write (a checkpoint, an ack). When Redis
is down, none of those writes may be given up (an unrecorded remote id is paid for twice, an unacknowledged
result is stored for nothing) and none may be charged to the job. So a write that fails for an outage waits
for the store to answer again and is then sent again; the scripts are idempotent, so one that did run with
its reply lost changes nothing the second time. Thousands of tasks wait on one event instead of each
retrying a dead server; a single probe looks for the store with a growing pause and wakes them all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from offload.connection import is_outage

log = logging.getLogger("offload.worker")
T = TypeVar("T")
FIRST_PROBE_S = 0.05


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class StoreHealth:
    """`await health.call(fn)` runs `fn` until it returns, waiting out outages; `failed(exc)` reports one."""

    def __init__(self, ping: Callable[[], Awaitable[Any]], *, max_pause_s: float = 2.0) -> None:
        self._ping = ping
        self._max_pause = max_pause_s
        self._up = asyncio.Event()
        self._up.set()
        self._probe: asyncio.Task[None] | None = None
        self.down_since: float | None = None
        self.outages = 0
        self.longest_s = 0.0

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def failed(self, exc: BaseException) -> None:
        """The store did not answer: everyone waits until the probe hears from it again."""
        if not self._up.is_set():
            return
        self._up.clear()
        self.down_since = time.monotonic()
        self.outages += 1
        log.warning("job store unreachable (%s): holding every job where it is until it answers again", describe(exc))
        self._probe = asyncio.get_running_loop().create_task(self._look())

    async def _look(self) -> None:
        pause = FIRST_PROBE_S
        while True:
            await asyncio.sleep(pause)
            try:
                await self._ping()
                break
            except Exception as exc:
                if not is_outage(exc):
                    log.warning("job store probe: %s", describe(exc))
                pause = min(pause * 2, self._max_pause)
        took = time.monotonic() - (self.down_since or time.monotonic())
        self.longest_s = max(self.longest_s, took)
        log.warning("job store answers again after %.1fs", took)
        self.down_since = None
        self._up.set()

    async def wait(self) -> None:
        await self._up.wait()

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`fn()` until it returns; an outage makes it wait for the store, any other error is raised."""
        while True:
            if not self._up.is_set():  # (a check, not an await: this runs a few times per job)
                await self._up.wait()
            try:
                return await fn()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self.failed(exc)

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
