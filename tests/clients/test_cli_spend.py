"""`offload queues` and `offload status` show spend per kind of capacity (issue 40, item 3): a serverless job's
cost (a dispatch worker's ack), a fleet job's share of its machine (run time x price), a fleet job on a machine
with no price (unknown, not $0), and the fleet's idle rental (the autoscaler's accrued rental less the jobs'
shares). The acks go through the store as the dispatch worker and the server's GPU-worker route send them; the
rental through the autoscaler's own accrual write. Real Valkey."""

from __future__ import annotations

import time

import pytest
from test_cli import as_json, ok, with_store

from offload.autoscale.state import add_cost
from offload.models import Job
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

API_COST, PRICE_H, RENTAL = 0.25, 3600.0, 2.0  # a $1-a-second machine: its share is the run's seconds in USD


async def _three_jobs(store: QueueStore) -> list[Job]:
    """A serverless job at API_COST, a fleet job at PRICE_H, a fleet job at no price; the day's rental."""
    await store.enqueue_many("spend", [JobSpec(input=i) for i in range(3)])
    serverless, priced, unpriced = await store.claim("spend", "w1", 3)
    await store.complete_many("spend", [(serverless.id, serverless.token, "results/s.json", API_COST)])
    await store.complete(priced.id, priced.token, "results/p.json", kind="fleet", price=PRICE_H)
    await store.complete(unpriced.id, unpriced.token, "results/u.json", kind="fleet")
    await add_cost(store.redis, "spend", time.time(), RENTAL, dry_run=False)
    return [await store.get(j.id) for j in (serverless, priced, unpriced)]


def test_queues_split_spend_by_kind_and_status_says_an_unknown_price(valkey_url: str) -> None:
    serverless, priced, unpriced = with_store(valkey_url, _three_jobs)
    assert (serverless.kind, serverless.cost) == ("serverless", API_COST)
    assert priced.started_at is not None and priced.finished_at is not None
    share = (priced.finished_at - priced.started_at) / 1000 * PRICE_H / 3600
    assert priced.kind == "fleet" and priced.cost == pytest.approx(share)
    assert (unpriced.kind, unpriced.cost) == ("fleet", None)

    (doc,) = as_json(valkey_url, "queues")
    assert doc["spend"] == pytest.approx({"serverless": API_COST, "fleet": share, "fleet_idle": RENTAL - share})
    assert doc["spend_total"] == doc["spend"] and doc["totals"]["fleet_unpriced"] == 1

    table = ok(valkey_url, "queues").splitlines()
    header = next(line for line in table if "fleet idle $" in line)
    assert header.split()[-7:] == ["serverless", "$", "fleet", "$", "fleet", "idle", "$"]
    (row,) = [line for line in table if line.split()[:1] == ["spend"]]
    fleet = f"{share:.4f}" if share < 1 else f"{share:.2f}"
    assert row.split()[-6:] == ["0.2500", fleet, "+", "price", "unknown", f"{RENTAL - share:.2f}"]

    status = ok(valkey_url, "status", unpriced.id)
    assert "unknown: its GPU worker is no rented machine (no price)" in status
    assert "fleet" in status
