"""Dashboard actions in a real headless Chromium against a real server and Valkey: requeue from the dead-letter
view, release from the held view, cancel, pause/resume, purge behind a confirmation; a viewer key sees no action
and a forced one is refused by the server (403, shown as an error); job data with markup is shown as text."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Page, expect
from support.dashboard_helpers import HttpWorker, dead_jobs, enqueue, go, sign_in, store_call
from support.server_helpers import make_key, new_queue, server
from support.servers import ValkeyServer

from offload.queue.store import QueueStore

pytestmark = pytest.mark.xdist_group("dashboard-actions")
XSS_INPUT = {
    "prompt": '<img src=x onerror="window.__xss=1">',
    "html": "<script>window.__xss=2</script>",
    "attr": '"><svg onload="window.__xss=3">',
}
XSS_ERROR = "<img src=y onerror=window.__xss=4> failed: </pre><script>window.__xss=5</script>"


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with server(valkey.url, max_wait_s=5) as srv:
        yield srv


def state_of(admin: httpx.Client, job_id: str) -> str:
    state: str = admin.get(f"/v1/jobs/{job_id}").json()["state"]
    return state


def test_requeue_a_dead_job_from_the_dead_letter_view(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    q = new_queue("dead")
    one, two = dead_jobs(api, q, "bad input: no prompt", "provider said 400")
    sign_in(page, *api)
    page.click('[data-nav="dead"]')
    section = page.locator(f'section.set[data-queue="{q}"]')
    expect(section.locator("h2")).to_contain_text("2 dead")
    expect(section.locator(f'tr[data-job="{one}"]')).to_contain_text("bad input: no prompt")
    section.locator(f'tr[data-job="{one}"] [data-action="requeue"]').click()
    expect(section.locator(f'tr[data-job="{one}"]')).to_have_count(0)  # it moved out of the dead letter
    expect(section.locator("h2")).to_contain_text("1 dead")
    expect(page.locator("#notice")).to_contain_text("Requeued 1 job")
    assert state_of(admin, one) == "queued" and state_of(admin, two) == "dead"
    go(page, "#/")  # and the overview counts it as queued again
    expect(page.locator(f'tr[data-queue="{q}"] td[data-col="queued"]')).to_have_text("1")
    expect(page.locator(f'tr[data-queue="{q}"] td[data-col="dead"]')).to_have_text("1")
    go(page, "#/dead")
    section.locator('[data-action="requeue-all"]').click()
    expect(section).to_have_count(0)  # no dead job left in the queue: its section goes
    assert state_of(admin, two) == "queued"


def test_release_a_held_job_from_the_held_view(
    api: tuple[str, str], admin: httpx.Client, page: Page, valkey: ValkeyServer
) -> None:
    q = new_queue("held")
    enqueue(admin, q, 1)

    async def hold(store: QueueStore) -> str:
        (job,) = await store.claim(q, "dispatch-1", 1)
        await store.hold(
            job.id,
            job.token,
            "daily jobs cap reached",  # today's window: not yet due
            time.strftime("%Y%m%d", time.gmtime()),
        )
        return job.id

    held = store_call(valkey.url, hold)
    sign_in(page, *api)
    page.click('[data-nav="held"]')
    row = page.locator(f'section.set[data-queue="{q}"] tr[data-job="{held}"]')
    expect(row).to_contain_text("daily jobs cap reached")
    row.locator('[data-action="release"]').click()
    expect(row).to_have_count(0)
    assert state_of(admin, held) == "queued"


def test_cancel_a_job(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    q = new_queue("cancel")
    job, other = enqueue(admin, q, {"prompt": "cancel me"}, {"prompt": "keep me"})
    sign_in(page, *api)
    go(page, f"#/jobs/{job}")
    expect(page.locator('[data-field="state"]')).to_have_text("queued")
    page.click('[data-action="cancel"]')
    expect(page.locator('[data-field="state"]')).to_have_text("cancelled")
    expect(page.locator('[data-action="cancel"]')).to_have_count(0)  # nothing left to cancel
    assert state_of(admin, job) == "cancelled"
    go(page, f"#/queues/{q}")  # from the queue's list too
    page.locator(f'tr[data-job="{other}"] [data-action="cancel"]').click()
    expect(page.locator(f'tr[data-job="{other}"]')).to_have_count(0)
    expect(page.locator('.tab[data-state="cancelled"] .n')).to_have_text("2")
    assert state_of(admin, other) == "cancelled"


def test_a_live_update_during_a_click_does_not_swallow_it(
    api: tuple[str, str], admin: httpx.Client, page: Page
) -> None:
    """A redraw between a button's mousedown and mouseup replaced the button, and the click never fired (a CI run:
    a row's Cancel clicked, the row still there 15 s later). The redraw now waits for the release."""
    q = new_queue("press")
    (job,) = enqueue(admin, q, {"prompt": "cancel me mid-update"})
    sign_in(page, *api)
    go(page, f"#/queues/{q}")
    expect(page.locator(".chart-status")).to_contain_text("points")  # the charts drawn: the page's layout settled
    page.locator(f'tr[data-job="{job}"] [data-action="cancel"]').hover()
    page.mouse.down()
    enqueue(admin, q, {"prompt": "a job event: the page loads the queue again"})
    # the page has the new count: drawn (the old page, replacing the pressed button) or held for the release
    page.wait_for_function(
        """() => document.body.dataset.redraw === "after-release"
        || document.querySelector('.tab[data-state="queued"] .n')?.textContent === "2" """
    )
    page.mouse.up()
    expect(page.locator(f'tr[data-job="{job}"]')).to_have_count(0)
    assert state_of(admin, job) == "cancelled"
    expect(page.locator('.tab[data-state="queued"] .n')).to_have_text("1")  # and the held redraw came after it
    assert page.evaluate("() => document.body.dataset.redraw") is None


