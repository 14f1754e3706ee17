"""Issue 40, item 3, the fleet half: a job a GPU worker completes on a rented machine records kind `fleet` and its
share of the machine (run seconds on the store's clock x the machine's price); a GPU worker that is no rented
machine records kind `fleet` at an unknown price (no cost, never $0); the queue's spend per kind adds up to the
rental (fleet + fleet idle) and /metrics has a series per kind. Real server with its own autoscaler renting
through the mock provider, GPU workers over HTTP, real Valkey."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.eventually import eventually_sync
from support.fleet_spend import PRICE, autoscaling_server, enqueue, gpu_worker, rent, run_one
from support.server_helpers import client, new_queue
from support.servers import ValkeyServer

from offload.autoscale.fleet_idle import rental
from offload.connection import connect

pytestmark = pytest.mark.xdist_group("autoscale-spend")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with autoscaling_server(valkey.url) as srv:
        yield srv


def _rented(redis_url: str, queue: str) -> tuple[float, float]:
    """What the autoscaler has accrued for the queue's machines so far: (today, all time)."""

    async def read() -> tuple[float, float]:
        redis = await connect(redis_url)
        try:
            return await rental(redis, queue, time.time())
        finally:
            await redis.aclose()

    return asyncio.run(read())


def test_fleet_jobs_pay_their_machine_share_and_the_rest_is_fleet_idle(
    api: tuple[str, str], valkey: ValkeyServer
) -> None:
    url, boot = api
    queue = new_queue("fleet")
    with client(url, boot) as admin:
        inst = rent(admin, queue)
        rented_worker, rented_id = gpu_worker(url, boot, queue, inst["id"])
        job_id = run_one(rented_worker, rented_id, queue)
        job: dict[str, Any] = admin.get(f"/v1/jobs/{job_id}").json()
        run_s = (job["finished_at"] - job["started_at"]) / 1000
        assert job["kind"] == "fleet" and job["cost"] == pytest.approx(run_s * PRICE / 3600, rel=1e-9)

        enqueue(admin, queue, {"n": 1})  # on the user's own machine: no price, so no cost (not $0)
        own_worker, own_id = gpu_worker(url, boot, queue, None)
        own_job = admin.get(f"/v1/jobs/{run_one(own_worker, own_id, queue)}").json()
        assert (own_job["kind"], own_job["cost"]) == ("fleet", None)

        def idle_seen() -> Any:  # the machine has been rented longer than its one job ran
            q = admin.get(f"/v1/queues/{queue}").json()
            return q if q["spend"].get("fleet_idle", 0) > 0 else None

        eventually_sync(idle_seen, 10, "the rental to pass the jobs' share")
        before = _rented(valkey.url, queue)
        q = admin.get(f"/v1/queues/{queue}").json()
        after = _rented(valkey.url, queue)
        metrics = admin.get("/metrics").text
        own_worker.close()
        rented_worker.close()
    assert q["totals"]["fleet_unpriced"] == 1
    for line, lo, hi in ((q["spend"], before[0], after[0]), (q["spend_total"], before[1], after[1])):
        assert line["fleet"] == pytest.approx(job["cost"])  # only the priced job: the unpriced one adds nothing
        assert "serverless" not in line
        assert lo - 1e-12 <= line["fleet"] + line["fleet_idle"] <= hi + 1e-12  # adds up to the rental read then
    for kind in ("serverless", "fleet", "fleet_idle"):
        assert re.search(rf'^offload_spend_usd_total\{{kind="{kind}",queue="{queue}"\}} \S+$', metrics, re.M), kind
    fleet = re.search(rf'^offload_spend_usd_total\{{kind="fleet",queue="{queue}"\}} (\S+)$', metrics, re.M)
    assert fleet is not None and float(fleet[1]) == pytest.approx(job["cost"])
