"""Per-queue autoscaler state in Redis (backoffs, schedule bookkeeping) and spend buckets.

Kept in Redis, not in the process, so a new leader after a restart or failover continues the same backoff
instead of renting again at once (a broken image would otherwise cost one machine per failover).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from offload.autoscale import keys


@dataclass
class QueueState:
    prov_failures: int = 0
    prov_until: float = 0.0
    boot_failures: int = 0
    boot_until: float = 0.0
    host_failures: int = 0
    host_until: float = 0.0
    last_down_fire: float = 0.0
    down_pending: int = 0
    last_reason: str = ""

    @classmethod
    async def load(cls, redis: Any, queue: str) -> QueueState:
        h = await redis.hgetall(keys.queue_state(queue))
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in h:
                kwargs[f.name] = h[f.name] if f.type == "str" else (float(h[f.name]) if f.type == "float"
                                                                     else int(float(h[f.name])))
        return cls(**kwargs)

    async def save(self, redis: Any, queue: str, **changes: Any) -> None:
        for k, v in changes.items():
            setattr(self, k, v)
        await redis.hset(keys.queue_state(queue), mapping={k: repr(v) if isinstance(v, float) else v
                                                           for k, v in changes.items()})

    def paused_until(self) -> tuple[float, str]:
        """When renting may resume and why (the latest of the three backoffs)."""
        options = [(self.prov_until, "provisioning failures"), (self.boot_until, "machines that never booted"),
                   (self.host_until, "a host that could not start the container")]
        return max(options)


def periods(now: float) -> tuple[str, str]:
    t = datetime.fromtimestamp(now, UTC)
    return t.strftime("%Y%m%d"), t.strftime("%Y%m")


async def add_cost(redis: Any, queue: str, now: float, amount: float) -> None:
    if amount <= 0:
        return
    day, month = periods(now)
    pipe = redis.pipeline(transaction=False)
    pipe.incrbyfloat(keys.cost(queue, day), amount)
    pipe.expire(keys.cost(queue, day), 40 * 86400)
    pipe.incrbyfloat(keys.cost(queue, month), amount)
    pipe.expire(keys.cost(queue, month), 400 * 86400)
    pipe.incrbyfloat(keys.cost(queue, "total"), amount)
    await pipe.execute()


async def spend(redis: Any, queue: str, now: float) -> tuple[float, float, float]:
    """(today, this month, all time) in USD for a queue, from the accrued buckets."""
    day, month = periods(now)
    values = await redis.mget(keys.cost(queue, day), keys.cost(queue, month), keys.cost(queue, "total"))
    today, this_month, total = (float(v or 0) for v in values)
    return today, this_month, total
