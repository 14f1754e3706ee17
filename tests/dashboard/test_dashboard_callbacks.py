"""Failed completion webhooks on the dashboard's dead letter, and their numbers in /metrics: a real server with
callbacks to a real local receiver (tests/support/callback_receiver.py) that refuses every POST until it is told
to accept, a real Valkey and a real headless Chromium. A viewer sees the dead-lettered webhook but cannot requeue
it (no button; the API answers 403); an admin requeues it from the page and the receiver gets it, signed as the
official `standardwebhooks` library verifies. The receiver's URL carries a token in its query string: it never
appears in the page, the API's list or /metrics."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import BrowserContext, Page, expect
from prometheus_client.parser import text_string_to_metric_families
from standardwebhooks import Webhook
from support.callback_receiver import Receiver, receiver
from support.dashboard_helpers import go, new_page, save_screenshot, sign_in, store_call
from support.eventually import eventually_sync
from support.server_helpers import client, make_key, new_queue, server

from offload.queue.outbox import CallbackCounts, Outbox
from offload.queue.store import QueueStore

pytestmark = pytest.mark.xdist_group("dashboard-callbacks")
MAX_TRIES = 2


@pytest.fixture(autouse=True)
def vault_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", "test-master-key-0123456789abcdef")


def config(queue: str) -> dict[str, Any]:
    quick = {"backoff_s": 0.05, "backoff_cap_s": 0.2, "poll_s": 0.05, "timeout_s": 5.0, "claim_s": 6.0}
    block = {"hosts": ["127.0.0.1"], "allow_private_hosts": True, "max_tries": MAX_TRIES, **quick}
    return {"queues": {queue: {}}, "callbacks": block}


def end_job(redis_url: str, queue: str) -> str:
    """Claim the queue's next job as a worker would and let it succeed: its webhook is owed from that step."""

    async def go_(store: QueueStore) -> str:
        (job,) = await store.claim(queue, "test-worker", 1)
        await store.complete(job.id, job.token, "results/out.json", cost=0.1)
        return job.id

    return store_call(redis_url, go_)


def store_counts(redis_url: str, queue: str) -> CallbackCounts:
    async def read(store: QueueStore) -> CallbackCounts:
        return await Outbox(store.redis).counts(queue)

    return store_call(redis_url, read)


def scrape(c: httpx.Client, queue: str) -> tuple[str, dict[str, float]]:
    """/metrics' text, and this queue's completion-webhook samples by name (the counter's by event)."""
    text = c.get("/metrics").text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("queue") == queue and s.name.startswith("offload_callbacks"):
                found[s.labels.get("event", s.name)] = s.value
    return text, found


def metrics_match_the_store(c: httpx.Client, redis_url: str, queue: str, **expected: int) -> str:
    """/metrics agrees with the store's own counts, and both with what the test expects; /metrics' text."""
    text, got = scrape(c, queue)
    counts = store_counts(redis_url, queue)
    assert got["offload_callbacks_owed"] == counts.owed and got["offload_callbacks_failed"] == counts.failed
    assert {e: got[e] for e in counts.totals} == counts.totals
    assert {"owed": counts.owed, "failed": counts.failed, **counts.totals} == expected
    return text


@pytest.fixture
def world(valkey_url: str) -> Iterator[tuple[str, str, str, Receiver]]:
    """(server URL, admin token, queue, receiver) with the receiver failing every POST."""
    queue = new_queue("hooks")
    with receiver() as rec, server(valkey_url, settings=config(queue)) as (url, admin):
        rec.otherwise = 503
        yield url, admin, queue, rec


