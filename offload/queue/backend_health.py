"""A routed backend's health, shared by every worker on every machine: when its calls fail it cools down, then one
probe decides whether it is back (docs/how-to/routing.md, *Cool-downs*).

Closed: calls go. `failures` 5xx answers, timeouts or 429s within `window_s` open it: the shared cool-down of
offload/queue/backend_limits.py (the key a 429's Retry-After sets) runs for `cool_down_s`, or the Retry-After if
longer, and the router skips the backend meanwhile. Then it half-opens: one job may go as the probe (`probe`, its
lease as long as one call may take); a success closes it, a failure opens it again for the next cool-down of
`compute_backoff` (doubling up to `max_cool_down_s`). Each transition is one script (lua/health.lua) on the
backend's own cluster slot, on the store's clock. The mean run time it keeps is the price model of
`route: cheapest` for a backend priced per second; with the mean queue delay (submit to the provider starting the
job) it is a job's expected duration there, which a job's deadline is routed by (worker/job_limits.py). Each read
carries the store's time, so that arithmetic is on the store's clock, never this process's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from offload.backoff import compute_backoff
from offload.queue.keyspace import backend_cooldown, backend_health
from offload.queue.scripts import SCRIPTS
from offload.redis_client import RedisClient

State = Literal["closed", "open", "half"]
READ_EVERY_S = 0.1  # a backend's health is read at most this often per process (as BackendLimits' cool-down)
OPENINGS = 12  # cool-downs precomputed for this many openings in a row (the last repeats)


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """When a backend cools down (offload.config's HealthSettings, per queue)."""

    failures: int = 5
    window_s: float = 60.0
    cool_down_s: float = 30.0
    max_cool_down_s: float = 600.0

    def steps_ms(self) -> str:
        """The cool-down of each opening in a row, in ms: compute_backoff's doubling, capped."""
        return " ".join(
            str(int(compute_backoff(n, base=self.cool_down_s, cap=self.max_cool_down_s) * 1000))
            for n in range(1, OPENINGS + 1)
        )


@dataclass(frozen=True, slots=True)
class Health:
    """What the store says of a backend now. `cool_ms`: its cool-down left (a 429's or an opening's); `now_ms`: the
    store's time when it was read, at this process's monotonic `read_at`."""

    state: State
    cool_ms: int
    mean_run_s: float | None
    granted: bool = False
    mean_queue_s: float | None = None
    now_ms: int = 0
    read_at: float = field(default=0.0, compare=False)

    def store_now_ms(self) -> float:
        """The store's time now: its time at the read, carried forward by this process's monotonic clock (a step or
        skew of this machine's wall clock changes nothing)."""
        return self.now_ms + (time.monotonic() - self.read_at) * 1000

    @property
    def usable(self) -> bool:
        """Calls may go at once (no probe needed)."""
        return self.state == "closed" and self.cool_ms == 0

    @property
    def probe_free(self) -> bool:
        """Its cool-down ran out and no probe is out: one caller may send the probe (`BackendHealth.probe`)."""
        return self.state == "open" and self.cool_ms == 0


class BackendHealth:
    """One backend's health as this process sees it: `read` (cached READ_EVERY_S), `probe`, `failed`,
    `succeeded`."""

    def __init__(self, redis: RedisClient, backend: str, policy: HealthPolicy) -> None:
        self.redis, self.backend, self.policy = redis, backend, policy
        self.keys = [backend_health(backend), backend_cooldown(backend)]
        self._steps = policy.steps_ms()
        self._seen: Health | None = None
        self._seen_at = -READ_EVERY_S

    def forget(self) -> None:
        """Read the store again next time (this process just changed the backend's cool-down)."""
        self._seen_at = -READ_EVERY_S

    async def read(self) -> Health:
        now = time.monotonic()
        if self._seen is None or now - self._seen_at >= READ_EVERY_S:
            self._seen, self._seen_at = await self._run("read"), now
        return self._seen

    async def probe(self, lease_s: float) -> bool:
        """Whether this caller may send now: a closed backend, or the half-open one's probe (granted to one
        caller across every worker until its answer, or `lease_s`)."""
        return (await self._run("probe", int(lease_s * 1000))).granted

    async def failed(self, retry_after_s: float | None = None) -> Health:
        """A 5xx, a timeout or a 429 (not a Fatal: bad input is bad everywhere). `granted` when this opened it."""
        retry = int(retry_after_s * 1000) if retry_after_s else ""
        p = self.policy
        return await self._run("fail", p.failures, int(p.window_s * 1000), self._steps, retry)

    async def succeeded(self, run_s: float | None = None, queue_s: float | None = None) -> None:
        """A call answered: closes a half-open backend; `run_s` is a finished run's length (the mean run time),
        `queue_s` how long the provider queued it before it started (the mean queue delay)."""
        if run_s is None and queue_s is None and self._seen is not None and self._seen.state == "closed":
            return  # nothing to close and nothing to measure: no round trip
        await self._run("ok", _ms(run_s), _ms(queue_s))

    async def _run(self, op: str, *args: int | str) -> Health:
        sent = time.monotonic()
        state, cool, mean, granted, queued, now = await SCRIPTS.health(self.redis, self.keys, [op, "", *args])
        got = time.monotonic()
        seen = Health(
            str(state),  # type: ignore[arg-type]
            int(cool),
            _seconds(mean),
            int(granted) == 1,
            mean_queue_s=_seconds(queued),
            now_ms=int(now),
            read_at=(sent + got) / 2,  # the middle of the round trip stands for the moment it was read
        )
        self._seen, self._seen_at = seen, got
        return seen


def _ms(seconds: float | None) -> int | str:
    return int(seconds * 1000) if seconds is not None else ""


def _seconds(ms: object) -> float | None:
    return int(str(ms)) / 1000 if ms not in ("", None) else None
