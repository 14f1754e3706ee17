"""The job store's spend per kind of capacity (issue 40, item 3; complete.lua, fail.lua, spend.lua): a fleet run
costs its run time on the store's clock x its machine's price, a failed run that cost something counts in its
kind's spend and marks the job's kind, and a repeated ack counts nothing twice. Real Redis/Valkey, a virtual
store clock so run times are exact."""

from __future__ import annotations

import pytest

from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

PRICE_H = 3.6  # USD per hour: $0.001 a second
DAY = 20_000 * 86_400_000  # 2024-10-04 00:00 UTC, in ms


async def test_fleet_cost_is_run_time_x_price_and_failed_runs_count(backend_url: str) -> None:
    now = [DAY + 3_600_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], excuse_outages=False)
    try:
        await store.enqueue_many("q", [JobSpec(input=i, max_attempts=3) for i in range(3)])
        fleet, failed, api = await store.claim("q", "r-1", 3, 600_000)
        now[0] += 90_000  # 90 s of the machine
        await store.complete(fleet.id, fleet.token, "results/f.json", kind="fleet", price=PRICE_H)
        await store.complete(fleet.id, fleet.token, "results/f.json", kind="fleet", price=PRICE_H)  # a repeat
        assert await store.fail(failed.id, failed.token, "OOM", kind="fleet", price=PRICE_H) == "retrying"
        assert await store.fail(api.id, api.token, "HTTP 500", cost=0.02) == "retrying"

        done, retried, api_job = [await store.get(j) for j in (fleet.id, failed.id, api.id)]
        assert done.kind == "fleet" and done.cost == pytest.approx(0.09)
        assert retried.kind == "fleet" and retried.cost is None  # its cost is the run that succeeds, when one does
        assert api_job.kind == "serverless" and api_job.cost is None
        stats = await store.stats("q")
        assert stats.spend == pytest.approx({"fleet": 0.18, "serverless": 0.02})  # the repeat added nothing
        assert stats.spend_total == stats.spend
        assert "fleet_unpriced" not in stats.totals

        now[0] += 86_400_000  # the next store day: today's spend starts again, the total stays
        (again,) = await store.claim("q", "r-2", 1, 600_000)
        now[0] += 1_000
        await store.complete(again.id, again.token, "results/u.json", kind="fleet")  # no price: no cost
        stats = await store.stats("q")
        assert stats.spend == {} and stats.totals["fleet_unpriced"] == 1
        assert stats.spend_total == pytest.approx({"fleet": 0.18, "serverless": 0.02})
        assert (await store.get(again.id)).cost is None
    finally:
        await store.redis.aclose()
