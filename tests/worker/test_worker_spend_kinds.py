"""Issue 40, item 3, the serverless half: a job a dispatch worker completes at an API records its kind of capacity
(`serverless`) and its cost, and the queue's spend of that kind (today and since the queue began) grows by it, in
the same step as the ack. Real dispatch worker, the real simulator over HTTP, real Valkey."""

from __future__ import annotations

from typing import Any

import pytest
import test_routing as routing
from test_worker_faults import enqueue, until_state, worker

from offload.queue.store import QueueStore

sim, no_outputs, store = routing.sim, routing.no_outputs, routing.store
_quick_backoff, _clean_sim, _healthy = routing._quick_backoff, routing._clean_sim, routing._healthy
PRICE = 0.03  # USD per job at backend `a` (the first of the fallback route)


async def test_a_dispatch_worker_job_records_kind_serverless_and_its_cost(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    settings = routing.routed(valkey_url, no_outputs, sim, route="fallback", a={"price_per_job": PRICE})
    before = await store.stats("q")
    pairs = await enqueue(store, "spend-serverless", 3)
    async with worker(settings) as (task, _):
        jobs = await until_state(store, [j for j, _ in pairs], "succeeded", task)
    assert [(j.kind, j.backend) for j in jobs] == [("serverless", "a")] * 3
    assert [j.cost for j in jobs] == pytest.approx([PRICE] * 3)
    after = await store.stats("q")
    for line, was in ((after.spend, before.spend), (after.spend_total, before.spend_total)):
        assert line["serverless"] - was.get("serverless", 0.0) == pytest.approx(3 * PRICE)
        assert line.get("fleet", 0.0) == was.get("fleet", 0.0)  # nothing of it went to the fleet's line
    assert (await store.get(jobs[0].id)).to_dict()["kind"] == "serverless"