def test_a_dead_lettered_webhook_is_seen_by_a_viewer_and_requeued_by_an_admin(
    world: tuple[str, str, str, Receiver], valkey_url: str, browser: BrowserContext, page: Page, tmp_path: Path
) -> None:
    url, boot, queue, rec = world
    token = f"s3cr3t-{secrets.token_hex(8)}"
    hook_url = f"{rec.url}?token={token}&tenant=42"
    host = rec.url.split("/")[2]  # 127.0.0.1:<port>
    with client(url, boot) as admin, client(url, make_key(url, boot, "viewer")) as viewer_api:
        r = admin.post(f"/v1/queues/{queue}/jobs", json={"input": {"n": 1}, "callback_url": hook_url})
        assert r.status_code == 201, r.text
        job_id = end_job(valkey_url, queue)
        assert r.json()["id"] == job_id
        listed = eventually_sync(
            lambda: (p := viewer_api.get(f"/v1/queues/{queue}/callbacks/failed").json())["failed"] and p,
            what="the webhook dead-lettered",
        )
        assert listed["failed"][0]["host"] == host and token not in str(listed)
        assert [x.status for x in rec.of(job_id)] == [503] * MAX_TRIES
        text = metrics_match_the_store(
            admin, valkey_url, queue, owed=0, failed=1, delivered=0, failed_try=MAX_TRIES, dead_lettered=1, requeued=0
        )
        assert token not in text and hook_url not in text

        # a viewer: the list, no requeue; forcing it through the API is refused
        sign_in(page, url, viewer_api.headers["Authorization"].removeprefix("Bearer "))
        go(page, "#/dead")
        hooks = page.get_by_role("region", name="Failed webhooks")
        rows = hooks.get_by_role("table", name=f"Failed webhooks of {queue}").get_by_role("row")
        row = rows.filter(has=page.get_by_role("link", name=job_id))
        expect(row).to_contain_text(host)
        expect(row).to_contain_text(f"HTTP 503: receiver says no (after {MAX_TRIES} tries)")
        expect(row.locator('[data-col="tries"]')).to_have_text(str(MAX_TRIES))
        expect(hooks.locator(f'[data-owed="{queue}"]')).to_have_text("0 owed")
        expect(hooks.get_by_role("button", name="Requeue selected")).to_have_count(0)
        expect(hooks.get_by_role("checkbox")).to_have_count(0)
        forced = viewer_api.post(f"/v1/queues/{queue}/callbacks/failed/requeue", json={"ids": [job_id]})
        assert forced.status_code == 403, forced.text
        assert forced.json() == {"error": "forbidden", "detail": "a viewer key may not requeue webhooks"}
        assert [f["job_id"] for f in viewer_api.get(f"/v1/queues/{queue}/callbacks/failed").json()["failed"]] == [
            job_id
        ]
        assert token not in page.content()
        save_screenshot(page, tmp_path, "dashboard-dead-webhooks.png")

        # an admin, once the receiver is back: tick, requeue, confirm; the receiver gets it, signed
        rec.otherwise = 200
        with new_page(browser) as admin_page:
            sign_in(admin_page, url, boot)
            go(admin_page, "#/dead")
            hooks = admin_page.get_by_role("region", name="Failed webhooks")
            requeue = hooks.get_by_role("button", name="Requeue selected")
            expect(requeue).to_be_disabled()  # nothing ticked yet
            hooks.get_by_label(f"Select webhook of {job_id}").check()
            requeue.click()
            dialog = admin_page.get_by_role("dialog")
            expect(dialog).to_contain_text(f"Send 1 webhook of queue {queue} again")
            dialog.get_by_role("button", name="Requeue selected").click()
            expect(admin_page.locator("#notice")).to_contain_text(f"Requeued 1 webhook of {queue}")
            got = eventually_sync(lambda: rec.accepted(job_id), what="the requeued webhook accepted")
            secret = admin.get(f"/v1/queues/{queue}/callbacks/secret").json()["secret"]
            event = Webhook(secret).verify(got[0].body, got[0].headers)
            assert event["type"] == "job.succeeded" and event["data"]["id"] == job_id
            expect(admin_page.locator(f'[data-callbacks="{queue}"]')).to_have_count(0)  # nothing failed or owed
            assert token not in admin_page.content()
        eventually_sync(lambda: store_counts(valkey_url, queue).owed == 0, what="the delivery recorded")
        metrics_match_the_store(
            admin, valkey_url, queue, owed=0, failed=0, delivered=1, failed_try=MAX_TRIES, dead_lettered=1, requeued=1
        )
