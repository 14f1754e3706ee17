"""Per-queue autoscaler state in Redis (backoffs, schedule bookkeeping, the last decision) and spend buckets.

Kept in Redis, not in the process, so a new leader after a restart or failover continues the same backoff
instead of renting again at once (a broken image would otherwise cost one machine per failover).

Provisioning failures back off per provider (`prov_failures:<name>`, `prov_until:<name>`), so a queue with a
fallback list moves on to the next provider while the first one waits. Boot failures are judged per host
(`failedhosts:<queue>`): one host that fails is only avoided; failures on several hosts since the last healthy boot
pause the whole queue (the image is the same whichever host or provider rents). A healthy boot clears them all, and
a failure older than a day no longer counts.

Spend of the `mock` provider is dry-run spend: kept in buckets of its own (`dry:<period>`), shown apart, and
checked only against rehearsed caps (a queue renting from the mock), never against a real provider's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

import orjson

from offload.autoscale import keyspace
from offload.autoscale.safety import BOOTS_WINDOW, HOST_AVOID
from offload.caps import window_of
from offload.redis_client import RedisClient


@dataclass
class QueueState:
    boot_failures: int = 0
    boot_until: float = 0.0
    host_failures: int = 0
    host_until: float = 0.0
    last_down_fire: float = 0.0
    down_targets: str = ""  # instances a fired scale-down schedule retires (comma-separated ids)
    last_reason: str = ""
    quiet_since: float = 0.0  # scale-in by cost: when the queue last ran out of work (0: it has work)
    gap_ewma: float = 0.0  # the recent gaps between the queue's bursts, seconds (0: none seen yet)
    gaps: int = 0
    boot_ewma: float = 0.0  # the queue's recent boot times, create to ready, seconds (0: none measured)
    arrivals: str = ""  # a queue with overflow: "t:enqueued,..." over its window (overflow.keep_samples)
    profile: str = ""  # ...and with `predict`: "bin:jobs,..." over its last periods (predict.record)
    good_boots: str = ""  # AutoscaleSettings.boots of the last healthy boot...
    good_at: float = 0.0  # ...and when it was
    good_rented: float = 0.0  # when the newest machine that booted healthy was rented
    prov_failures: dict[str, int] = field(default_factory=dict)
    prov_until: dict[str, float] = field(default_factory=dict)

    @classmethod
    async def load(cls, redis: RedisClient, queue: str) -> QueueState:
        h = await redis.hgetall(keyspace.queue_state(queue))
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in h and f.type in ("str", "float", "int"):
                kwargs[f.name] = (
                    h[f.name] if f.type == "str" else (float(h[f.name]) if f.type == "float" else int(float(h[f.name])))
                )
        state = cls(**kwargs)
        for k, v in h.items():
            name, _, provider = k.partition(":")
            if name == "prov_failures" and provider:
                state.prov_failures[provider] = int(float(v))
            elif name == "prov_until" and provider:
                state.prov_until[provider] = float(v)
        return state

    async def save(self, redis: RedisClient, queue: str, **changes: Any) -> None:
        for k, v in changes.items():
            setattr(self, k, v)
        await redis.hset(
            keyspace.queue_state(queue), mapping={k: repr(v) if isinstance(v, float) else v for k, v in changes.items()}
        )

    async def provider_failed(self, redis: RedisClient, queue: str, provider: str, pause: float, now: float) -> int:
        """Count one provisioning failure of `provider` and pause it until now + pause; returns the count."""
        n = self.prov_failures.get(provider, 0) + 1
        self.prov_failures[provider] = n
        self.prov_until[provider] = now + pause
        await redis.hset(
            keyspace.queue_state(queue),
            mapping={f"prov_failures:{provider}": n, f"prov_until:{provider}": repr(now + pause)},
        )
        return n

    async def provider_ok(self, redis: RedisClient, queue: str, provider: str) -> None:
        if self.prov_failures.get(provider) or self.prov_until.get(provider):
            self.prov_failures[provider] = 0
            self.prov_until[provider] = 0.0
            await redis.hset(
                keyspace.queue_state(queue), mapping={f"prov_failures:{provider}": 0, f"prov_until:{provider}": "0.0"}
            )

    async def boot_failed(self, redis: RedisClient, queue: str, host: str, now: float) -> int:
        """Record a boot failure on `host`; returns how many distinct hosts failed to boot since the last healthy
        boot, within a day (older failures age out)."""
        key = keyspace.failed_hosts(queue)
        await redis.zremrangebyscore(key, "-inf", now - HOST_AVOID)
        await redis.zadd(key, {host: now})
        await redis.pexpire(key, int(HOST_AVOID * 1000))
        return len(await redis.zrange(key, 0, -1))

    async def booted(self, redis: RedisClient, queue: str, boots: str, now: float, rented_at: float) -> None:
        """A worker became ready on a machine rented at `rented_at`: what it booted (`boots`,
        AutoscaleSettings.boots) boots, so every boot-failure count and pause starts over, and it is known good for
        a day."""
        await redis.delete(keyspace.failed_hosts(queue))
        newest = max(rented_at, self.good_rented) if self.good_boots == boots else rented_at
        await self.save(
            redis,
            queue,
            boot_failures=0,
            boot_until=0.0,
            host_failures=0,
            host_until=0.0,
            good_boots=boots,
            good_at=now,
            good_rented=newest,
        )

    async def outcome(self, redis: RedisClient, queue: str, healthy: bool) -> int:
        """Note one boot outcome; returns how many of the last BOOTS_WINDOW failed."""
        key = keyspace.boot_outcomes(queue)
        pipe = redis.pipeline(transaction=True)
        pipe.lpush(key, "1" if healthy else "0")
        pipe.ltrim(key, 0, BOOTS_WINDOW - 1)
        pipe.pexpire(key, int(HOST_AVOID * 1000))
        pipe.lrange(key, 0, -1)
        last = (await pipe.execute())[-1]
        return sum(1 for o in last if o == "0")

    def vouched(self, boots: str, rented_at: float, now: float) -> bool:
        """Whether a machine rented at `rented_at` that failed to boot says nothing of the image: one rented after it
        booted the same thing healthy (its failure only comes to light now, boot_timeout after its rental)."""
        return self.known_good(boots, now) and 0 < rented_at <= self.good_rented

    def known_good(self, boots: str, now: float) -> bool:
        """Whether `boots` booted healthy on this queue within the last day."""
        return self.good_boots == boots and now - self.good_at < HOST_AVOID

    def paused_until(self) -> tuple[float, str]:
        """When renting may resume for the whole queue and why (machines that never booted, broken hosts)."""
        options = [
            (self.boot_until, "machines that never booted on several hosts"),
            (self.host_until, "several hosts that could not start the container"),
        ]
        return max(options)

    def targets(self) -> set[str]:
        return {i for i in self.down_targets.split(",") if i}


def periods(now: float) -> tuple[str, str]:
    """The spend buckets `now` counts in: its cap window (the UTC day) and its UTC month."""
    return window_of(now), datetime.fromtimestamp(now, UTC).strftime("%Y%m")


def _bucket(period: str, dry_run: bool) -> str:
    return f"dry:{period}" if dry_run else period


async def add_cost(redis: RedisClient, queue: str, now: float, amount: float, *, dry_run: bool = False) -> None:
    if amount <= 0:
        return
    day, month = periods(now)
    pipe = redis.pipeline(transaction=False)
    for period, ttl in ((day, 40 * 86400), (month, 400 * 86400)):
        pipe.incrbyfloat(keyspace.cost(queue, _bucket(period, dry_run)), amount)
        pipe.expire(keyspace.cost(queue, _bucket(period, dry_run)), ttl)
    pipe.incrbyfloat(keyspace.cost(queue, _bucket("total", dry_run)), amount)
    await pipe.execute()


async def spend(redis: RedisClient, queue: str, now: float, *, dry_run: bool = False) -> tuple[float, float, float]:
    """(today, this month, all time) in USD for a queue, from the accrued buckets (real or dry-run spend)."""
    day, month = periods(now)
    values = await redis.mget([keyspace.cost(queue, _bucket(p, dry_run)) for p in (day, month, "total")])
    today, this_month, total = (float(v or 0) for v in values)
    return today, this_month, total


async def save_decision(redis: RedisClient, queue: str, decision: dict[str, Any]) -> None:
    """The last evaluation of a queue, for `offload autoscale status` and the dashboard: why it does what it does."""
    pipe = redis.pipeline(transaction=False)
    pipe.set(keyspace.decision(queue), orjson.dumps(decision), ex=7 * 86400)
    pipe.sadd(keyspace.DECIDED, queue)
    await pipe.execute()


async def load_decision(redis: RedisClient, queue: str) -> dict[str, Any] | None:
    raw = await redis.get(keyspace.decision(queue))
    return None if raw is None else dict(orjson.loads(raw))
