"""The dashboard in a real headless Chromium (Debian's, via Playwright) against a real server on a TCP port, a real
Valkey and real S3 (rclone): sign-in, live overview counts, queue and job detail with the output link, workers,
the polling fallback, and that no key or provider secret ever reaches the page, its URL or a cookie.

Actions (requeue, cancel, pause, purge), the viewer's read-only view and XSS are in test_dashboard_actions.py."""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, Request, Response, expect
from support.dashboard_helpers import HttpWorker, enqueue, go, save_screenshot, sign_in, store_call
from support.s3server import RcloneS3
from support.server_helpers import BUCKET, make_key, new_queue, server
from support.servers import ValkeyServer

from offload.storage.inputs import outputs_prefix

pytestmark = pytest.mark.xdist_group("dashboard-views")
PROVIDER_SECRET = "sk-provider-" + secrets.token_hex(16)
CAPPED = new_queue("capped")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, s3: RcloneS3) -> Iterator[tuple[str, str]]:
    """A server whose config holds a provider secret (it must never reach the browser) and a capped queue."""
    settings = {
        "backends": {"gpu": {"kind": "http-job", "base_url": "http://127.0.0.1:9", "api_key": PROVIDER_SECRET}},
        "queues": {CAPPED: {"backend": "gpu", "daily_job_cap": 100}},
    }
    with server(valkey.url, s3.settings(BUCKET), settings=settings, max_wait_s=5) as srv:
        yield srv


def cell(page: Page, queue: str, col: str) -> Any:
    return page.locator(f'tr[data-queue="{queue}"] td[data-col="{col}"]')


def test_wrong_key_shows_a_clear_sign_in_error(api: tuple[str, str], page: Page) -> None:
    page.goto(f"{api[0]}/ui/")
    expect(page.locator("#signin")).to_be_visible()
    page.fill("#key", "ofk_000000000000_not-a-real-key")
    page.click("#signin-form button[type=submit]")
    expect(page.locator("#signin-error")).to_contain_text("did not accept that key")
    expect(page.locator("#top")).to_be_hidden()
    assert page.input_value("#key") == "" and page.evaluate("sessionStorage.length") == 0
    # a worker key is a valid key, but not for the dashboard
    page.fill("#key", make_key(api[0], api[1], "worker", [new_queue()]))
    page.click("#signin-form button[type=submit]")
    expect(page.locator("#signin-error")).to_contain_text("worker key cannot use the dashboard")