def test_pause_resume_and_purge_with_confirmation(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    q = new_queue("ops")
    enqueue(admin, q, 1, 2, 3)
    sign_in(page, *api)
    go(page, f"#/queues/{q}")
    page.click('[data-action="pause"]')
    expect(page.locator("#paused")).to_be_visible()
    assert admin.get(f"/v1/queues/{q}").json()["paused"] is True
    page.click('[data-action="resume"]')
    expect(page.locator("#paused")).to_have_count(0)
    assert admin.get(f"/v1/queues/{q}").json()["paused"] is False

    page.click('[data-action="purge"]')
    expect(page.locator("#confirm")).to_be_visible()
    expect(page.locator("#confirm-text")).to_contain_text(f"Delete all 3 queued jobs of queue {q}")
    page.click("#confirm-cancel")  # changed my mind: nothing happens
    expect(page.locator("#confirm")).to_be_hidden()
    expect(page.locator("#jobs tbody tr")).to_have_count(3)
    page.click('[data-action="purge"]')
    page.click("#confirm-ok")
    expect(page.locator("#notice")).to_contain_text(f"Purged 3 queued jobs of {q}")
    expect(page.locator('.tab[data-state="queued"] .n')).to_have_text("0")
    assert admin.get(f"/v1/queues/{q}").json()["counts"]["queued"] == 0


def test_viewer_sees_no_actions_and_a_forced_one_is_refused(
    api: tuple[str, str], admin: httpx.Client, page: Page
) -> None:
    q = new_queue("viewer")
    (dead,) = dead_jobs(api, q, "boom")
    (queued,) = enqueue(admin, q, 1)
    sign_in(page, api[0], make_key(api[0], api[1], "viewer"))
    expect(page.locator("#who")).to_have_text("viewer · read-only")
    visible_actions = "els => els.filter(e => e.offsetParent !== null).length"
    for route in (f"#/queues/{q}", f"#/queues/{q}?state=dead", f"#/jobs/{dead}", f"#/jobs/{queued}", "#/dead"):
        go(page, route)
        expect(page.locator("main#view h1")).to_be_visible()
        expect(page.locator("main#view")).not_to_contain_text("Loading")
        assert page.locator("[data-action]").evaluate_all(visible_actions) == 0, route
    expect(page.locator("main#view")).to_contain_text("boom")  # it can look

    # A viewer who un-hides a button (or calls the API by hand) is stopped by the server, and told so.
    go(page, f"#/queues/{q}")
    page.locator('[data-action="pause"]').evaluate("b => { b.hidden = false; b.disabled = false; b.click(); }")
    expect(page.locator("#error")).to_be_visible()
    expect(page.locator("#error-text")).to_contain_text("403 forbidden: a viewer key may not pause queues")
    assert admin.get(f"/v1/queues/{q}").json()["paused"] is False
    go(page, f"#/jobs/{queued}")
    page.locator('[data-action="cancel"]').evaluate("b => { b.hidden = false; b.disabled = false; b.click(); }")
    expect(page.locator("#error-text")).to_contain_text("a viewer key may not cancel jobs")
    assert state_of(admin, queued) == "queued"
    status = page.evaluate(
        """async q => (await fetch(`/v1/queues/${q}/dead/requeue`, {method: 'POST',
        headers: {Authorization: `Bearer ${sessionStorage.getItem('offload.key')}`, 'Content-Type': 'application/json'},
        body: JSON.stringify({all: true})})).status""",
        q,
    )
    assert status == 403 and state_of(admin, dead) == "dead"


def test_job_data_with_markup_is_shown_as_text(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    url, boot = api
    q = new_queue("xss")
    (job,) = enqueue(admin, q, XSS_INPUT)
    worker = HttpWorker(url, make_key(url, boot, "worker", [q]), q, host="<b>host</b>")
    try:
        (claimed,) = worker.claim(1)
        worker.fail(claimed, XSS_ERROR)
    finally:
        worker.close()
    sign_in(page, url, boot)
    for route in ("#/dead", f"#/queues/{q}?state=dead", f"#/jobs/{job}"):
        go(page, route)
        expect(page.locator("main#view")).to_contain_text("onerror")  # the payload is on the page, as text
        assert page.locator("main#view img, main#view script, main#view svg").count() == 0, route
    expect(page.locator("#job-error")).to_have_text(XSS_ERROR)
    for value in XSS_INPUT.values():
        expect(page.locator("#job-input")).to_contain_text(value.replace('"', '\\"'))
    assert page.evaluate("window.__xss") is None  # nothing ran
