"""Riding out a job-store outage: one view per process of whether Redis/Valkey answers.

A dispatch worker holds thousands of jobs whose next step is a store write (a checkpoint, an ack). When Redis
is down, none of those writes may be given up (an unrecorded remote id is paid for twice, an unacknowledged
result is stored for nothing) and none may be charged to the job. So a write that fails for an outage waits
for the store to answer again and is then sent again; the scripts are idempotent, so one that did run with
its reply lost changes nothing the second time. Thousands of tasks wait on one event instead of each
retrying a dead server; a single probe looks for the store with a growing pause and wakes them all.

A store at its maxmemory is the other kind of outage: it still answers, and the writes that end or keep a job
(checkpoint, ack, fail, heartbeat: scripts flagged allow-oom) still go through, but a write that adds data (a
claim, a begin, the rate limiter's) is refused with an OOM reply. Only those wait: a second probe reads `INFO
memory` until there is room (trimming expired records on the way, `heal`), then they are sent again. A job is
never failed, nor charged an attempt, for either.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from offload.backoff import compute_backoff
from offload.connection import is_oom, is_outage

log = logging.getLogger("offload.worker")
T = TypeVar("T")
FIRST_PROBE_S = 0.05
FIRST_ROOM_PROBE_S = 0.1
# A write refused at maxmemory is sent again at least this often even if INFO still says full: INFO may be of
# another primary of a cluster, and a refused resend only waits again.
ROOM_RETRY_S = 10.0


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class StoreHealth:
    """`await health.call(fn)` runs `fn` until it returns, waiting out outages; `failed(exc)` reports one."""

    def __init__(
        self,
        ping: Callable[[], Awaitable[Any]],
        *,
        max_pause_s: float = 2.0,
        room: Callable[[], Awaitable[bool]] | None = None,
        heal: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        """`room()`: whether the store is under its maxmemory again; `heal()`: what frees memory (a trim), run
        while writes wait for room."""
        self._ping = ping
        self._max_pause = max_pause_s
        self._room_check, self._heal = room, heal
        self._up = asyncio.Event()
        self._up.set()
        self._room = asyncio.Event()
        self._room.set()
        self._probe: asyncio.Task[None] | None = None
        self._room_probe: asyncio.Task[None] | None = None
        self.down_since: float | None = None
        self.full_since: float | None = None
        self.outages = 0
        self.full_spells = 0
        self.longest_s = 0.0

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def failed(self, exc: BaseException) -> None:
        """The store did not answer: everyone waits until the probe hears from it again. (Refused for want of
        memory: only the writes that add data wait, see `_full`.)"""
        if is_oom(exc):
            self._full(exc)
            return
        if not self._up.is_set():
            return
        self._up.clear()
        self.down_since = time.monotonic()
        self.outages += 1
        log.warning("job store unreachable (%s): holding every job where it is until it answers again", describe(exc))
        self._probe = asyncio.get_running_loop().create_task(self._look())

    def _pause(self, first: float, tries: int) -> float:
        """A probe's wait before its try number `tries` (0 first): `first`, then doubling up to `max_pause_s`."""
        return compute_backoff(tries + 1, base=first, cap=self._max_pause) if tries else first

    async def _look(self) -> None:
        tries = 0
        while True:
            await asyncio.sleep(self._pause(FIRST_PROBE_S, tries))
            try:
                await self._ping()
                break
            except Exception as exc:
                if not is_outage(exc):
                    log.warning("job store probe: %s", describe(exc))
                tries += 1
        took = time.monotonic() - (self.down_since or time.monotonic())
        self.longest_s = max(self.longest_s, took)
        log.warning("job store answers again after %.1fs", took)
        self.down_since = None
        self._up.set()

    def _full(self, exc: BaseException) -> None:
        if not self._room.is_set():
            return
        self._room.clear()
        self.full_since = time.monotonic()
        self.full_spells += 1
        log.warning(
            "job store full (%s): claims and submissions wait for room; checkpoints, acks and trims go on",
            describe(exc),
        )
        self._room_probe = asyncio.get_running_loop().create_task(self._look_for_room())

    async def _look_for_room(self) -> None:
        began = self.full_since or time.monotonic()
        tries = 0
        while True:
            await asyncio.sleep(self._pause(FIRST_ROOM_PROBE_S, tries))
            try:
                if self._heal is not None:
                    await self._heal()
                if self._room_check is None or await self._room_check():
                    break
            except Exception as exc:
                if not is_outage(exc):
                    log.warning("job store memory probe: %s", describe(exc))
            if time.monotonic() - began >= ROOM_RETRY_S:
                break
            tries += 1
        log.warning("job store: writes refused for memory are sent again after %.1fs", time.monotonic() - began)
        self.full_since = None
        self._room.set()

    async def wait(self) -> None:
        await self._up.wait()

    async def after(self, exc: BaseException) -> None:
        """Report a store call that failed for an outage and wait until it is worth sending again: the store
        answers again, or (refused for memory) there is room again."""
        self.failed(exc)
        await (self._room.wait() if is_oom(exc) else self._up.wait())

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
                await self.after(exc)

    async def aclose(self) -> None:
        for probe in (self._probe, self._room_probe):
            if probe is not None:
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
