"""hook.lua and the webhook secret kept by begin.lua, on Valkey 9 and (when present) the system Redis 7:
fencing by submission number, adoption of an unrecorded remote id, and every delivery that must change
nothing (duplicate, late, reordered, another remote id)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from support.admin_redis import redis_admin

from offload.connection import connect
from offload.models import JobState
from offload.queue.hook_store import HookItem
from offload.queue.keyspace import hook_digest, hooks_channel
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

FINAL = b'{"status":"succeeded"}'


@pytest.fixture
async def vstore(backend_url: str) -> AsyncIterator[QueueStore]:
    now = [10_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=1000, excuse_outages=False)
    store.now = now  # type: ignore[attr-defined]
    yield store
    await store.redis.aclose()


async def lapse(store: QueueStore) -> None:
    store.now[0] += 1_001  # type: ignore[attr-defined]
    await store.reap("q")


async def test_begin_keeps_the_hash_of_each_submissions_secret(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "s1"))]) == ["OK:1"]
    assert await vstore.hook_digests(job_id, 1) == [hook_digest("rp", "s1")]
    raw = await vstore.redis.hgetall(f"offload:{{q}}:job:{job_id}")
    assert "s1" not in str(raw.values())  # only the hash is stored
    # killed inside the submit call; the next worker resends submission 1 under a new secret: both are kept,
    # so the first submission's webhook is still recognised
    await lapse(vstore)
    (c2,) = await vstore.claim("q", "w2", 1)
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0, hook_digest("rp", "s2"))]) == ["OK:1:DUP"]
    assert await vstore.hook_digests(job_id, 1) == [hook_digest("rp", "s1"), hook_digest("rp", "s2")]
    assert await vstore.hook_digests(job_id, 2) == []


async def test_a_large_final_body_is_kept_but_not_carried_by_the_wake_up(vstore: QueueStore) -> None:
    """A final body over 4 KiB (a prediction with long logs) wakes its worker with `<id> <n>` alone: 2,000 such
    messages at once must not fill the subscriber's output buffer (Valkey drops a pub/sub client past 8 MiB for
    a minute). The worker then reads the body from the record, where it is kept whole."""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "s"))])
    await vstore.checkpoint_many("q", [(job_id, c.token, "b", "r-1", 1)])
    pubsub = redis_admin(vstore.redis).pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(hooks_channel("q", "w1"))
    large = b'{"status":"succeeded","logs":"' + b"x" * 5000 + b'"}'
    assert await vstore.hook(job_id, 1, "r-1", terminal=True, body=large) == "WAKE"
    message = None
    deadline = time.monotonic() + 5
    while message is None and time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=1)
    assert message is not None and message["data"] == f"{job_id} 1"
    await pubsub.aclose()
    assert await vstore.hook_body(job_id, 1) == large.decode()


async def test_webhook_adopts_an_unrecorded_remote_id_and_wakes_the_owner(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "s"))])
    pubsub = redis_admin(vstore.redis).pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(hooks_channel("q", "w1"))
    assert await vstore.current_remote(job_id) == (None, 1)
    # a start event while its submitter still holds the lease: recorded (that worker may be dead inside the
    # call), not counted as an adoption (it may as well be alive and about to record the same id itself)
    assert await vstore.hook(job_id, 1, "r-1", terminal=False, body=b"{}") == "STARTED"
    assert await vstore.current_remote(job_id) == ("r-1", 1)
    assert await vstore.redis.hget(f"offload:{{q}}:job:{job_id}", "adopted") is None
    assert await vstore.hook(job_id, 1, "r-1", terminal=True, body=FINAL) == "WAKE"
    message = None
    deadline = time.monotonic() + 5
    while message is None and time.monotonic() < deadline:  # the first reads may be the subscribe reply
        message = await pubsub.get_message(timeout=1)
    assert message is not None and message["data"] == f"{job_id} 1 {FINAL.decode()}"  # a small body rides along
    await pubsub.aclose()
    assert await vstore.hook_body(job_id, 1) == FINAL.decode()
    assert await vstore.hook_body(job_id, 2) is None
    assert (await vstore.get(job_id)).remote_id == "r-1"
    # the adopted job, handed to another worker, is resumed (its remote id), not submitted again; its lease
    # ended without the submitter recording the id, so the start event is counted as the adoption it was
    await lapse(vstore)
    assert await vstore.redis.hget(f"offload:{{q}}:job:{job_id}", "adopted") == "1"
    (again,) = await vstore.claim("q", "w2", 1)
    assert (again.remote_id, again.intent_open, again.submission) == ("r-1", False, 1)


async def test_duplicate_reordered_mismatched_and_late_deliveries_change_nothing(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "s"))])
    await vstore.checkpoint_many("q", [(job_id, c.token, "b", "r-1", 1)])
    assert await vstore.hook(job_id, 1, "r-1", terminal=True, body=FINAL) == "WAKE"
    before = await vstore.redis.hgetall(f"offload:{{q}}:job:{job_id}")
    assert await vstore.hook(job_id, 1, "r-1", terminal=True, body=b'{"status":"failed"}') == "DUP"
    assert await vstore.hook(job_id, 1, "r-1", terminal=False, body=b'{"status":"processing"}') == "OK"
    assert await vstore.hook(job_id, 1, "r-other", terminal=True, body=b"{}") == "MISMATCH"
    assert await vstore.redis.hgetall(f"offload:{{q}}:job:{job_id}") == before
    await vstore.complete(job_id, c.token, "results/x.json")
    assert await vstore.hook(job_id, 1, "r-1", terminal=True, body=b"{}") == "LATE"
    job = await vstore.get(job_id)
    assert job.state == JobState.SUCCEEDED and job.result == "results/x.json"
    assert await vstore.hook("q:unknown", 1, "r", terminal=True, body=b"{}") == "NOTFOUND"


async def test_a_callback_of_an_earlier_submission_cannot_complete_the_newer_run(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "a"))])
    await vstore.checkpoint_many("q", [(job_id, c.token, "b", "r-1", 1)])
    await vstore.fail(job_id, c.token, "remote job failed", delay_ms=0)  # run 1 failed: run 2 is wanted
    (c2,) = await vstore.claim("q", "w2", 1)
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0, hook_digest("rp", "b"))]) == ["OK:2"]
    assert await vstore.hook(job_id, 1, "r-1", terminal=True, body=FINAL) == "STALE"
    assert await vstore.hook(job_id, 1, "r-x", terminal=False, body=b"{}") == "STALE"
    assert await vstore.current_remote(job_id) == (None, 2)
    assert await vstore.hook_body(job_id, 1) is None and await vstore.hook_body(job_id, 2) is None


async def test_a_final_webhook_for_a_job_nobody_holds_is_kept_for_its_next_claim(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "s"))])
    await lapse(vstore)  # the worker died inside submit; the job is back in the queue
    assert await vstore.hook(job_id, 1, "r-9", terminal=True, body=FINAL) == "KEPT"
    (again,) = await vstore.claim("q", "w2", 1)
    assert (again.remote_id, again.intent_open) == ("r-9", False)
    assert await vstore.hook_body(job_id, again.submission) == FINAL.decode()


async def test_a_late_callback_of_a_failed_run_does_not_bring_its_remote_id_back(vstore: QueueStore) -> None:
    """Run 1 failed (seen by a poll) and its remote id was let go; its webhook arrives before the retry is
    submitted: adopting it would make the retry resume the failed run (and burn an attempt)."""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "a"))])
    await vstore.checkpoint_many("q", [(job_id, c.token, "b", "r-1", 1)])
    await vstore.fail(job_id, c.token, "remote job failed", delay_ms=0)
    assert await vstore.hook(job_id, 1, "r-1", terminal=True, body=b'{"status":"failed"}') == "STALE"
    (again,) = await vstore.claim("q", "w2", 1)
    assert again.remote_id is None and not again.intent_open
    # and a submit the provider refused (answered, no remote job) cannot be adopted either
    assert await vstore.begin_many("q", [(job_id, again.token, 0.0, hook_digest("rp", "b"))]) == ["OK:2"]
    await vstore.fail(job_id, again.token, "503", delay_ms=0, answered=True)
    assert await vstore.hook(job_id, 2, "r-2", terminal=True, body=FINAL) == "STALE"
    assert await vstore.current_remote(job_id) == (None, 2)


async def test_a_start_event_adopts_for_the_worker_waiting_out_the_grace(vstore: QueueStore) -> None:
    """The submitter died inside the call and its job went to w2 (in `Polling.await_hook`) before the provider's
    `start` came: the id is adopted, counted, w2 is told at once, and an `adopted` event marks the moment. The
    body of a non-final event is never kept, and nothing after it (a duplicate start, the dead worker's
    checkpoint of the same id, a start after completion) changes the record."""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "s"))])
    await lapse(vstore)
    (c2,) = await vstore.claim("q", "w2", 1)
    assert c2.intent_open and c2.remote_id is None
    pubsub = redis_admin(vstore.redis).pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(hooks_channel("q", "w2"))
    key = f"offload:{{q}}:job:{job_id}"
    assert await vstore.hook(job_id, 1, "r-1", terminal=False, body=b'{"status":"starting"}') == "ADOPTED"
    message = None
    deadline = time.monotonic() + 5
    while message is None and time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=1)
    await pubsub.aclose()
    assert message is not None and message["data"] == f"{job_id} 1"
    assert await vstore.current_remote(job_id) == ("r-1", 1)
    assert await vstore.hook_body(job_id, 1) is None
    assert await vstore.redis.hget(key, "adopted") == "1"
    events = [e for _, e in await vstore.redis.xrange("offload:{q}:events") if e["state"] == "adopted"]
    assert [e["jobs"] for e in events] == [job_id]
    before = await vstore.redis.hgetall(key)
    assert await vstore.hook(job_id, 1, "r-1", terminal=False, body=b'{"status":"starting"}') == "OK"
    assert await vstore.hook(job_id, 1, "r-2", terminal=False, body=b'{"status":"starting"}') == "MISMATCH"
    assert await vstore.redis.hgetall(key) == before
    # the dead worker's answer, had it come: the same id is no second run
    assert await vstore.checkpoint_many("q", [(job_id, c.token, "b", "r-1", 1)]) == ["STALE"]
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0, hook_digest("rp", "t"))]) == ["REMOTE:1:r-1"]
    assert await vstore.hook(job_id, 1, "r-1", terminal=True, body=FINAL) == "WAKE"
    await vstore.complete(job_id, c2.token, "results/x.json")
    assert await vstore.hook(job_id, 1, "r-1", terminal=False, body=b'{"status":"starting"}') == "LATE"
    job = await vstore.get(job_id)
    assert job.state == JobState.SUCCEEDED and job.result == "results/x.json" and job.possible_duplicates == 0


async def test_a_start_event_racing_the_live_submitters_answer_is_no_duplicate(vstore: QueueStore) -> None:
    """Replicate may call `start` before the create call's answer is back: the id is recorded first, and the
    submitter's checkpoint of the same id then goes through as usual (no DUP, no adoption counted)."""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    await vstore.begin_many("q", [(job_id, c.token, 0.0, hook_digest("rp", "s"))])
    assert await vstore.hook(job_id, 1, "r-1", terminal=False, body=b"{}") == "STARTED"
    assert await vstore.checkpoint_many("q", [(job_id, c.token, "b", "r-1", 1)]) == ["OK"]
    job = await vstore.get(job_id)
    assert job.state == JobState.SUBMITTED and job.remote_id == "r-1" and job.possible_duplicates == 0
    await lapse(vstore)  # even when that worker dies later: it had recorded the id itself
    assert await vstore.redis.hget(f"offload:{{q}}:job:{job_id}", "adopted") is None


