"""A queue over its daily cap says `capped` everywhere: the HTTP API, `offload queues` and `offload
status`, and the dashboard, whose Held page lists the jobs the cap holds back instead of "No held jobs"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from playwright.sync_api import Page, expect
from support.dashboard_helpers import enqueue, go, sign_in, store_call
from support.server_helpers import new_queue, server
from support.servers import ValkeyServer
from typer.testing import CliRunner

from bench import web
from offload.caps import CapLimits, reached
from offload.cli.app import app
from offload.queue.store import QueueStore

JOBS_CAPPED = new_queue("jobcap")
SPEND_CAPPED = new_queue("spendcap")
OPEN = new_queue("open")
SETTINGS: dict[str, Any] = {
    "backends": {"gpu": {"kind": "http-job", "base_url": "http://127.0.0.1:9", "price_per_job": 1.0}},
    "queues": {
        JOBS_CAPPED: {"backend": "gpu", "daily_job_cap": 2},
        SPEND_CAPPED: {"backend": "gpu", "daily_spend_cap": 2.5},  # 2 jobs at 1.0: a third would pass it
        OPEN: {"backend": "gpu", "daily_job_cap": 100},
    },
}
runner = CliRunner()


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with server(valkey.url, settings=SETTINGS) as srv:
        yield srv


def submit(redis_url: str, queue: str, n: int, *, job_cap: int | None, spend_cap: float | None) -> None:
    """What dispatch workers do before each submission: count it against the caps (at the backend's price)."""

    async def go(store: QueueStore) -> None:
        # An hour's lease: no heartbeat follows, and a loaded run must not see the reaper hand them back.
        for job in await store.claim(queue, "dispatch-1", n, lease_ms=3_600_000):
            assert await store.reserve(job.id, job_cap=job_cap, spend_cap=spend_cap, cost=1.0) is None

    store_call(redis_url, go)


@pytest.fixture(scope="module")
def capped(api: tuple[str, str], valkey: ValkeyServer) -> dict[str, list[str]]:
    """Five jobs per queue; two of each capped queue submitted (its cap now reached), one of the open queue."""
    url, boot = api
    with web.client(base_url=url, headers={"Authorization": f"Bearer {boot}"}) as admin:
        ids = {q: enqueue(admin, q, *range(5)) for q in (JOBS_CAPPED, SPEND_CAPPED, OPEN)}
    submit(valkey.url, JOBS_CAPPED, 2, job_cap=2, spend_cap=None)
    submit(valkey.url, SPEND_CAPPED, 2, job_cap=None, spend_cap=2.5)
    submit(valkey.url, OPEN, 1, job_cap=100, spend_cap=None)
    return ids


def test_the_rule_is_the_scripts_rule() -> None:
    assert reached(CapLimits(jobs_cap=2), 1, 0.0) is None and reached(CapLimits(jobs_cap=2), 2, 0.0) == "jobs"
    spend = CapLimits(spend_cap=2.5, reserve=1.0)
    assert reached(spend, 0, 1.5) is None  # 1.5 + 1.0 = 2.5: allowed, as cap_reached in caps.lua
    assert reached(spend, 0, 1.6) == "spend"
    assert reached(CapLimits(), 10**9, 10.0**9) is None


def test_api_says_capped_and_which_cap(api: tuple[str, str], capped: dict[str, list[str]]) -> None:
    url, boot = api
    with web.client(base_url=url, headers={"Authorization": f"Bearer {boot}"}) as admin:
        views = {v["queue"]: v for v in admin.get("/v1/queues").json()}
        assert (views[JOBS_CAPPED]["status"], views[JOBS_CAPPED]["capped"]) == ("capped", "jobs")
        assert (views[SPEND_CAPPED]["status"], views[SPEND_CAPPED]["capped"]) == ("capped", "spend")
        assert (views[OPEN]["status"], views[OPEN]["capped"]) == ("running", None)
        assert views[JOBS_CAPPED]["counts"]["queued"] == 3 and views[JOBS_CAPPED]["counts"]["held"] == 0
        paused = admin.post(f"/v1/queues/{JOBS_CAPPED}/pause").json()
        assert (paused["status"], paused["capped"]) == ("paused", "jobs")  # a pause says more; the cap still shows
        assert admin.post(f"/v1/queues/{JOBS_CAPPED}/resume").json()["status"] == "capped"


def test_cli_queues_and_status_say_capped(
    capped: dict[str, list[str]], valkey: ValkeyServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "offload.yaml"
    config.write_text(yaml.safe_dump({**SETTINGS, "redis_url": valkey.url}))
    monkeypatch.setenv("OFFLOAD_CONFIG", str(config))
    monkeypatch.delenv("OFFLOAD_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    listed = runner.invoke(app, ["queues", "--json"])
    assert listed.exit_code == 0, listed.stderr
    rows = {r["queue"]: r for r in orjson.loads(listed.stdout)}
    assert (rows[SPEND_CAPPED]["status"], rows[SPEND_CAPPED]["capped"]) == ("capped", "spend")
    assert rows[OPEN]["status"] == "running"
    table = runner.invoke(app, ["queues"], env={"COLUMNS": "300"}).stdout
    assert (
        f"{JOBS_CAPPED} (capped: jobs)" in table
        and f"{SPEND_CAPPED} (capped: spend)" in table
        and f"{OPEN} (" not in table
    )
    shown = runner.invoke(app, ["status", capped[JOBS_CAPPED][-1]])
    assert shown.exit_code == 0 and f"queue {JOBS_CAPPED} is capped: its daily jobs cap is reached" in shown.stdout
    assert "is capped" not in runner.invoke(app, ["status", capped[OPEN][-1]]).stdout


def test_dashboard_shows_capped_and_the_held_page_lists_what_the_cap_holds(
    api: tuple[str, str], capped: dict[str, list[str]], page: Page
) -> None:
    sign_in(page, *api)
    expect(page.locator(f'tr[data-queue="{JOBS_CAPPED}"] td[data-col="status"]')).to_have_text(
        "capped: jobs 2 of 2 jobs today"
    )
    expect(page.locator(f'tr[data-queue="{OPEN}"] td[data-col="status"]')).to_have_text("running")
    page.click('[data-nav="held"]')
    section = page.locator(f'section.set[data-queue="{SPEND_CAPPED}"]')
    expect(section.locator('[data-capped="spend"]')).to_contain_text("3 queued jobs wait for the next cap window")
    for job_id in capped[SPEND_CAPPED][2:]:  # the three the cap holds back, listed
        expect(section.locator(f'tr[data-job="{job_id}"]')).to_have_count(1)
    expect(page.locator(f'section.set[data-queue="{OPEN}"]')).to_have_count(0)
    expect(page.locator("p.empty")).to_have_count(0)  # no "No held jobs." while queues are capped
    go(page, f"#/queues/{JOBS_CAPPED}?state=queued")
    expect(page.locator("#capped")).to_have_text("capped: jobs")
