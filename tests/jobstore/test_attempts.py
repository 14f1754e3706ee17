"""A job's attempts (issue 41, item 4; lua/includes/attempts.lua, offload/queue/attempts.py): one per lease, the
current one read from the job's record, each ended one written by the script that ended it (fail, the reaper, a
release, a hold, a cancel), bounded to the first 5 and the last 45 ended ones, deleted with the job (purge,
retention), in the job's hash slot on a cluster. Real Valkey 9 and Redis 7 (`backend_url`), a virtual store clock
so times and durations are exact."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.crc import key_slot
from support.admin_redis import redis_admin
from support.servers import ValkeyCluster

from offload.connection import connect
from offload.errors import JobNotFound
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.attempts import ATTEMPTS_HEAD, ATTEMPTS_TAIL
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

T0 = 20_000 * 86_400_000 + 3_600_000  # 2024-10-04 01:00 UTC, in ms


@pytest.fixture
async def clocked(backend_url: str) -> AsyncIterator[tuple[QueueStore, list[int]]]:
    now = [T0]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=10_000, excuse_outages=False)
    yield store, now
    await store.redis.aclose()


async def test_two_failures_then_success_are_three_attempts(clocked: tuple[QueueStore, list[int]]) -> None:
    store, now = clocked
    job_id = await store.enqueue("q", JobSpec(input=1, max_attempts=5))
    tokens, errors = [], ["HTTP 500: <b>boom</b>", "remote job failed: CUDA out of memory"]
    for i, error in enumerate(errors):
        (job,) = await store.claim("q", f"host-a:{i}", 1)
        tokens.append(job.token)
        (begun,) = await store.begin_many("q", [(job.id, job.token, 0.0)], backend="runpod")
        await store.checkpoint_many("q", [(job.id, job.token, "runpod", f"rp-{i}", begun.submission)])
        now[0] += 2_000
        assert await store.fail(job.id, job.token, error, delay_ms=0, answered=True, cost=0.01) == "retrying"
        now[0] += 1_000
    (job,) = await store.claim("q", "r-gpu1", 1)
    tokens.append(job.token)
    (begun,) = await store.begin_many("q", [(job.id, job.token, 0.0)], backend="replicate")
    await store.checkpoint_many("q", [(job.id, job.token, "replicate", "pred-3", begun.submission)])
    now[0] += 4_000
    await store.complete(job.id, job.token, "results/x.json", cost=0.05)
    await store.complete(job.id, job.token, "results/x.json", cost=0.05)  # a retried ack: no attempt added

    kept, made = await store.attempts(job_id)
    assert made == 3 and [a.number for a in kept] == [1, 2, 3]
    assert [a.outcome for a in kept] == ["failed", "failed", "succeeded"]
    assert [a.error for a in kept] == [*errors, None]
    assert [a.token for a in kept] == tokens
    assert [a.claimed_by for a in kept] == ["host-a:0", "host-a:1", "r-gpu1"]
    assert [(a.backend, a.remote_id) for a in kept] == [("runpod", "rp-0"), ("runpod", "rp-1"), ("replicate", "pred-3")]
    assert [a.submission for a in kept] == [1, 2, 3] and not any(a.resumed for a in kept)
    assert [a.learned_by for a in kept] == ["poll"] * 3
    assert [a.duration_ms for a in kept] == [2_000, 2_000, 4_000]
    assert [a.cost for a in kept] == [pytest.approx(0.01), pytest.approx(0.01), pytest.approx(0.05)]
    assert {a.kind for a in kept} == {"serverless"}
    assert (await store.get(job_id)).state is JobState.SUCCEEDED


async def test_a_lost_lease_then_a_resumed_attempt_without_a_new_submission(
    clocked: tuple[QueueStore, list[int]],
) -> None:
    store, now = clocked
    job_id = await store.enqueue("q", JobSpec(input=1, max_attempts=3))
    (first,) = await store.claim("q", "host-a:1", 1)
    (begun,) = await store.begin_many("q", [(first.id, first.token, 0.0)])
    await store.checkpoint_many("q", [(first.id, first.token, "runpod", "rp-9", begun.submission)])
    now[0] += 10_001  # host-a:1 was SIGKILLed: no heartbeat, its lease runs out
    (second,) = await store.claim("q", "host-b:2", 1)  # the claim reaps the lease first
    assert second.remote_id == "rp-9"
    now[0] += 3_000
    await store.complete(second.id, second.token, "results/y.json")

    (lost, resumed), made = await store.attempts(job_id)
    assert made == 2
    assert lost.outcome == "lease lost" and lost.claimed_by == "host-a:1" and lost.error
    assert lost.finished_at == T0 + 10_001 and lost.remote_id == "rp-9" and not lost.resumed
    assert resumed.resumed and resumed.remote_id == "rp-9" and resumed.backend == "runpod"
    assert resumed.submission == lost.submission == 1  # the same submission, polled again: nothing sent
    assert resumed.outcome == "succeeded" and resumed.duration_ms == 3_000
    job = await store.get(job_id)
    assert job.submission == 1 and job.possible_duplicates == 0


async def test_a_worker_lost_inside_the_submit_call_its_webhook_adopted_and_resumed(
    clocked: tuple[QueueStore, list[int]],
) -> None:
    store, now = clocked
    job_id = await store.enqueue("q", JobSpec(input=1, max_attempts=3))
    (first,) = await store.claim("q", "host-a:1", 1)
    (begun,) = await store.begin_many("q", [(first.id, first.token, 0.0)], backend="replicate")
    now[0] += 500  # the submit call is out; the provider's `start` webhook names its prediction; the worker dies
    assert await store.hook(job_id, begun.submission, "p-9", terminal=False, body=b"{}") == "STARTED"
    now[0] += 10_001
    (second,) = await store.claim("q", "host-b:2", 1)
    assert second.remote_id == "p-9"
    (lost, resumed), made = await store.attempts(job_id)
    assert made == 2 and lost.outcome == "lease lost" and lost.adopted and not lost.resumed
    assert (lost.remote_id, lost.backend, lost.submitted_at) == ("p-9", "replicate", T0 + 500)
    assert resumed.resumed and not resumed.adopted and resumed.remote_id == "p-9" and resumed.outcome is None


async def test_webhook_answer_release_hold_and_cancel_outcomes(clocked: tuple[QueueStore, list[int]]) -> None:
    store, now = clocked
    hooked, drained, held, cancelled, sync = await store.enqueue_many("q", [JobSpec(input=i) for i in range(5)])
    jobs = {j.id: j for j in await store.claim("q", "host-a:1", 5)}
    subs = await store.begin_many("q", [(i, jobs[i].token, 0.0) for i in (hooked, cancelled, sync)])
    # Replicate's `start` webhook before the submitter's own checkpoint: recorded, but no adoption
    assert await store.hook(hooked, subs[0].submission, "p-1", terminal=False, body=b"{}") == "STARTED"
    now[0] += 1_500  # a synchronous API answers the submit with the result: the ack records the run
    await store.complete_many("q", [(sync, jobs[sync].token, "results/s.json", 0.02, "openai", "chatcmpl-1", 1)])
    await store.checkpoint_many("q", [(hooked, jobs[hooked].token, "replicate", "p-1", subs[0].submission)])
    assert await store.hook(hooked, subs[0].submission, "p-1", terminal=True, body=b"{}") == "WAKE"
    await store.complete(hooked, jobs[hooked].token, "results/h.json")
    await store.release_leases("q", "host-a:1", [drained])
    await store.hold(held, jobs[held].token, "daily jobs cap reached (window 20241004)", "20241004")
    await store.cancel(cancelled)
    await store.ack_cancel(cancelled, jobs[cancelled].token)

    ends = {i: (await store.attempts(i))[0][-1] for i in (hooked, drained, held, cancelled, sync)}
    assert ends[hooked].outcome == "succeeded" and ends[hooked].learned_by == "webhook"
    assert not ends[hooked].adopted and not ends[hooked].resumed and ends[hooked].remote_id == "p-1"
    assert ends[sync].learned_by == "response" and ends[sync].remote_id == "chatcmpl-1"
    assert ends[sync].duration_ms == 1_500 and ends[sync].cost == pytest.approx(0.02)
    assert ends[drained].outcome == "released" and ends[drained].error is None
    assert ends[held].outcome == "held" and ends[held].error == "daily jobs cap reached (window 20241004)"
    assert ends[cancelled].outcome == "cancelled"


async def test_sixty_attempts_keep_the_first_five_and_the_last_forty_five(
    clocked: tuple[QueueStore, list[int]],
) -> None:
    store, now = clocked
    job_id = await store.enqueue("q", JobSpec(input=1, max_attempts=100))
    for i in range(60):
        (job,) = await store.claim("q", "w:1", 1)
        assert await store.fail(job.id, job.token, f"error {i + 1}", delay_ms=0) == "retrying"
        now[0] += 10
    kept, made = await store.attempts(job_id)
    assert made == 60 and len(kept) == ATTEMPTS_HEAD + ATTEMPTS_TAIL
    assert [a.number for a in kept] == [*range(1, 6), *range(16, 61)]
    assert all(a.error == f"error {a.number}" and a.outcome == "failed" for a in kept)
    fields = len(await store.redis.hgetall(keyspace.attempts("q", job_id)))
    assert fields == 1 + 50  # `n` and one record per kept attempt: nothing of the dropped ones
    (running,) = await store.claim("q", "w:2", 1)  # the 61st: read from the job's record, not written yet
    kept, made = await store.attempts(job_id)
    assert made == 61 and kept[-1].number == 61 and kept[-1].outcome is None and kept[-1].claimed_by == "w:2"
    assert kept[-1].token == running.token and kept[-1].to_dict()["token"] is None  # a live lease's token: not shown


async def test_purge_and_retention_delete_the_attempts(clocked: tuple[QueueStore, list[int]]) -> None:
    store, now = clocked
    kept_a_minute, dead = await store.enqueue_many("q", [JobSpec(input=1, retention=60), JobSpec(input=2)])
    for job in await store.claim("q", "w:1", 2):  # each has an ended attempt, so an attempts hash
        assert await store.fail(job.id, job.token, "boom", delay_ms=0, retryable=job.id != dead) in ("retrying", "dead")
    (again,) = await store.claim("q", "w:1", 1)
    await store.complete(again.id, again.token, "results/a.json")
    keys = [keyspace.attempts("q", i) for i in (kept_a_minute, dead)]
    assert await store.redis.exists(*keys) == 2

    assert await store.purge("q", "dead") == 1
    assert await store.redis.exists(keys[1]) == 0
    with pytest.raises(JobNotFound):
        await store.attempts(dead)
    now[0] += 61_000
    await store.reap("q")  # the retention ran out: record and attempts go together
    assert await store.redis.exists(keys[0]) == 0
    with pytest.raises(JobNotFound):
        await store.get(kept_a_minute)


async def test_on_a_cluster_the_attempts_live_in_the_job_slot(tmp_path: Path) -> None:
    """Every script that writes an attempt runs on the node of the job's queue: the key must hash there too."""
    with ValkeyCluster(tmp_path) as cluster:
        redis = await connect(cluster.url + "?cluster=1")
        await redis_admin(redis).flushall()
        store = QueueStore(redis)
        try:
            for queue in ("a", "b", "c", "d"):
                job_id = await store.enqueue(queue, JobSpec(input=1, max_attempts=2))
                key = keyspace.attempts(queue, job_id)
                assert key_slot(key.encode()) == key_slot(keyspace.job(queue, job_id).encode())
                (job,) = await store.claim(queue, "w:1", 1)
                assert await store.fail(job.id, job.token, "boom", delay_ms=0) == "retrying"
                (job,) = await store.claim(queue, "w:1", 1)
                await store.complete(job.id, job.token, "results/r.json")
                kept, made = await store.attempts(job_id)
                assert made == 2 and [a.outcome for a in kept] == ["failed", "succeeded"]
                assert await store.purge_ids(queue, "succeeded", [job_id]) == 1
                assert await redis.exists(key) == 0
        finally:
            await redis.aclose()