async def test_hook_bodies_reads_many_in_one_call_each_fenced_by_its_own_submission(vstore: QueueStore) -> None:
    """The worker's batched read (a burst wakes hundreds of jobs): each answer is the kept body only for the
    submission asked about, in the order asked, and a job without a kept body (or gone) reads as None."""
    ids = await vstore.enqueue_many("q", [JobSpec(input=i, max_attempts=5) for i in range(3)])
    claimed = {c.id: c for c in await vstore.claim("q", "w1", 3)}
    for job_id in ids:
        await vstore.begin_many("q", [(job_id, claimed[job_id].token, 0.0, hook_digest("rp", "s"))])
    await vstore.hook(ids[0], 1, "r-0", terminal=True, body=b'{"n":0}')
    await vstore.hook(ids[2], 1, "r-2", terminal=True, body=b'{"n":2}')
    missing = ids[1][:-4] + "zzzz"
    asked = [(ids[2], 1), (ids[0], 2), (ids[1], 1), (ids[0], 1), (missing, 1)]
    assert await vstore.hook_bodies(asked) == ['{"n":2}', None, None, '{"n":0}', None]
    assert await vstore.hook_bodies([]) == []


async def test_hook_many_gives_each_delivery_its_own_verdict_and_survives_a_script_flush(vstore: QueueStore) -> None:
    """The server's batched hook.lua (one pipelined round trip for every delivery in flight): each item runs
    its own fenced script and gets its own verdict in order, a duplicate within one batch changes nothing the
    second time, and a Valkey that forgot the script (SCRIPT FLUSH, as after a restart) still runs each once."""
    ids = await vstore.enqueue_many("q", [JobSpec(input=i, max_attempts=5) for i in range(2)])
    claimed = {c.id: c for c in await vstore.claim("q", "w1", 2)}
    for job_id in ids:
        await vstore.begin_many("q", [(job_id, claimed[job_id].token, 0.0, hook_digest("rp", "s"))])
    await redis_admin(vstore.redis).script_flush()
    batch = [
        HookItem(ids[0], 1, "r-0", True, b'{"n":0}'),
        HookItem(ids[0], 1, "r-0", True, b'{"n":0}'),
        HookItem(ids[1], 2, "r-1", True, b'{"n":1}'),
        HookItem(ids[1], 1, "r-1", False, b"{}"),
    ]
    assert await vstore.hook_many(batch) == ["WAKE", "DUP", "STALE", "STARTED"]
    assert await vstore.hook_bodies([(ids[0], 1), (ids[1], 1)]) == ['{"n":0}', None]
    assert await vstore.hook_digests_many([(ids[0], 1), (ids[1], 2)]) == [[hook_digest("rp", "s")], []]
