"""Behaviour of each atomic transition, on Valkey 9 and (when present) the system Redis 7."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from support.admin_redis import redis_admin

from offload import InvalidJob, InvalidQueueName, InvalidTransition, JobNotFound, PayloadTooLarge, StaleLease
from offload.backoff import Backoff, compute_backoff, retry_delay_ms
from offload.connection import connect
from offload.models import JobState
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


async def test_enqueue_then_get_returns_a_typed_record(store: QueueStore) -> None:
    job_id = await store.enqueue("gpu", JobSpec(input={"prompt": "hi"}))
    job = await store.get(job_id)
    assert job.state is JobState.QUEUED
    assert job.input == {"prompt": "hi"}
    assert job.queue == "gpu"
    assert job.output_key == f"results/{job_id}.json"
    assert job.attempts == 0 and job.max_attempts == 3


async def test_claim_orders_by_priority_then_fifo(store: QueueStore) -> None:
    low = await store.enqueue_many("q", [JobSpec(input=i, priority=0) for i in range(3)])
    high = await store.enqueue_many("q", [JobSpec(input=i, priority=5) for i in range(3)])
    claimed = await store.claim("q", "w", 10)
    assert [c.id for c in claimed] == high + low
    assert all(c.attempt == 1 for c in claimed)
    assert len({c.token for c in claimed}) == 6


async def test_idempotency_key_returns_the_same_id(store: QueueStore) -> None:
    first = await store.enqueue("q", JobSpec(input=1, idempotency_key="order-7"))
    again = await store.enqueue("q", JobSpec(input=2, idempotency_key="order-7"))
    other = await store.enqueue("q", JobSpec(input=3, idempotency_key="order-8"))
    assert first == again != other
    assert (await store.stats("q")).counts["queued"] == 2


async def test_delayed_job_waits_until_due(backend_url: str) -> None:
    from offload.connection import connect

    now = [1_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    job_id = await store.enqueue("q", JobSpec(input=1, delay=30))
    assert (await store.get(job_id)).state is JobState.DELAYED
    assert await store.claim("q", "w", 5) == []
    now[0] += 30_000
    claimed = await store.claim("q", "w", 5)
    assert [c.id for c in claimed] == [job_id]
    await store.redis.aclose()


async def test_checkpoint_then_lease_expiry_keeps_remote_id(backend_url: str) -> None:
    from offload.connection import connect

    now = [5_000_000]
    # the virtual clock jumps with no call in between: not an outage here (see test_outages.py)
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=1000, excuse_outages=False)
    job_id = await store.enqueue("q", JobSpec(input=1))
    (c,) = await store.claim("q", "w1", 1)
    assert await store.checkpoint(c.id, c.token, "runpod", "rp-42") is False
    now[0] += 1001  # w1 never heartbeats again: its lease ends
    (again,) = await store.claim("q", "w2", 1)
    assert again.id == job_id and again.remote_id == "rp-42" and again.backend == "runpod"
    job = await store.get(job_id)
    assert job.state is JobState.SUBMITTED and job.lease_expiries == 1 and job.attempts == 1
    with pytest.raises(StaleLease):
        await store.complete(job_id, c.token, "results/x.json")
    await store.complete(job_id, again.token, "results/x.json", cost=0.25)
    done = await store.get(job_id)
    assert done.state is JobState.SUCCEEDED and done.cost == 0.25 and done.result == "results/x.json"
    await store.redis.aclose()


async def test_heartbeat_extends_every_lease_of_a_worker(backend_url: str) -> None:
    from offload.connection import connect

    now = [9_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=1000, excuse_outages=False)
    ids = await store.enqueue_many("q", [JobSpec(input=i) for i in range(50)])
    claimed = await store.claim("q", "w1", 50)
    for _ in range(5):
        now[0] += 900
        reply = await store.heartbeat("q", "w1", [c.id for c in claimed])
        assert reply.lost == []
    assert (await store.reap("q"))[1] == 0
    stats = await store.stats("q")
    assert stats.counts["active"] == 50
    now[0] += 1001
    assert (await store.reap("q"))[1] == 50
    assert (await store.heartbeat("q", "w1", ids[:2])).lost == ids[:2]
    await store.redis.aclose()


async def test_fail_retries_with_backoff_then_dead(store: QueueStore) -> None:
    job_id = await store.enqueue("q", JobSpec(input=1, max_attempts=2))
    (c,) = await store.claim("q", "w", 1)
    assert await store.fail(job_id, c.token, "HTTP 503", delay_ms=0) == "retrying"
    assert (await store.get(job_id)).state is JobState.RETRYING
    (c2,) = await store.claim("q", "w", 1)
    assert c2.attempt == 2
    assert await store.fail(job_id, c2.token, "HTTP 503 again", delay_ms=0) == "dead"
    job = await store.get(job_id)
    assert job.state is JobState.DEAD and job.error == "HTTP 503 again"


async def test_fatal_failure_goes_dead_at_once(store: QueueStore) -> None:
    job_id = await store.enqueue("q", JobSpec(input=1, max_attempts=5))
    (c,) = await store.claim("q", "w", 1)
    assert await store.fail(job_id, c.token, "HTTP 400 bad prompt", retryable=False) == "dead"
    dead, _ = await store.list_jobs("q", "dead")
    assert [j.id for j in dead] == [job_id]
    assert await store.requeue_dead("q") == [job_id]
    requeued = await store.get(job_id)
    assert requeued.state is JobState.QUEUED and requeued.attempts == 0


def test_backoff_grows_exponentially_with_jitter() -> None:
    for attempt in range(1, 8):
        ceiling = min(300_000, 1000 * 2 ** (attempt - 1))
        delays = [retry_delay_ms(attempt) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1


def test_a_backoff_far_past_its_cap_stays_at_the_cap() -> None:
    """An idle worker's claim loop counts its empty rounds without end: at the 1,025th (8.5 minutes at its 0.5 s
    cap) 2.0 ** 1024 overflowed a float and the worker died of an OverflowError."""
    assert compute_backoff(1025, base=0.02, cap=0.5) == 0.5
    assert compute_backoff(10**9, base=1.0, cap=30.0) == 30.0
    assert 150_000 <= retry_delay_ms(5000) <= 300_000
    waits = Backoff(0.02, 0.5)
    assert [waits.next() for _ in range(2000)][-1] == 0.5


async def test_cancel_waiting_and_active_jobs(store: QueueStore) -> None:
    waiting = await store.enqueue("q", JobSpec(input=1, priority=-1))
    running = await store.enqueue("q", JobSpec(input=2, priority=1))
    (c,) = await store.claim("q", "w", 1)
    assert c.id == running
    assert await store.cancel(waiting) == "cancelled"
    assert await store.cancel(running) == "requested"
    assert (await store.get(running)).cancel_requested
    reply = await store.heartbeat("q", "w", [running])
    assert reply.cancel_requested == [running]
    await store.ack_cancel(running, c.token)
    assert (await store.get(running)).state is JobState.CANCELLED
    with pytest.raises(InvalidTransition):
        await store.cancel(running)


async def test_hold_and_release_do_not_use_an_attempt(store: QueueStore) -> None:
    job_id = await store.enqueue("q", JobSpec(input=1))
    (c,) = await store.claim("q", "w", 1)
    await store.hold(job_id, c.token, "daily job cap reached")
    held = await store.get(job_id)
    assert held.state is JobState.HELD and held.attempts == 0
    assert await store.release("q") == [job_id]
    (c2,) = await store.claim("q", "w", 1)
    assert c2.attempt == 1


async def test_pause_stops_claims_and_resume_restarts(store: QueueStore) -> None:
    await store.enqueue("q", JobSpec(input=1))
    await store.pause("q")
    assert await store.claim("q", "w", 10) == []
    assert (await store.stats("q")).paused
    await store.resume("q")
    assert len(await store.claim("q", "w", 10)) == 1


async def test_release_leases_keeps_remote_id_without_counting_expiry(store: QueueStore) -> None:
    job_id = await store.enqueue("q", JobSpec(input=1))
    (c,) = await store.claim("q", "w", 1)
    await store.checkpoint(job_id, c.token, "fal", "req-1")
    assert await store.release_leases("q", "w") == 1
    job = await store.get(job_id)
    assert job.state is JobState.QUEUED and job.remote_id == "req-1" and job.lease_expiries == 0


async def test_stats_and_listing(store: QueueStore) -> None:
    ids = await store.enqueue_many("q", [JobSpec(input=i) for i in range(120)])
    stats = await store.stats("q")
    assert stats.counts["queued"] == 120 and stats.oldest_ready_age_ms is not None
    page1, cursor = await store.list_jobs("q", "queued", limit=100)
    assert cursor == 100 and [j.id for j in page1] == ids[:100]
    page2, end = await store.list_jobs("q", "queued", cursor=cursor, limit=100)
    assert end is None and [j.id for j in page2] == ids[100:]
    assert await store.queues() == ["q"]
    assert await store.purge("q", "queued") == 120
    assert (await store.stats("q")).counts["queued"] == 0


async def test_events_stream_records_state_changes(store: QueueStore) -> None:
    job_id = await store.enqueue("q", JobSpec(input=1))
    (c,) = await store.claim("q", "w", 1)
    await store.complete(job_id, c.token, "results/a.json")
    events = await store.events("q", "0")
    assert [(e["state"], e["jobs"]) for _, e in events] == [
        ("queued", job_id),
        ("active", job_id),
        ("succeeded", job_id),
    ]


async def test_retention_deletes_finished_records(backend_url: str) -> None:
    from offload.connection import connect

    now = [2_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    job_id = await store.enqueue("q", JobSpec(input=1, retention=60))
    (c,) = await store.claim("q", "w", 1)
    await store.complete(job_id, c.token, "r")
    now[0] += 59_000
    assert (await store.reap("q"))[2] == 0
    now[0] += 2_000
    assert (await store.reap("q"))[2] == 1
    with pytest.raises(JobNotFound):
        await store.get(job_id)
    await store.redis.aclose()


async def test_tutorial_ingest_moves_jobs_and_dead_letters_malformed(store: QueueStore) -> None:
    await redis_admin(store.redis).rpush(
        "gpu:jobs",
        '{"id": "abc123", "input": {"prompt": "a poem"}, "output_key": "results/abc123.json", "attempt": 1}',
        "{not json",
        '{"input": {"prompt": "no id"}}',
        '{"id": "x", "output_key": "results/x.json"}',
    )
    assert await store.ingest("gpu:jobs", "gpu") == (1, 3)
    assert await redis_admin(store.redis).llen("gpu:jobs") == 0
    job = await store.get("gpu:abc123")
    assert job.state is JobState.QUEUED and job.output_key == "results/abc123.json"
    assert job.input == {"prompt": "a poem"}
    dead, _ = await store.list_jobs("gpu", "dead")
    reasons = sorted(j.error or "" for j in dead)
    assert any("invalid JSON" in r for r in reasons)
    assert any('"id" is missing' in r for r in reasons)
    assert any('"input" is missing' in r for r in reasons)
    assert {j.raw for j in dead} == {
        "{not json",
        '{"input": {"prompt": "no id"}}',
        '{"id": "x", "output_key": "results/x.json"}',
    }
    # the same tutorial job pushed twice is not duplicated
    await redis_admin(store.redis).rpush("gpu:jobs", '{"id": "abc123", "input": {"prompt": "a poem"}}')
    assert await store.ingest("gpu:jobs", "gpu") == (1, 0)
    assert (await store.stats("gpu")).counts["queued"] == 1


@pytest.mark.parametrize("name", ["", "has space", "{tag}", "a:b", "x" * 101, "-lead", "é"])
async def test_illegal_queue_names_are_rejected(store: QueueStore, name: str) -> None:
    with pytest.raises(InvalidQueueName, match="invalid queue name"):
        await store.enqueue(name, JobSpec(input=1))


async def test_payload_over_the_limit_is_rejected(backend_url: str) -> None:
    from offload.connection import connect

    store = QueueStore(await connect(backend_url), max_payload=1000)
    with pytest.raises(PayloadTooLarge, match="over the limit of 1000 bytes"):
        await store.enqueue("q", JobSpec(input="x" * 1000))
    assert await store.enqueue("q", JobSpec(input="x" * 990))
    await store.redis.aclose()


async def test_default_payload_limit_is_one_mebibyte(store: QueueStore) -> None:
    with pytest.raises(PayloadTooLarge):
        await store.enqueue("q", JobSpec(input="x" * (1 << 20)))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (JobSpec(input=1, priority=5000), "priority"),
        (JobSpec(input=1, max_attempts=0), "max_attempts"),
        (JobSpec(input=1, delay=-1), "delay"),
        (JobSpec(input={1, 2}), "JSON-serialisable"),
        (JobSpec(input=1, output_key="a\tb"), "output_key"),
    ],
)
async def test_invalid_job_options_name_the_problem(store: QueueStore, spec: JobSpec, message: str) -> None:
    with pytest.raises(InvalidJob, match=message):
        await store.enqueue("q", spec)


async def test_unknown_job_ids(store: QueueStore) -> None:
    with pytest.raises(JobNotFound, match="not found"):
        await store.get("q:doesnotexist")
    with pytest.raises(JobNotFound):
        await store.cancel("q:doesnotexist")
    with pytest.raises(InvalidJob, match="invalid job id"):
        await store.get("no-queue-part")


async def test_payload_limit_from_the_environment(backend_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from offload.connection import connect

    monkeypatch.setenv("OFFLOAD_MAX_PAYLOAD", "64")
    store = QueueStore(await connect(backend_url))
    with pytest.raises(PayloadTooLarge, match="limit of 64 bytes"):
        await store.enqueue("q", JobSpec(input="y" * 100))
    await store.redis.aclose()


async def test_claims_delete_expired_records_without_a_separate_reaper(backend_url: str) -> None:
    from offload.connection import connect

    now = [3_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    done = await store.enqueue("q", JobSpec(input=1, retention=10))
    (c,) = await store.claim("q", "w", 1)
    await store.complete(done, c.token, "r")
    now[0] += 11_000
    assert await store.claim("q", "w", 1) == []
    with pytest.raises(JobNotFound):
        await store.get(done)
    assert (await store.stats("q")).counts["succeeded"] == 0
    await store.redis.aclose()


async def test_batched_checkpoint_answers_per_item(store: QueueStore) -> None:
    """One call records many remote ids; a stale token or unknown id fails only its own item."""
    ids = await store.enqueue_many("q", [JobSpec(input={"n": n}) for n in range(3)])
    claimed = await store.claim("q", "w1", 3)
    await store.cancel(claimed[2].id)
    codes = await store.checkpoint_many(
        "q",
        [
            (claimed[0].id, claimed[0].token, "gpu", "r-0"),
            (claimed[1].id, "w1/999999", "gpu", "r-1"),
            ("q:0000000000000000", "w1/1", "gpu", "r-x"),
            (claimed[2].id, claimed[2].token, "gpu", "r-2"),
        ],
    )
    assert codes == ["OK", "STALE", "NOTFOUND", "OK:CANCEL"]
    first, second = await store.get(ids[0]), await store.get(ids[1])
    assert (first.state, first.remote_id) == (JobState.SUBMITTED, "r-0")
    assert (second.state, second.remote_id) == (JobState.ACTIVE, None)


async def test_batched_reservations_decide_in_order_and_count_once(backend_url: str) -> None:
    """Five reservations against a cap of three: the first three pass, the rest are capped, and a job already
    counted in the window passes again without taking another slot. The window is the UTC day of the store's
    clock (here a virtual one, a minute before and a minute after midnight)."""
    now = [int(datetime(2026, 11, 29, 23, 59, tzinfo=UTC).timestamp() * 1000)]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    verdicts = await store.reserve_many("q", [(f"q:{n:016x}", 0.0) for n in range(5)], job_cap=3, spend_cap=None)
    assert verdicts == [None, None, None, "jobs", "jobs"]
    again = await store.reserve_many(
        "q", [("q:0000000000000001", 0.0), ("q:00000000000000ff", 0.0)], job_cap=3, spend_cap=None
    )
    assert again == [None, "jobs"]
    assert await store.usage("q") == ("20261129", 3, 0.0)
    now[0] += 120_000
    spend = await store.reserve_many("q", [("q:a", 0.4), ("q:b", 0.4), ("q:c", 0.1)], job_cap=None, spend_cap=1.0)
    assert spend == [None, None, None]  # 0.4 + 0.4 + 0.1 fits under 1.0, and the new day's job cap is unspent
    window, jobs, spent = await store.usage("q")
    assert window == "20261130" and spent <= 1.0 and jobs == sum(v is None for v in spend)
    await store.redis.aclose()


async def test_forgive_returns_a_preempted_workers_jobs_without_using_an_attempt(backend_url: str) -> None:
    """A machine taken away by its provider: held leases go back uncounted, expiries the reaper already counted
    are refunded, and a job that expiry had sent dead is ready again (remote id kept)."""
    from offload.connection import connect

    now = [9_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=1000, excuse_outages=False)
    doomed = await store.enqueue("q", JobSpec(input=1, max_attempts=1))
    held = await store.enqueue("q", JobSpec(input=2, max_attempts=1))
    (c,) = await store.claim("q", "r-gone", 1)
    await store.checkpoint(c.id, c.token, "runpod", "rp-7")
    now[0] += 1001
    assert (await store.reap("q"))[1] == 1  # counted: expiries 1 (of a budget of 1)
    (c,) = await store.claim("q", "r-gone", 1)
    assert c.id == doomed
    now[0] += 1001
    await store.reap("q")  # a second expiry: dead, "lease expired"
    assert (await store.get(doomed)).state is JobState.DEAD
    (h,) = await store.claim("q", "r-gone", 1)
    assert h.id == held
    released, refunded, revived = await store.forgive("q", "r-gone")
    assert (released, refunded, revived) == (1, 2, 1)
    for job_id in (doomed, held):
        job = await store.get(job_id)
        assert job.state in (JobState.QUEUED, JobState.SUBMITTED) and job.attempts == 0, job
    back = await store.get(doomed)
    assert back.lease_expiries == 0 and back.remote_id == "rp-7" and back.error is None
    assert await store.forgive("q", "r-gone") == (0, 0, 0)  # once only
    assert {j.id for j in await store.claim("q", "w2", 5)} == {doomed, held}
    await store.redis.aclose()
