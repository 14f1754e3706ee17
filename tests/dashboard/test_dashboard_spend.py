"""The dashboard shows a queue's spend per kind of capacity (issue 40, item 3) in a real headless Chromium against
a real server and Valkey: the queue list's spend cell and the queue page's spend table split serverless (a job a
dispatch worker completed at an API, through the store as a dispatch worker does), fleet (a job a GPU worker ran
on a machine the server's autoscaler rented through the mock provider) and fleet idle (the rest of the rental)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from support.dashboard_helpers import go, save_screenshot, sign_in, store_call
from support.eventually import eventually_sync
from support.fleet_spend import autoscaling_server, enqueue, gpu_worker, rent, run_one
from support.server_helpers import client, new_queue
from support.servers import ValkeyServer

from offload.queue.store import QueueStore

pytestmark = pytest.mark.xdist_group("dashboard-spend")
QUEUE = new_queue("spend-ui")
API_COST = 0.05  # what the API charged for the serverless job


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with autoscaling_server(valkey.url) as srv:
        yield srv


@pytest.fixture(scope="module")
def spent(api: tuple[str, str], valkey: ValkeyServer) -> dict[str, Any]:
    """One fleet job on the rented machine, then one serverless job; returns the queue's view once the rental
    passed the fleet job's share (so all three lines are there)."""
    url, boot = api
    with client(url, boot) as admin:
        inst = rent(admin, QUEUE)
        worker, worker_id = gpu_worker(url, boot, QUEUE, inst["id"])
        fleet_job = run_one(worker, worker_id, QUEUE)
        worker.close()
        enqueue(admin, QUEUE, {"n": 1})

        async def dispatch(store: QueueStore) -> None:  # the ack a dispatch worker sends for an API's answer
            [job] = await store.claim(QUEUE, "dispatch-1", 1, 60_000)
            await store.complete_many(QUEUE, [(job.id, job.token, f"results/{job.id}.json", API_COST)])

        store_call(valkey.url, dispatch)

        def all_lines() -> Any:
            q = admin.get(f"/v1/queues/{QUEUE}").json()
            return q if q["spend"].get("fleet_idle", 0) > 0 and "serverless" in q["spend"] else None

        found: dict[str, Any] = eventually_sync(all_lines, 10, "serverless, fleet and fleet idle spend")
        return {**found, "fleet_job": admin.get(f"/v1/jobs/{fleet_job}").json()}


def test_queue_list_and_queue_page_show_spend_per_kind(
    api: tuple[str, str], spent: dict[str, Any], page: Page, tmp_path: Path
) -> None:
    sign_in(page, *api)
    row = page.get_by_role("row").filter(has=page.get_by_role("link", name=QUEUE, exact=True))
    cell = row.locator('[data-col="spend"]')
    expect(cell).to_contain_text("serverless $0.0500")
    expect(cell).to_contain_text(re.compile(r"fleet \$0\.\d{4}"))
    expect(cell).to_contain_text(re.compile(r"fleet idle \$\d+\.\d+"))

    go(page, f"#/queues/{QUEUE}")
    table = page.get_by_role("table", name="Spend by kind of capacity")
    expect(table).to_be_visible()
    serverless = table.get_by_role("row", name=re.compile("^Serverless"))
    expect(serverless.get_by_role("cell").first).to_have_text("$0.0500")
    fleet = table.get_by_role("row", name=re.compile("^Fleet [$]"))
    expect(fleet.get_by_role("cell").first).to_have_text(re.compile(r"^\$0\.\d{4}$"))
    idle = table.get_by_role("row", name=re.compile("^Fleet idle"))
    expect(idle.get_by_role("cell").first).to_have_text(re.compile(r"^\$\d+\.\d+$"))
    assert spent["spend"]["serverless"] == pytest.approx(API_COST)
    save_screenshot(page, tmp_path, "dashboard-spend.png")

    job = spent["fleet_job"]  # the job's page names its kind of capacity and its share of the machine
    go(page, f"#/jobs/{job['id']}")
    expect(page.locator('dd[data-field="kind"]')).to_have_text("fleet")
    expect(page.locator('dd[data-field="cost"]')).to_have_text(f"${job['cost']:.4f}")
