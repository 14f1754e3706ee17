"""The docs' picture of every dashboard view, taken by this test from a running server (real Valkey, the server's
own autoscaler renting through the mock provider, jobs in every state through the worker protocol) in a real
headless Chromium. `OFFLOAD_SCREENSHOT_DIR=docs/img` writes them where docs/how-to/dashboard.md shows them; the
test also holds the page to showing one picture per view."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Locator, Page, expect
from support.dashboard_helpers import HttpWorker, enqueue, go, save_screenshot, sign_in
from support.eventually import eventually_sync
from support.fleet_spend import autoscaling_server, rent
from support.server_helpers import client, make_key, new_queue
from support.servers import ValkeyServer

pytestmark = pytest.mark.xdist_group("dashboard-shots")
QUEUE = new_queue("sdxl")
FLEET = new_queue("fleet")
DOCS = Path(__file__).parents[2] / "docs"


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with autoscaling_server(valkey.url, history_sample_s=0.5) as srv:  # the gauges' charts get points at once
        yield srv


def claim_one(worker: HttpWorker) -> dict[str, Any]:
    """The next job, once its retry backoff (a second or a few) is over."""

    def claimed() -> dict[str, Any] | None:
        r = worker.http.post(f"/v1/workers/{worker.id}/claim", json={"queue": worker.queue, "max": 1, "wait": 1})
        assert r.status_code == 200, r.text
        jobs: list[dict[str, Any]] = r.json()["jobs"]
        return jobs[0] if jobs else None

    job: dict[str, Any] = eventually_sync(claimed, 30, "a retried job to be claimable again")
    return job


def populate(admin: httpx.Client, url: str, boot: str) -> str:
    """Jobs in every state on QUEUE, a rented machine on FLEET; returns the id of a job retried twice, then done."""
    rent(admin, FLEET, price=0.42, daily_spend_cap=25)
    enqueue(admin, QUEUE, *({"prompt": f"a lighthouse at dusk, take {n}"} for n in range(10)))
    worker = HttpWorker(url, make_key(url, boot, "worker", [QUEUE]), QUEUE, host="gpu-a100-1")
    try:
        jobs = worker.claim(10)
        for job in jobs[:5]:
            worker.complete(job, {"image": f"s3://results/{job['id']}.png"})
        for job, error in zip(jobs[5:8], ("CUDA out of memory (tried 2.1 GiB)", "CUDA out of memory (tried 3.4 GiB)",
                                          "image decode failed: truncated PNG"), strict=True):  # fmt: skip
            worker.fail(job, error)  # not retryable: dead letter, two error groups
        retried = jobs[8]
        worker.fail(retried, "provider timeout after 300 s", retryable=True)
        worker.heartbeat([jobs[9]["id"]])  # one still running
        again = claim_one(worker)
        assert again["id"] == retried["id"], again
        worker.fail(again, "provider returned 502", retryable=True)
        again = claim_one(worker)
        worker.complete(again, {"image": f"s3://results/{again['id']}.png"})
        enqueue(admin, QUEUE, *({"prompt": f"a harbour in fog, take {n}"} for n in range(2)))  # a backlog
        return str(retried["id"])
    finally:
        worker.http.close()  # registered and live: the Workers view lists it


def views(retried: str) -> dict[str, tuple[str, str]]:
    """Image name -> (route, the role and name of what must be on screen before the shot: `role:name`)."""
    return {
        "page-overview.png": ("#/", f"link:{QUEUE}"),
        "page-queue.png": (f"#/queues/{QUEUE}?state=succeeded", "heading:" + QUEUE),
        "page-job.png": (f"#/jobs/{retried}", "table:Attempts"),
        "page-dead.png": ("#/dead", "heading:Dead letter"),
        "page-held.png": ("#/held", "heading:Held"),
        "page-workers.png": ("#/workers", "heading:Workers"),
        "page-autoscale.png": ("#/autoscale", "heading:Autoscaling"),
    }


def ready(page: Page, what: str) -> Locator:
    role, _, name = what.partition(":")
    return page.get_by_role(role, name=re.compile(re.escape(name))).first  # type: ignore[arg-type]


def test_every_view_is_shot_for_the_docs(api: tuple[str, str], page: Page, tmp_path: Path) -> None:
    url, boot = api
    with client(url, boot) as admin:
        retried = populate(admin, url, boot)

        def sampled() -> bool:  # the server sampled the rented machine and the backlog into the history
            points = admin.get("/v1/history", params={"range": "hour"}).json()["points"]
            return any((p["fleet_machines"] or 0) >= 1 for p in points) and any(
                (p["backlog"] or 0) >= 2 for p in points
            )

        eventually_sync(sampled, 20, "the history's gauges to be sampled")
    page.set_viewport_size({"width": 1280, "height": 900})
    sign_in(page, url, boot)
    shots = views(retried)
    for name, (route, what) in shots.items():
        go(page, route)
        expect(ready(page, what)).to_be_visible()
        if name in ("page-overview.png", "page-queue.png", "page-autoscale.png"):  # the charts drawn
            expect(page.get_by_text("Last hour: 60 points")).to_be_visible()
        if name == "page-job.png":  # the story is there: three attempts, two failed
            expect(page.get_by_role("table", name="Attempts").get_by_role("row")).to_have_count(4)
            # it succeeded: the error it keeps is an earlier attempt's, and says so
            expect(page.get_by_role("heading", name="Error of an earlier attempt")).to_be_visible()
        if name == "page-queue.png":  # below the charts, the jobs of the state shown
            expect(page.get_by_role("link", name=re.compile(re.escape(QUEUE + ":"))).first).to_be_visible()
            row = page.locator(f'tr[data-job="{retried}"] td.err')
            expect(row).to_have_text("earlier attempt: provider returned 502")
        save_screenshot(page, tmp_path, name)
    page_md = (DOCS / "how-to" / "dashboard.md").read_text()
    for name in shots:
        assert f"](../img/{name})" in page_md, f"docs/how-to/dashboard.md shows no {name}"
        assert (DOCS / "img" / name).stat().st_size > 5000, f"docs/img/{name} missing"
