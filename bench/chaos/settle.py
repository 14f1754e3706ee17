"""After the faults: the capped queue's cap window rolls over and the harness waits until every acknowledged job is
terminal, for as long as jobs keep finishing.

The cap window is the store's UTC day, so a roll steps Valkey's clock to just past its next midnight (with the
capped queue's worker stopped first, its calls out awaited, and started again in the new day), where the held jobs
must come back. A new day's cap may fill again: a job whose earlier run expired at the provider before it was
polled runs again, counted in the day of that run, and what it holds back waits for the next day, rolled to while
nothing else is left (MAX_ROLLS in all).

A job is stuck once `stall` seconds passed with no job becoming terminal (or SETTLE_CAP times that in all): a
backlog worked off slowly (every fault combined leaves hundreds of jobs for after the faults, the rate limit paces
them, a loaded CI machine slows everything) is not stuck; a job waiting on something that does not come (a lease
never reaped, a clock) is.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import RedisError

from bench.chaos.faketime import ClockFile
from bench.chaos.procs import WorkerSlot
from bench.chaos.rundata import TERMINAL
from offload.caps import next_window_s, window_of
from offload.queue import keyspace

MAX_ROLLS = 3  # store days rolled to at most, while capped jobs wait for the next one
SETTLE_CAP = 4  # the wait for every job to be terminal: `stall` s without progress, at most this many times it
DAY_END_S = 20.0  # before the first roll, the longest wait for the capped jobs still to send their day's call


class Settle:
    """`run(stall)`: the roll(s) and the wait; `rolls`, `held_at_roll` for the checker."""

    def __init__(
        self, direct: Any, cap_slot: WorkerSlot, clock: ClockFile, acked: list[str], capped: str, cap: int
    ) -> None:
        self.direct, self.cap_slot, self.clock, self.capped, self.cap = direct, cap_slot, clock, capped, cap
        self.waiting = acked  # the jobs not terminal when last counted
        self.rolls: list[float] = []  # when the store's clock reached each new day (the capped queue's windows)
        self.held_at_roll = 0  # capped jobs held at the first roll
        self.window = ""  # the store's day since the last roll (a cap window: 20261207)
        self.held_today = 0  # capped jobs waiting out that window (held, or queued once its cap is full)
        self.counted: list[str] = []  # the capped jobs the first day's cap counted, read right before its roll
        self.unsent: list[str] = []  # of those, the ones with their call still to come then

    async def run(self, stall: float) -> float | None:
        """When every job was terminal, or None (the rest are stuck)."""
        await self.day_end(DAY_END_S)
        await self.roll()
        done = await self.until_terminal(stall)
        for _ in range(MAX_ROLLS - 1):
            if done is not None or not self.held_today or self.held_today < len(self.waiting):
                break  # (only when nothing but jobs held until the next day is left)
            await self.roll()
            done = await self.until_terminal(stall)
        return done

    async def day_end(self, bound: float) -> None:
        """Up to `bound` s for the first day to fill its cap and for the jobs it counted to send their call (a
        retry after a refused call; a job a drain handed back, its place freed, to be taken again), then what that
        day counted and which of those were still unsent, for the checker: a day may end with a counted job's call
        still to come (counted there, and again where it is sent)."""
        deadline = time.monotonic() + bound
        while True:
            try:
                self.counted, self.unsent, full = await self._day()
            except (RedisError, OSError):  # (a connection older than the last Valkey restart)
                self.counted, self.unsent, full = [], [], False
            if (full and not self.unsent) or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.5)

    async def _day(self) -> tuple[list[str], list[str], bool]:
        """(the jobs the store's day counted, those of them neither terminal nor held with no remote run recorded,
        whether the day's cap is filled)."""
        window = window_of(await self.store_time())
        counted = sorted(await self.direct.smembers(keyspace.cap(self.capped, window, "counted")))
        pipe = self.direct.pipeline(transaction=False)
        for job_id in counted:
            pipe.hmget(keyspace.job(self.capped, job_id), "state", "remote_n")
        found = await pipe.execute()
        unsent = [j for j, (s, n) in zip(counted, found, strict=True) if s not in TERMINAL and s != "held" and not n]
        capped = sum(1 for j in self.waiting if j.partition(":")[0] == self.capped)
        return counted, unsent, len(counted) >= min(self.cap, capped)

    async def roll(self) -> None:
        """The capped queue's window rolls over to the store's next day."""
        for attempt in range(5):  # the direct client's connection may predate the last Valkey restart
            try:
                held = int(await self.direct.zcard(f"offload:{{{self.capped}}}:held"))
                now = await self.store_time()
                break
            except (RedisError, OSError):
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5)
        self.held_at_roll = self.held_at_roll if self.rolls else held
        await asyncio.to_thread(self.cap_slot.terminate)
        midnight = next_window_s(now)
        self.clock.step(midnight + 1 - now)
        deadline = time.monotonic() + 30
        while await self.store_time() < midnight:
            if time.monotonic() > deadline:
                raise RuntimeError("Valkey's clock did not step to its next day")
            await asyncio.sleep(0.05)
        self.rolls.append(time.time())
        self.window = window_of(midnight + 1)
        self.cap_slot.start()

    async def store_time(self) -> float:
        seconds, micros = await self.direct.time()
        return int(seconds) + int(micros) / 1e6

    async def until_terminal(self, stall: float) -> float | None:
        """When every job was terminal; None once `stall` s passed without one becoming terminal, or at once when
        all that is left is held in today's cap window (waiting longer changes nothing)."""
        now = time.monotonic()
        deadline, cap = now + stall, now + stall * SETTLE_CAP
        while time.monotonic() < min(deadline, cap):
            try:
                still = await self._not_terminal()
            except (RedisError, OSError):
                await asyncio.sleep(1)
                continue
            if len(still) < len(self.waiting):
                deadline = time.monotonic() + stall
            self.waiting = still
            if not still:
                return time.time()
            if self.held_today == len(still):
                return None
            await asyncio.sleep(1)
        return None

    async def _not_terminal(self) -> list[str]:
        still: list[str] = []
        today = 0
        for i in range(0, len(self.waiting), 2000):
            chunk = self.waiting[i : i + 2000]
            pipe = self.direct.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hmget(f"offload:{{{job_id.partition(':')[0]}}}:job:{job_id}", "state", "held_window")
            pipe.get(keyspace.cap(self.capped, self.window, "jobs"))
            *found, used = await pipe.execute()
            left = [(j, s, w) for j, (s, w) in zip(chunk, found, strict=True) if s and s not in TERMINAL]
            still += [j for j, _, _ in left]
            # A full day's cap holds its queue's jobs back two ways: claimed and refused at submit (held in this
            # window), or never handed out (a capped queue's claim skips its fresh jobs): both wait for the roll.
            full = bool(self.window) and int(used or 0) >= self.cap
            today += sum(
                (s == "held" and w == self.window) or (full and s == "queued" and j.partition(":")[0] == self.capped)
                for j, s, w in left
            )
        self.held_today = today
        return still
