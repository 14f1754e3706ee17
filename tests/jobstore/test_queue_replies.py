"""Script replies decoded into named records in one place (offload/queue/replies.py), checked against the real
scripts on a real server: the claim reply's width is what claim.lua sends, every field lands in its name (each
set to a value no other field has, so a swapped position shows), and the stats reply likewise."""

from __future__ import annotations

import pytest

from offload.queue import replies
from offload.queue.keyspace import prefix
from offload.queue.scripts import SCRIPTS
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


async def test_claim_reply_is_claim_width_per_job(store: QueueStore) -> None:
    for n in range(3):
        await store.enqueue("rq", JobSpec(input={"n": n}))
    flat = await SCRIPTS.claim(store.redis, [prefix("rq")], ["", "w1", 3, 10_000, "req-1", "", "", "", "0.0", ""])
    assert len(flat) == 3 * replies.CLAIM_WIDTH
    assert [job.id for job in replies.claimed(flat)] == flat[:: replies.CLAIM_WIDTH]


async def test_every_claimed_field_lands_in_its_name(store: QueueStore) -> None:
    job_id = await store.enqueue(
        "rq", JobSpec(input={"prompt": "a cat"}, max_attempts=7, output_key="out/cat.json", job_id="rq:named-1")
    )
    [first] = await store.claim("rq", "w1", 1)
    assert (first.id, first.attempt, first.max_attempts, first.output_key) == (job_id, 1, 7, "out/cat.json")
    assert first.input == {"prompt": "a cat"}
    assert (first.backend, first.remote_id, first.cancel_requested, first.redelivered) == (None, None, False, False)
    assert (first.submission, first.intent_open) == (0, False)
    [begun] = await store.begin_many("rq", [(job_id, first.token, 0.0)], backend="runpod")
    assert begun == "OK:1"
    await store.release_leases("rq", "w1", [job_id])  # back to ready uncounted, intent still open
    [again] = await store.claim("rq", "w2", 1)
    assert again.id == job_id and again.token != first.token
    assert (again.redelivered, again.submission, again.intent_open) == (True, 1, True)
    await store.checkpoint(job_id, again.token, "runpod", "remote-42")
    await store.release_leases("rq", "w2", [job_id])
    [third] = await store.claim("rq", "w3", 1)
    assert (third.backend, third.remote_id, third.intent_open) == ("runpod", "remote-42", False)
    assert third.max_attempts == 7 and third.output_key == "out/cat.json"


def test_a_reply_of_another_width_is_refused_naming_the_script() -> None:
    with pytest.raises(ValueError, match=r"claim\.lua"):
        replies.claimed(["x"] * (replies.CLAIM_WIDTH + 1))
    assert replies.claimed([]) == []


async def test_stats_reply_fields_land_in_their_names(store: QueueStore) -> None:
    ids = [await store.enqueue("sq", JobSpec(input=n)) for n in range(4)]
    await store.enqueue("sq", JobSpec(input="later", delay=3600))
    [job] = await store.claim("sq", "w1", 1)
    await store.complete(job.id, job.token, "s3://b/x")
    [job] = await store.claim("sq", "w1", 1)
    await store.fail(job.id, job.token, "boom", retryable=False)
    await store.pause("sq")
    stats = await store.stats("sq")
    assert stats.paused is True
    assert stats.counts == {
        "queued": 2,
        "delayed": 1,
        "active": 0,
        "submitted": 0,
        "retrying": 0,
        "held": 0,
        "succeeded": 1,
        "dead": 1,
        "cancelled": 0,
    }
    assert stats.oldest_ready_age_ms is not None and stats.oldest_ready_age_ms >= 0
    assert stats.workers == 1  # w1 claimed and its lease deadline is ahead
    assert stats.totals.get("enqueued") == 5 and len(ids) == 4