def test_a_revoked_key_is_signed_out(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    created = admin.post("/v1/keys", json={"scope": "viewer", "name": "revoked soon"}).json()
    sign_in(page, api[0], created["token"])
    expect(page.locator("#who")).to_have_text("viewer · read-only")
    assert admin.delete(f"/v1/keys/{created['id']}").status_code == 204
    expect(page.locator("#signin-error")).to_contain_text("no longer accepts this key")  # on the next refresh
    assert page.evaluate("sessionStorage.length") == 0


def test_overview_counts_follow_jobs_live(
    api: tuple[str, str], admin: httpx.Client, page: Page, valkey: ValkeyServer, tmp_path: Path
) -> None:
    url, boot = api
    q = new_queue("live")
    enqueue(admin, q, 0)
    sign_in(page, url, boot)
    expect(page.locator("#live")).to_have_text("live")  # the event stream is connected
    expect(cell(page, q, "queued")).to_have_text("1")
    expect(page.locator("#who")).to_have_text("admin")

    # budget used / cap for a capped queue: a dispatch worker counts a submission at submit time
    (job_id,) = enqueue(admin, CAPPED, "counted")
    store_call(valkey.url, lambda s: s.reserve(job_id, job_cap=100, spend_cap=None))
    expect(cell(page, CAPPED, "budget")).to_have_text("1 / 100 jobs")

    enqueue(admin, q, 1, 2, 3)
    expect(cell(page, q, "queued")).to_have_text("4")
    worker = HttpWorker(url, make_key(url, boot, "worker", [q]), q, host="gpu-a100-1")
    try:
        jobs = worker.claim(3)
        expect(cell(page, q, "inflight")).to_have_text("3")
        expect(cell(page, q, "queued")).to_have_text("1")
        worker.heartbeat([j["id"] for j in jobs])
        row = page.locator(f'#overview-workers tr[data-worker="{worker.id}"]')
        expect(row).to_contain_text("gpu-a100-1")
        expect(row.locator('[data-col="inflight"]')).to_have_text("3")  # heartbeats are polled (no job event)
        expect(page.locator('[data-card="inflight"] .value')).not_to_have_text("0")
        save_screenshot(page, tmp_path, "dashboard.png")
        for job in jobs[:2]:
            worker.complete(job, {"n": job["input"]})
        worker.fail(jobs[2], "bad input")
        expect(cell(page, q, "succeeded")).to_have_text("2")
        expect(cell(page, q, "dead")).to_have_text("1")
        expect(cell(page, q, "inflight")).to_have_text("0")
        expect(cell(page, q, "enqueue-rate")).to_have_text(re.compile(r"\d+\.\d\d/s"))
    finally:
        worker.close()


def test_updates_fall_back_to_polling_when_the_stream_fails(
    api: tuple[str, str], admin: httpx.Client, page: Page
) -> None:
    page.route("**/v1/events", lambda route: route.abort())
    q = new_queue("poll")
    enqueue(admin, q, 0)
    sign_in(page, *api)
    expect(page.locator("#live")).to_have_text("polling")
    expect(cell(page, q, "queued")).to_have_text("1")
    enqueue(admin, q, 1)
    expect(cell(page, q, "queued")).to_have_text("2")
    page.unroute("**/v1/events")
    expect(page.locator("#live")).to_have_text("live")  # it retries the stream


def test_queue_detail_and_job_detail_with_output_link(
    api: tuple[str, str], admin: httpx.Client, page: Page, tmp_path: Path
) -> None:
    url, boot = api
    q = new_queue("detail")
    ids = enqueue(admin, q, *range(30))
    worker = HttpWorker(url, make_key(url, boot, "worker", [q]), q)
    try:
        first, second = worker.claim(2)
        worker.complete(first, {"answer": 42, "of": first["input"]})
        worker.fail(second, "model said no: CUDA out of memory", retryable=False)
    finally:
        worker.close()
    sign_in(page, url, boot)
    page.click(f'tr[data-queue="{q}"] a')  # from the overview into the queue
    expect(page.locator('.tab[data-state="queued"] .n')).to_have_text("28")
    expect(page.locator("#jobs tbody tr")).to_have_count(25)  # one page
    page.click('[data-page="next"]')
    expect(page.locator("#jobs tbody tr")).to_have_count(3)
    expect(page.locator(".pager")).to_contain_text("page 2")
    page.click('[data-page="prev"]')
    expect(page.locator("#jobs tbody tr")).to_have_count(25)
    expect(page.locator("#jobs tbody tr").first).to_have_attribute("data-job", ids[2])  # oldest first

    page.click('.tab[data-state="dead"]')
    row = page.locator(f'tr[data-job="{second["id"]}"]')
    expect(row).to_contain_text("CUDA out of memory")
    row.locator("a").click()
    expect(page.locator('[data-field="state"]')).to_have_text("dead")
    expect(page.locator('[data-field="attempts"]')).to_have_text("1 of 3")
    expect(page.locator("#job-error")).to_have_text("model said no: CUDA out of memory")
    expect(page.locator("#job-input")).to_have_text("1")

    go(page, f"#/queues/{q}?state=succeeded")
    page.locator(f'tr[data-job="{first["id"]}"] a').click()
    expect(page.locator('[data-field="state"]')).to_have_text("succeeded")
    expect(page.locator("#job-input")).to_have_text("0")
    # a GPU worker's output: the object of the run whose complete was fenced (under the job's own prefix)
    expect(page.locator('[data-field="result"]')).to_contain_text(f"s3://{BUCKET}/{outputs_prefix(first['id'])}run-")
    link = page.locator("#output-link")
    assert link.get_attribute("href", timeout=5000).startswith("http://127.0.0.1:")  # type: ignore[union-attr]
    with page.context.expect_page() as opened:
        link.click()
    output = opened.value
    output.wait_for_load_state()
    assert '"answer":42' in output.content().replace(" ", "")  # the presigned URL serves the stored output
    save_screenshot(page, tmp_path, "dashboard-job.png")


def test_workers_view_lists_a_registered_worker(api: tuple[str, str], admin: httpx.Client, page: Page) -> None:
    url, boot = api
    q = new_queue("workers")
    enqueue(admin, q, 1, 2)
    worker = HttpWorker(
        url,
        make_key(url, boot, "worker", [q]),
        q,
        host="gpu-box-7",
        version="9.9.9",
        instance_id="i-0dashboard",
        protected=True,
        gpus=[{"name": "NVIDIA A100"}],
    )
    try:
        jobs = worker.claim(2)
        worker.heartbeat([j["id"] for j in jobs])
        sign_in(page, url, boot)
        page.click('[data-nav="workers"]')
        row = page.locator(f'tr[data-worker="{worker.id}"]')
        expect(row.locator('[data-col="host"]')).to_have_text("gpu-box-7")
        expect(row.locator('[data-col="version"]')).to_have_text("9.9.9")
        expect(row.locator('[data-col="instance"]')).to_have_text("i-0dashboard")
        expect(row.locator('[data-col="protected"]')).to_have_text("yes")
        expect(row.locator('[data-col="inflight"]')).to_have_text("2")
        expect(row.locator('[data-col="heartbeat"]')).to_have_text(re.compile(r"\d+s ago"))
        expect(row).to_contain_text(q)
        expect(row).to_contain_text("NVIDIA A100")
    finally:
        worker.close()
    expect(page.locator(f'tr[data-worker="{worker.id}"]')).to_have_count(0)  # gone once it deregisters


def test_no_key_or_secret_in_dom_url_or_cookies(
    api: tuple[str, str], admin: httpx.Client, page: Page, s3: RcloneS3
) -> None:
    url, boot = api
    viewer = make_key(url, boot, "viewer")
    q = new_queue("secrets")
    enqueue(admin, q, {"prompt": "hello"})
    requests: list[Request] = []
    page.on("request", lambda r: requests.append(r))
    bodies: list[str] = []

    def keep_body(r: Response) -> None:
        if "/v1/" in r.url and r.status == 200 and "json" in (r.headers.get("content-type") or ""):
            with contextlib.suppress(PlaywrightError):  # a response still arriving as its page closes
                bodies.append(r.text())

    page.on("response", keep_body)
    for token in (boot, viewer):
        sign_in(page, url, token)
        assert page.evaluate("sessionStorage.getItem('offload.key')") == token  # this tab only
        for route in ("#/", f"#/queues/{q}", "#/dead", "#/held", "#/workers"):
            go(page, route)
            expect(page.locator("main#view section, main#view p").first).to_be_visible()
            expect(page.locator("main#view")).not_to_contain_text("Loading")
            html = page.content()
            values = page.evaluate("Array.from(document.querySelectorAll('input')).map(i => i.value).join(' ')")
            for secret in (token, PROVIDER_SECRET, s3.secret_key):
                assert secret not in html and secret not in values and secret not in page.url
        assert page.evaluate("document.cookie") == "" and page.context.cookies() == []
        assert page.evaluate("localStorage.length") == 0
        page.click("#signout")
        expect(page.locator("#signin")).to_be_visible()
        assert page.evaluate("sessionStorage.length") == 0
    api_requests = [r for r in requests if "/v1/" in r.url]
    assert api_requests and any(r.url.endswith("/v1/events") for r in api_requests)
    for r in requests:
        assert boot not in r.url and viewer not in r.url
    for r in api_requests:
        assert r.headers.get("authorization") in (f"Bearer {boot}", f"Bearer {viewer}"), r.url
    assert len(bodies) > 10
    for body in bodies:
        assert PROVIDER_SECRET not in body and s3.secret_key not in body
