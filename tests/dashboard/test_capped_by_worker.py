"""Queues capped for real: a dispatch worker runs their jobs against the simulator until the daily spend cap (and,
on another queue, the job cap) stops it. The dashboard then reads `capped: spend` / `capped: jobs` with the cap
and today's use, on the overview and on the queue's page, never `running`."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from support.dashboard_helpers import enqueue, go, in_thread, sign_in
from support.eventually import eventually
from support.server_helpers import client, new_queue, server
from support.servers import ValkeyServer

from offload.config import Settings
from offload.connection import connect
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.run import run_workers

SPEND = new_queue("spend")
JOBS = new_queue("jobs")


@pytest.fixture(scope="module")
def settings() -> Iterator[dict[str, Any]]:
    """One http-job backend at the simulator at $1 a job: a spend cap of $2.50 lets 2 jobs go (a third would
    reserve $1 more and pass it), a job cap of 2 the same."""
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.1}})) as sim:
        yield {
            "storage": {"kind": "local", "path": tempfile.mkdtemp(prefix="offload-capped-")},
            "backends": {"gpu": {"kind": "http-job", "base_url": str(sim), "api_key": "k", "price_per_job": 1.0}},
            "queues": {
                SPEND: {"backend": "gpu", "daily_spend_cap": 2.5, "poll_interval": 0.2, "poll_timeout": 30},
                JOBS: {"backend": "gpu", "daily_job_cap": 2, "poll_interval": 0.2, "poll_timeout": 30},
            },
        }


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, settings: dict[str, Any]) -> Iterator[tuple[str, str]]:
    with server(valkey.url, settings=settings) as srv:
        yield srv


async def _run_until_capped(redis_url: str, settings: dict[str, Any]) -> None:
    """A worker for both queues until each has run 2 jobs and has nothing in flight (the caps stop the rest)."""
    stop = asyncio.Event()
    config = Settings.model_validate({**settings, "redis_url": redis_url})
    task = asyncio.create_task(run_workers(config, [SPEND, JOBS], stop=stop, install_signals=False, grace_s=5))
    redis = await connect(redis_url)
    store = QueueStore(redis)

    async def settled() -> bool:
        if task.done():
            task.result()  # a crashed worker fails the test with its own error
        counts = [(await store.stats(q)).counts for q in (SPEND, JOBS)]
        return all(c["succeeded"] == 2 and c["active"] + c["submitted"] == 0 for c in counts)

    try:
        await eventually(settled, 60, "2 jobs of each queue to succeed and the caps to stop the rest")
    finally:
        stop.set()
        await task
        await redis.aclose()


def test_a_queue_capped_by_its_worker_reads_capped_with_the_cap(
    api: tuple[str, str], settings: dict[str, Any], valkey: ValkeyServer, page: Page
) -> None:
    with client(*api) as admin:
        for q in (SPEND, JOBS):
            enqueue(admin, q, *range(5))
    in_thread(lambda: _run_until_capped(valkey.url, settings))
    with client(*api) as admin:
        views = {v["queue"]: v for v in admin.get("/v1/queues").json()}
    assert (views[SPEND]["status"], views[SPEND]["capped"]) == ("capped", "spend")
    assert (views[JOBS]["status"], views[JOBS]["capped"]) == ("capped", "jobs")

    sign_in(page, *api)
    queues = page.get_by_role("table").filter(has=page.get_by_role("columnheader", name="Budget today (UTC)"))
    spend = queues.get_by_role("row").filter(has=page.get_by_role("link", name=SPEND, exact=True))
    expect(spend.locator('[data-col="status"]')).to_have_text("capped: spend $2.00 of $2.50 spent today")
    jobs = queues.get_by_role("row").filter(has=page.get_by_role("link", name=JOBS, exact=True))
    expect(jobs.locator('[data-col="status"]')).to_have_text("capped: jobs 2 of 2 jobs today")

    spend.get_by_role("link", name=SPEND, exact=True).click()
    heading = page.get_by_role("heading", level=1)
    expect(heading).to_have_text(f"Queue {SPEND} capped: spend $2.00 of $2.50 spent today")
    go(page, f"#/queues/{JOBS}")
    expect(heading).to_have_text(f"Queue {JOBS} capped: jobs 2 of 2 jobs today")
