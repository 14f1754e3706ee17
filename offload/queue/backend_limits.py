"""Per-backend limits shared by every worker on every machine: a global request rate (GCRA in Redis) and a
cool-down that one worker's 429 imposes on all of them.

Each backend's keys carry the hash tag `{backend:<name>}`, so the script runs on one cluster node. Callers
are told how long to wait and sleep on their own (asyncio), so a limited backend never blocks a worker's
other jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

from offload.queue.batching import Batcher
from offload.queue.keyspace import backend_cooldown, backend_counts, backend_rate
from offload.queue.scripts import SCRIPTS
from offload.redis_client import RedisClient

COOL_PROBE_S = 0.1
# How long noted outcomes gather before one write sends them all: a metric 50 ms late, against a write per
# event-loop pass (docs/explanation/performance.md, *Batched store calls*).
NOTE_EVERY_S = 0.05


class BackendLimits:
    """`await limits.acquire()` before each request to the backend; `cool_down(s)` after a 429."""

    def __init__(self, redis: RedisClient, backend: str, rate_per_s: float | None, burst: int = 1) -> None:
        self.redis = redis
        self.keys = [backend_rate(backend), backend_cooldown(backend)]
        self.counts_key = backend_counts(backend)
        self.interval_ms = 1000.0 / rate_per_s if rate_per_s else 0.0
        self.burst = max(burst, 1)
        self._counts: Batcher[str, None] = Batcher(self._add_counts)
        self._noted: Counter[str] = Counter()  # counted by `note`, not yet sent
        self._noting: asyncio.Task[None] | None = None
        self._probe: Batcher[None, int] = Batcher(self._pttl, concurrency=1)
        self._probed_at = -COOL_PROBE_S
        self._cool_until = 0.0

    def free_now(self) -> bool:
        """`ready` without awaiting: True only when the answer is known without a read (no rate limit, and the
        cool-down read less than COOL_PROBE_S ago is over)."""
        now = time.monotonic()
        return not self.interval_ms and now - self._probed_at < COOL_PROBE_S and self._cool_until <= now

    async def ready(self) -> bool:
        """Whether a request may go at once: no rate limit and no shared cool-down (read as `acquire` reads it:
        at most once per COOL_PROBE_S, shared by every caller). Lets a caller skip the machinery of a wait
        (tasks, a race with a cancel) on the common path; when False, `acquire` decides how long to wait."""
        return not self.interval_ms and await self._cooling_ms() == 0

    async def acquire(self, max_wait_s: float = 3600.0) -> float:
        """Wait until this request may go; returns the seconds waited."""
        waited = 0.0
        while True:
            if self.interval_ms:
                wait_ms = int(await SCRIPTS.rate_acquire(self.redis, self.keys, [self.interval_ms, self.burst]))
            else:
                wait_ms = -await self._cooling_ms()
            if wait_ms == 0:
                return waited
            await asyncio.sleep(abs(wait_ms) / 1000)
            waited += abs(wait_ms) / 1000
            if wait_ms > 0 or waited >= max_wait_s:
                return waited

    async def _cooling_ms(self) -> int:
        """Without a rate limit only the shared cool-down matters. It is read at most once per COOL_PROBE_S
        per process, and concurrent readers share that one read: a burst of 10,000 submissions costs a
        handful of round trips, and a 429 seen by any worker still pauses every other within 0.1 s."""
        now = time.monotonic()
        if now - self._probed_at >= COOL_PROBE_S:
            self._probed_at = now
            self._cool_until = now + max(0, await self._probe(None)) / 1000
        return max(0, int((self._cool_until - time.monotonic()) * 1000))

    async def _pttl(self, items: list[None]) -> list[int]:
        # (rate_acquire with no interval only reads the cool-down, as the store's clock has it: rides its steps)
        left = -int(await SCRIPTS.rate_acquire(self.redis, self.keys, [0, 1]))
        return [left] * len(items)

    async def cool_down(self, seconds: float) -> None:
        """Every worker pauses this backend for `seconds` (the longest requested cool-down wins)."""
        ms = max(int(seconds * 1000), 1)
        await SCRIPTS.cool_down(self.redis, [self.keys[1]], [ms])
        self._cool_until = max(self._cool_until, time.monotonic() + ms / 1000)  # this process pauses at once

    async def count(self, outcome: str) -> None:
        """Bump a per-backend counter for /metrics (submitted, throttled, errors). Shared in Redis so every
        server reports the totals of all workers; a failure to count never fails the job."""
        with contextlib.suppress(Exception):
            await self._counts(outcome)

    def note(self, outcome: str) -> None:
        """`count` without waiting for it: the counter is sent by a background flush (one for everything noted
        meanwhile), so the job that counts does not wait a round trip for a metric. `flush` sends what is left."""
        self._noted[outcome] += 1
        if self._noting is None or self._noting.done():
            self._noting = asyncio.get_running_loop().create_task(self._send_noted())

    async def _send_noted(self) -> None:
        """One write per NOTE_EVERY_S while outcomes keep being noted, then the task ends. The wait comes
        before every write, not only the first: a worker noting thousands of outcomes a second finds some
        noted during each write's round trip, and would go on writing back to back (same section)."""
        while True:
            await asyncio.sleep(NOTE_EVERY_S)  # everything noted meanwhile goes in one call
            if not self._noted:
                return
            noted, self._noted = self._noted, Counter()
            with contextlib.suppress(Exception):  # like `count`: a failure to count never fails a job
                await self._send(noted)

    async def flush(self) -> None:
        """Wait until every noted outcome was sent (or failed to be): before a worker exits."""
        if self._noting is not None:
            await asyncio.gather(self._noting, return_exceptions=True)

    async def _add_counts(self, outcomes: list[str]) -> list[None]:
        """One HINCRBY per outcome for a whole burst: at 10,000 jobs in flight a round trip per count would
        queue behind (and slow) the job tasks' own store calls."""
        await self._send(Counter(outcomes))
        return [None] * len(outcomes)

    async def _send(self, counts: Counter[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for outcome, n in counts.items():
            pipe.hincrby(self.counts_key, outcome, n)
        await pipe.execute()


OUTCOMES = ("submitted", "throttled", "errors")


async def backend_counters(redis: RedisClient, backend: str) -> dict[str, int]:
    raw = await redis.hgetall(backend_counts(backend))
    return {o: int(raw.get(o, 0)) for o in OUTCOMES}


async def route_counters(redis: RedisClient, backend: str) -> dict[str, int]:
    """A routed backend's counts, noted as `route:<what>`: submissions sent to it by reason (first, fallback,
    weighted, cheapest, probe, deadline, late, max_cost) and its health's openings (`opened`)."""
    raw = await redis.hgetall(backend_counts(backend))
    return {k.removeprefix("route:"): int(v) for k, v in raw.items() if k.startswith("route:")}
