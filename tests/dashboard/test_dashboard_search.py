"""The dashboard's search and dead-letter groups in a real headless Chromium against a real server and Valkey:
a search that finds a job by a fragment of its error, and a bulk requeue of one error group behind a confirmation,
after which that group's jobs are queued again and the other group's job is still dead."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from playwright.sync_api import Page, expect
from support.dashboard_helpers import dead_jobs, enqueue, go, sign_in
from support.server_helpers import new_queue, server
from support.servers import ValkeyServer

pytestmark = pytest.mark.xdist_group("dashboard-search")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with server(valkey.url, max_wait_s=5) as srv:
        yield srv


def test_search_finds_a_job_by_an_error_fragment(api: tuple[str, str], page: Page) -> None:
    q = new_queue("find")
    oom, other = dead_jobs(api, q, "CUDA out of memory: tried to allocate 2 GiB", "provider said 400")
    sign_in(page, *api)
    go(page, f"#/queues/{q}")
    form = page.get_by_role("search", name="Search jobs")
    form.get_by_label("Error text").fill("OUT OF MEMORY")
    form.get_by_label("State").select_option("dead")
    form.get_by_role("button", name="Search").click()
    found = page.get_by_role("table", name="Search results")
    expect(found.get_by_role("link", name=oom)).to_be_visible()
    expect(found.get_by_role("link", name=other)).to_have_count(0)
    expect(found).to_contain_text("CUDA out of memory")
    form.get_by_label("Error text").fill("no such error anywhere")
    form.get_by_role("button", name="Search").click()
    expect(page.get_by_text("No job matches.")).to_be_visible()


def test_search_by_idempotency_key_and_creation_time(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    """The API's other filters are on the form too: the idempotency key, and a creation range typed in UTC (the
    page's times are UTC), so a range ending before the job was made finds nothing and one around it finds it."""
    q = new_queue("keyed")
    (keyed,) = enqueue(admin, q, {"n": 1}, idempotency_key="order-77")
    enqueue(admin, q, {"n": 2}, idempotency_key="order-78")
    created = datetime.fromtimestamp(admin.get(f"/v1/jobs/{keyed}").json()["created_at"] / 1000, UTC)

    def minute(t: datetime) -> str:  # what a datetime-local field holds
        return t.strftime("%Y-%m-%dT%H:%M")

    sign_in(page, *api)
    go(page, f"#/queues/{q}")
    form = page.get_by_role("search", name="Search jobs")
    form.get_by_label("Idempotency key").fill("order-77")
    form.get_by_label("Created from (UTC)").fill(minute(created - timedelta(minutes=1)))
    form.get_by_label("Created to (UTC)").fill(minute(created + timedelta(minutes=2)))
    form.get_by_role("button", name="Search").click()
    found = page.get_by_role("table", name="Search results")
    expect(found.get_by_role("row")).to_have_count(2)  # the header and the one keyed job
    expect(found.get_by_role("link", name=keyed)).to_be_visible()
    form.get_by_label("Created to (UTC)").fill(minute(created - timedelta(minutes=1)))
    form.get_by_role("button", name="Search").click()
    expect(page.get_by_text("No job matches.")).to_be_visible()


def test_bulk_requeue_of_a_dead_letter_group(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    q = new_queue("group")
    slow = dead_jobs(api, q, "job abc failed after 3 s", "job def failed after 5 s", "job ghi failed after 8 s")
    (bad,) = dead_jobs(api, q, "bad input: no prompt")
    sign_in(page, *api)
    go(page, "#/dead")
    section = page.locator(f'section.set[data-queue="{q}"]')
    groups = section.get_by_role("table", name=f"Error groups of {q}")
    expect(groups.get_by_role("row", name="job <id> failed after <n> s")).to_contain_text("3")
    requeue = section.get_by_role("button", name="Requeue group")
    expect(requeue).to_be_disabled()  # nothing ticked yet
    section.get_by_label("Select group: job <id> failed after <n> s").check()
    requeue.click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text(f"Requeue 3 dead jobs of queue {q}")
    dialog.get_by_role("button", name="Requeue group").click()
    expect(page.locator("#notice")).to_contain_text(f"Requeued 3 jobs of {q}")
    expect(section.locator("h2")).to_contain_text("1 dead")
    assert {admin.get(f"/v1/jobs/{j}").json()["state"] for j in slow} == {"queued"}
    assert admin.get(f"/v1/jobs/{bad}").json()["state"] == "dead"
