"""A job's story on its dashboard page (issue 41, item 4), in a real headless Chromium against a real server, Valkey,
a dispatch worker and the simulator: a job the provider fails on every run is retried until dead, and its page lists
each attempt with its worker, backend, remote id, outcome and error. The provider's error is hostile markup: the page
shows it as text, and no element of it gets into the DOM."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from support.dashboard_helpers import enqueue, go, in_thread, save_screenshot, sign_in
from support.eventually import eventually
from support.server_helpers import client, new_queue, server
from support.servers import ValkeyServer

from offload.config import Settings
from offload.connection import connect
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.run import run_workers

pytestmark = pytest.mark.xdist_group("dashboard-story")
Q = new_queue("story")
HOSTILE = '<img src=x onerror="document.title=\'pwned\'"><b id="injected">boom</b>'


@pytest.fixture(scope="module")
def settings() -> Iterator[dict[str, Any]]:
    """One http-job backend at the simulator, every run of which fails with the hostile message."""
    sim_config = {"default": {"latency": 0.1, "fail_rate": 1.0, "error_message": HOSTILE}}
    with running_sim(SimConfig.model_validate(sim_config)) as sim:
        yield {
            "storage": {"kind": "local", "path": tempfile.mkdtemp(prefix="offload-story-")},
            "backends": {"gpu": {"kind": "http-job", "base_url": str(sim), "api_key": "k"}},
            "queues": {Q: {"backend": "gpu", "max_attempts": 3, "poll_interval": 0.2, "poll_timeout": 30}},
        }


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, settings: dict[str, Any]) -> Iterator[tuple[str, str]]:
    with server(valkey.url, settings=settings) as srv:
        yield srv


async def _run_until_dead(redis_url: str, settings: dict[str, Any], job_id: str) -> None:
    """A dispatch worker for the queue until the job has used its three attempts and is dead."""
    stop = asyncio.Event()
    config = Settings.model_validate({**settings, "redis_url": redis_url})
    task = asyncio.create_task(run_workers(config, [Q], stop=stop, install_signals=False, grace_s=5))
    redis = await connect(redis_url)
    store = QueueStore(redis)

    async def dead() -> bool:
        if task.done():
            task.result()  # a crashed worker fails the test with its own error
        return (await store.get(job_id)).state.value == "dead"

    try:
        await eventually(dead, 50, f"job {job_id} to be retried until dead")
    finally:
        stop.set()
        await task
        await redis.aclose()


def test_a_retried_job_lists_each_attempt_with_its_error(
    api: tuple[str, str], settings: dict[str, Any], valkey: ValkeyServer, page: Page, tmp_path: Path
) -> None:
    with client(*api) as admin:
        (job_id,) = enqueue(admin, Q, {"prompt": "x"})
    in_thread(lambda: _run_until_dead(valkey.url, settings, job_id))
    with client(*api) as admin:
        story = admin.get(f"/v1/jobs/{job_id}/attempts").json()
    assert story["made"] == 3 and [a["outcome"] for a in story["attempts"]] == ["failed", "failed", "dead"]
    assert {a["learned_by"] for a in story["attempts"]} == {"poll"}
    remote_ids = [a["remote_id"] for a in story["attempts"]]
    assert all(remote_ids) and len(set(remote_ids)) == 3  # a new remote job per attempt: each was submitted

    sign_in(page, *api)
    go(page, f"#/jobs/{job_id}")
    attempts = page.get_by_role("table", name="Attempts")
    rows = attempts.get_by_role("row")
    expect(rows).to_have_count(4)  # the header and one row per attempt
    for number, (row_outcome, remote_id) in enumerate(zip(("failed", "failed", "dead"), remote_ids, strict=True), 1):
        row = rows.nth(number)
        expect(row.get_by_role("cell").first).to_have_text(str(number))
        expect(row).to_contain_text("gpu")
        expect(row).to_contain_text(remote_id)
        expect(row).to_contain_text(row_outcome)
        expect(row.get_by_role("cell").last).to_have_text(f"remote job failed: {HOSTILE}")  # the markup, as text
    expect(page.get_by_role("table", name="Events")).to_contain_text("retrying")
    expect(page.locator("#injected")).to_have_count(0)
    expect(page.locator("#attempts img")).to_have_count(0)
    assert page.title() != "pwned"
    save_screenshot(page, tmp_path, "dashboard-job-story.png")
