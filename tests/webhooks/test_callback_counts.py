"""The completion-webhook totals the store keeps for /metrics (callback_done.lua, callback_requeue.lua): every
outcome counted once, and nothing counted for a stale claim's outcome or a requeue of a webhook that is not
dead-lettered (a retried request, a second admin's click). Real Valkey 9 and, when present, the system Redis 7.
And the one host-only form of a callback URL the API and the dashboard show (offload.redact.url_host)."""

from __future__ import annotations

import pytest
from support.server_helpers import new_queue

from offload.queue.outbox import Outbox
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redact import url_host

OWN = "https://hooks.example.com/offload?token=s3cret-token-123"


async def test_each_outcome_is_counted_once_and_stale_ones_not_at_all(store: QueueStore) -> None:
    queue = new_queue("cbn")
    outbox = Outbox(store.redis)
    assert (await outbox.counts(queue)).totals == {"delivered": 0, "failed_try": 0, "dead_lettered": 0, "requeued": 0}
    own = await store.enqueue(queue, JobSpec(input=1, callback_url=OWN))
    await outbox.set_queue_callback(queue, True)
    plain = await store.enqueue(queue, JobSpec(input=2))
    for job in await store.claim(queue, "w1", 2):
        await store.complete(job.id, job.token, "results/x.json")
    counts = await outbox.counts(queue)
    assert (counts.owed, counts.failed) == (2, 0)

    claimed = {c.job_id: c for c in await outbox.claim(queue, 10, 60_000)}
    assert await outbox.settle(queue, claimed[own], "retry", at_ms=0, error="HTTP 503")
    assert not await outbox.settle(queue, claimed[own], "ok")  # its claim ended with the retry: stale
    assert await outbox.settle(queue, claimed[plain], "ok")
    again = {c.job_id: c for c in await outbox.claim(queue, 10, 60_000)}
    assert await outbox.settle(queue, again[own], "dead", error="HTTP 503 (after 2 tries)")
    counts = await outbox.counts(queue)
    assert (counts.owed, counts.failed) == (0, 1)
    assert counts.totals == {"delivered": 1, "failed_try": 2, "dead_lettered": 1, "requeued": 0}

    (failed,) = await outbox.failed(queue)
    assert (failed.job_id, failed.tries, failed.job_url) == (own, 2, OWN)  # the server's eyes only: see the route
    assert await outbox.requeue(queue, [own, plain]) == [own]  # the delivered one is not dead-lettered
    assert await outbox.requeue(queue, [own]) == []  # a repeat of the click moves nothing
    counts = await outbox.counts(queue)
    assert (counts.owed, counts.failed, counts.totals["requeued"]) == (1, 0, 1)
    (last,) = await outbox.claim(queue, 10, 60_000)
    assert await outbox.settle(queue, last, "ok")
    counts = await outbox.counts(queue)
    assert (counts.owed, counts.failed) == (0, 0)
    assert counts.totals == {"delivered": 2, "failed_try": 2, "dead_lettered": 1, "requeued": 1}
    await outbox.set_queue_callback(queue, False)


async def test_a_queue_urls_dead_letter_has_no_url_of_its_own(store: QueueStore) -> None:
    queue = new_queue("cbq")
    outbox = Outbox(store.redis)
    await outbox.set_queue_callback(queue, True)
    job_id = await store.enqueue(queue, JobSpec(input=1))
    (job,) = await store.claim(queue, "w1", 1)
    await store.cancel(job_id)
    await store.ack_cancel(job.id, job.token)
    (claimed,) = await outbox.claim(queue, 10, 60_000)
    assert await outbox.settle(queue, claimed, "dead", error="no callback_url")
    (failed,) = await outbox.failed(queue)
    assert failed.job_id == job_id and failed.job_url is None  # the route falls back to the queue's URL
    await outbox.set_queue_callback(queue, False)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://hooks.example.com/o/s3cret-path?token=s3cret", "hooks.example.com"),
        ("http://user:pw@127.0.0.1:8080/x?sig=abc", "127.0.0.1:8080"),
        ("http://[::1]:9000/hook#frag", "[::1]:9000"),
        ("http://hooks.example.com:99999/x", None),  # a port out of range: nothing rather than a guess
        ("not a url", None),
        (None, None),
    ],
)
def test_only_the_host_of_a_callback_url_is_shown(url: str | None, host: str | None) -> None:
    assert url_host(url) == host
