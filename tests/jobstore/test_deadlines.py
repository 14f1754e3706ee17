"""A job's deadline and max_cost in the store: recorded at enqueue (absolute, or relative to the store's clock),
refused when impossible, and a job past its deadline failed `deadline passed` at claim or instead of a retry,
never handed out, on a virtual clock and on a Valkey whose own clock steps forward."""

from __future__ import annotations

import time

import pytest
from support.servers import ValkeyServer
from test_clock import step_store_clock, store_now

from offload import InvalidJob
from offload.connection import connect
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.specs import JobSpec, validate_spec
from offload.queue.store import QueueStore

HOUR_S = 3600
DAY_S = 86_400


def _now_ms() -> list[int]:
    return [int(time.time() * 1000)]  # a virtual clock, started at the real time: enqueue checks the past by it


@pytest.mark.parametrize(
    ("spec", "field", "says"),
    [
        (JobSpec(input=1, deadline=time.time() - 5), "deadline", "in the past"),
        # a day ahead, not a minute: the specs are made at collection, minutes before a loaded suite runs them
        (
            JobSpec(input=1, deadline=time.time() + DAY_S, run_at=time.time() + 2 * DAY_S),
            "deadline",
            "not after the job's",
        ),
        (JobSpec(input=1, deadline=time.time() + DAY_S, delay=2 * DAY_S), "deadline", "not after the job's"),
        (JobSpec(input=1, deadline_in=30, delay=60), "deadline_in", "not after the job's start"),
        (JobSpec(input=1, deadline_in=0), "deadline_in", "must be > 0"),
        (JobSpec(input=1, deadline=time.time() + DAY_S, deadline_in=60), "deadline_in", "either deadline or"),
        (JobSpec(input=1, max_cost=-0.01), "max_cost", ">= 0"),
        (JobSpec(input=1, max_cost=float("nan")), "max_cost", ">= 0"),
        (JobSpec(input=1, max_cost="1"), "max_cost", ">= 0"),  # type: ignore[arg-type]
    ],
)
def test_an_impossible_deadline_or_max_cost_is_refused_in_one_line(spec: JobSpec, field: str, says: str) -> None:
    with pytest.raises(InvalidJob) as exc:
        validate_spec(spec)
    assert says in str(exc.value) and "\n" not in str(exc.value)
    assert exc.value.field == field


async def test_enqueue_records_the_deadline_in_epoch_ms_and_the_max_cost(backend_url: str) -> None:
    """An absolute deadline as given, a relative one from the store's now; one bulk call with both, and jobs
    without either (their records have neither field)."""
    now = _now_ms()
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    at = now[0] / 1000 + 7200
    absolute, relative, plain = await store.enqueue_many(
        "q",
        [
            JobSpec(input=1, deadline=at, max_cost=0.05),
            JobSpec(input=2, deadline_in=90, delay=30, max_cost=0),
            JobSpec(input=3),
        ],
    )
    first, second, third = [await store.get(i) for i in (absolute, relative, plain)]
    assert (first.deadline, first.max_cost) == (int(at * 1000), 0.05)
    assert (second.deadline, second.max_cost, second.state) == (now[0] + 90_000, 0.0, JobState.DELAYED)
    assert (third.deadline, third.max_cost) == (None, None)
    assert first.to_dict()["deadline"] == int(at * 1000) and first.to_dict()["max_cost"] == 0.05
    await store.redis.aclose()


async def test_a_job_past_its_deadline_is_failed_at_claim_not_handed_out(backend_url: str) -> None:
    now = _now_ms()
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    late, on_time, no_deadline = await store.enqueue_many(
        "q", [JobSpec(input=1, deadline_in=10), JobSpec(input=2, deadline_in=3600), JobSpec(input=3)]
    )
    now[0] += 10_000  # the deadline itself: too late to start
    claimed = await store.claim("q", "w", 10)
    assert [c.id for c in claimed] == [on_time, no_deadline]
    job = await store.get(late)
    assert (job.state, job.error, job.attempts) == (JobState.DEAD, "deadline passed", 0)
    stats = await store.stats("q")
    assert stats.totals["deadline_passed"] == 1 and stats.counts["dead"] == 1
    events = await store.redis.xrange(keyspace.events("q"), "-", "+")
    assert [f["jobs"] for _, f in events if f["state"] == "deadline_passed"] == [late]
    await store.redis.aclose()


async def test_a_delayed_job_whose_deadline_passes_while_delayed_never_starts(backend_url: str) -> None:
    now = _now_ms()
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    job_id = await store.enqueue("q", JobSpec(input=1, delay=30, deadline_in=60))
    assert await store.claim("q", "w", 5) == []  # not due yet
    now[0] += 61_000  # due since 31 s, but its deadline passed meanwhile (no claim ran: an idle queue)
    assert await store.claim("q", "w", 5) == []
    job = await store.get(job_id)
    assert job.state is JobState.DEAD and job.error == "deadline passed"
    await store.redis.aclose()


async def test_a_retry_is_not_scheduled_past_the_deadline(backend_url: str) -> None:
    """A retry due before the deadline is scheduled; one due at or after it ends the job with the reason and the
    last error."""
    now = _now_ms()
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    job_id = await store.enqueue("q", JobSpec(input=1, deadline_in=60, max_attempts=5))
    (c,) = await store.claim("q", "w", 1)
    assert await store.fail(c.id, c.token, "remote 503", delay_ms=20_000) == "retrying"
    now[0] += 20_000
    (c,) = await store.claim("q", "w", 1)
    assert await store.fail(c.id, c.token, "remote 503", delay_ms=40_000) == "dead"  # due at 60 s: the deadline
    job = await store.get(job_id)
    assert job.state is JobState.DEAD and job.attempts == 2
    assert job.error == "deadline passed before the retry; last error: remote 503"
    assert (await store.stats("q")).totals["deadline_passed"] == 1
    await store.redis.aclose()


async def test_a_job_running_at_its_deadline_is_not_stopped(backend_url: str) -> None:
    """Its remote job may be paid already: a new owner after a lease expiry resumes it past the deadline."""
    now = _now_ms()
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=1000, excuse_outages=False)
    job_id = await store.enqueue("q", JobSpec(input=1, deadline_in=5))
    (c,) = await store.claim("q", "w1", 1)
    await store.checkpoint(c.id, c.token, "runpod", "rp-1")
    now[0] += 10_000  # w1's lease ended, and the deadline passed
    (again,) = await store.claim("q", "w2", 1)
    assert again.id == job_id and again.remote_id == "rp-1"
    await store.complete(job_id, again.token, "results/x.json")
    assert (await store.get(job_id)).state is JobState.SUCCEEDED
    await store.redis.aclose()


async def test_the_stores_clock_decides_the_deadline(stepped_valkey: ValkeyServer) -> None:
    """No virtual clock: the deadline is counted from Valkey's TIME at enqueue, and the claim fails the job once
    Valkey's own clock has passed it, whatever the producer's and the worker's clocks say."""
    redis = await connect(stepped_valkey.url)
    store = QueueStore(redis)
    try:
        before = await store_now(redis)
        job_id = await store.enqueue("q", JobSpec(input=1, deadline_in=HOUR_S))
        recorded = (await store.get(job_id)).deadline
        assert recorded is not None and 0 <= recorded - (before + HOUR_S) * 1000 < 5000
        await step_store_clock(stepped_valkey, redis, 2 * HOUR_S)
        assert await store.claim("q", "w", 5) == []
        assert (await store.get(job_id)).error == "deadline passed"
    finally:
        await redis.aclose()
