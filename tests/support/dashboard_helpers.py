"""Real-browser helpers for the dashboard tests: Debian's Chromium driven by Playwright for Python.

Playwright's own browser download (`playwright install`) is never used: `make test` installs Debian's `chromium`
and Playwright is pointed at it with `executable_path`. Each `launch` gets a fresh temporary profile from
Playwright, and each test a fresh tab (so sessionStorage starts empty).

Playwright's sync API keeps an asyncio loop registered on the main thread while a browser is open, so code that
needs `asyncio.run` (the queue store) runs in a helper thread here.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from playwright.sync_api import BrowserContext, Page, expect, sync_playwright

from offload.connection import connect
from offload.queue.store import QueueStore
from support.server_helpers import client, make_key

T = TypeVar("T")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
# A loaded 2-core machine running two test processes: generous, and expect() returns as soon as it holds.
expect.set_options(timeout=15_000)


@contextmanager
def chromium() -> Iterator[BrowserContext]:
    """A headless Chromium and one context for a test module; tests open their own page (tab) in it, which
    starts with empty sessionStorage, i.e. signed out. (A page is ~0.2 s; a context or browser several times
    that.) Missing Chromium is an error, not a skip: CI must have it."""
    if not os.path.exists(CHROMIUM):
        raise RuntimeError(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser.new_context(viewport={"width": 1400, "height": 900})
        finally:
            browser.close()


@contextmanager
def new_page(context: BrowserContext) -> Iterator[Page]:
    """A fresh tab; fails the test on an uncaught script error, a CSP violation or any dialog in the page."""
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on(
        "console",
        lambda msg: problems.append(f"console: {msg.text}") if "Content Security Policy" in msg.text else None,
    )
    page.on("dialog", lambda d: problems.append(f"unexpected dialog: {d.message}"))
    try:
        yield page
    finally:
        for p in context.pages:  # the tab and any it opened (an output link)
            p.close()
    assert not problems, problems


def sign_in(page: Page, base: str, token: str) -> None:
    page.goto(f"{base}/ui/")
    page.fill("#key", token)
    page.click("#signin-form button[type=submit]")
    expect(page.locator("#top")).to_be_visible()


def go(page: Page, route: str) -> None:
    """Navigate inside the single-page app (the hash route), as a click on a link would."""
    page.evaluate("r => { location.hash = r; }", route)


def in_thread(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, fn()).result(60)


def store_call(redis_url: str, fn: Callable[[QueueStore], Awaitable[T]]) -> T:
    """Run `fn(store)` against the job store (in a thread: see the module docstring)."""

    async def go_() -> T:
        redis = await connect(redis_url)
        try:
            return await fn(QueueStore(redis))
        finally:
            await redis.aclose()

    return in_thread(go_)


class HttpWorker:
    """A GPU worker speaking the server's worker protocol over HTTP, step by step under the test's control."""

    def __init__(self, base: str, token: str, queue: str, **register: Any) -> None:
        self.http = client(base, token)
        self.queue = queue
        r = self.http.post("/v1/workers/register", json={"queues": [queue], **register})
        assert r.status_code == 201, r.text
        self.id: str = r.json()["worker_id"]

    def claim(self, n: int = 1) -> list[dict[str, Any]]:
        r = self.http.post(f"/v1/workers/{self.id}/claim", json={"queue": self.queue, "max": n, "wait": 5})
        assert r.status_code == 200, r.text
        jobs: list[dict[str, Any]] = r.json()["jobs"]
        assert len(jobs) == n, jobs
        return jobs

    def heartbeat(self, jobs: list[str]) -> None:
        r = self.http.post(f"/v1/workers/{self.id}/heartbeat", json={"jobs": jobs})
        assert r.status_code == 200, r.text

    def complete(self, job: dict[str, Any], output: Any) -> None:
        """As the real GPU worker does: a 503 (the output could not be stored yet: a slow or busy store) is
        retried after its Retry-After, for up to 30 s; any other answer but 200 fails the test."""
        deadline = time.monotonic() + 30
        while True:
            r = self.http.post(
                f"/v1/workers/{self.id}/jobs/{job['id']}/complete", json={"token": job["token"], "output": output}
            )
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(float(r.headers.get("Retry-After", "1")))  # the protocol's back-off, not a synchronisation
        assert r.status_code == 200, r.text

    def fail(self, job: dict[str, Any], error: str, retryable: bool = False) -> None:
        r = self.http.post(
            f"/v1/workers/{self.id}/jobs/{job['id']}/fail",
            json={"token": job["token"], "error": error, "retryable": retryable},
        )
        assert r.status_code == 200, r.text

    def close(self) -> None:
        self.http.post(f"/v1/workers/{self.id}/deregister", json={"release": True})
        self.http.close()


def enqueue(admin: httpx.Client, queue: str, *inputs: Any, **options: Any) -> list[str]:
    r = admin.post(f"/v1/queues/{queue}/jobs/batch", json={"jobs": [{"input": i, **options} for i in inputs]})
    assert r.status_code == 201, r.text
    ids: list[str] = r.json()["ids"]
    return ids


def dead_jobs(api: tuple[str, str], queue: str, *errors: str) -> list[str]:
    """Jobs that failed for good, through the worker protocol (one attempt each, not retryable), in order."""
    url, boot = api
    with client(url, boot) as admin:
        enqueue(admin, queue, *range(len(errors)), max_attempts=1)
    worker = HttpWorker(url, make_key(url, boot, "worker", [queue]), queue)
    try:
        jobs = worker.claim(len(errors))
        for job, error in zip(jobs, errors, strict=True):
            worker.fail(job, error)
        return [j["id"] for j in jobs]
    finally:
        worker.close()


def save_screenshot(page: Page, tmp: Path, name: str) -> Path:
    """Saved by the test (for review); OFFLOAD_SCREENSHOT_DIR also keeps a copy (docs/img/)."""
    path = tmp / name
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 5000
    if target := os.environ.get("OFFLOAD_SCREENSHOT_DIR"):
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / name)
    return path
