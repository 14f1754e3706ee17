"""The fleet's idle share of a queue's spend: what its rented machines cost (the rental the autoscaler accrues,
offload/autoscale/state.py) less the shares its jobs paid (each fleet job's run time x its machine's price, kept by
the job store per kind of capacity). It is the `fleet_idle` line next to `serverless` and `fleet`, so the spend of
a queue adds up to what it was billed: the APIs' charges plus the machines' rental.

A mock provider's rental is counted as well (its dry-run buckets): its machines' jobs are priced at the mock's
price, and leaving the rental out would make their shares look like more than the fleet cost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from offload.autoscale.state import spend
from offload.models import QueueStats
from offload.redis_client import RedisClient


async def rental(redis: RedisClient, queue: str, now: float) -> tuple[float, float]:
    """(today, all time) in USD of the queue's rented machines, real and mock."""
    real, dry = await asyncio.gather(spend(redis, queue, now), spend(redis, queue, now, dry_run=True))
    return real[0] + dry[0], real[2] + dry[2]


def _idle(spent: dict[str, float], rented: float) -> dict[str, float]:
    """`spent` with its fleet_idle line: the rental the jobs' shares do not cover (none without a rental). The
    rental is accrued at each evaluation, so a job that finished since may briefly cover more: never below 0."""
    if rented <= 0:
        return spent
    return {**spent, "fleet_idle": max(rented - spent.get("fleet", 0.0), 0.0)}


async def with_fleet_idle(redis: RedisClient, stats: QueueStats, now: float | None = None) -> QueueStats:
    """The queue's stats with the fleet's idle share on its spend of today and of all time."""
    today, total = await rental(redis, stats.queue, time.time() if now is None else now)
    return dataclasses.replace(stats, spend=_idle(stats.spend, today), spend_total=_idle(stats.spend_total, total))
