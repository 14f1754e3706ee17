"""A queue served by GPU workers and serverless overflow (pick.lua): a GPU worker's claim ("fleet") never takes a
job a dispatch worker may have sent to a provider, the overflow worker's claim ("overflow") takes those first and
then only the jobs the fleet will not start within `after` by the autoscaler's reach, the jobs that waited `after`
already, and the jobs whose deadline falls before their predicted start plus a run. Every job goes to one kind."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator

import pytest

from offload.autoscale.hybrid import publish_reach
from offload.connection import connect
from offload.models import ClaimMode
from offload.queue import keyspace
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

Q = "mixed"
LEASE_MS = 30_000
AFTER_S = 300.0


@pytest.fixture
async def clocked(backend_url: str) -> AsyncIterator[tuple[QueueStore, list[int], RedisClient]]:
    """A store on a virtual clock (ms), started at the real time; a jump of the clock is no outage."""
    redis = await connect(backend_url)
    now = [int(time.time() * 1000)]
    yield QueueStore(redis, clock_ms=lambda: now[0], excuse_outages=False), now, redis  # a lapse is a lapse
    await redis.aclose()


async def _claim(store: QueueStore, who: str, n: int, mode: ClaimMode) -> list[str]:
    jobs = await store.claim(Q, who, n, LEASE_MS, mode=mode, after_s=AFTER_S)
    return [j.id for j in jobs]


async def _enqueue(store: QueueStore, n: int, **spec: object) -> list[str]:
    return await store.enqueue_many(Q, [JobSpec(input={"i": i}, **spec) for i in range(n)])  # type: ignore[arg-type]


async def test_a_gpu_worker_never_takes_a_job_overflow_may_have_sent(
    clocked: tuple[QueueStore, list[int], RedisClient],
) -> None:
    """Overflow sends one job (remote id recorded) and begins another (intent open), then dies: the leases
    lapse and both go back to ready ahead of the rest. The fleet takes the others and leaves those two;
    the next overflow claim resumes exactly them."""
    store, now, redis = clocked
    ids = await _enqueue(store, 5)
    await publish_reach(redis, Q, 0, 0, AFTER_S, 60, 600)  # the fleet starts nothing in time: all overflow's
    sent, begun = await store.claim(Q, "api-1", 2, LEASE_MS, mode="overflow", after_s=AFTER_S)
    assert [sent.id, begun.id] == ids[:2]
    verdicts = await store.begin_many(Q, [(sent.id, sent.token, 0.0), (begun.id, begun.token, 0.0)])
    assert [v.verdict for v in verdicts] == ["OK", "OK"]
    await store.checkpoint(sent.id, sent.token, "sim", "remote-1")
    now[0] += LEASE_MS + 1  # api-1 died: its leases lapse and the next claim reaps them

    fleet = await _claim(store, "gpu-1", 5, "fleet")
    assert fleet == ids[2:]
    assert await redis.zrange(keyspace.state_set(Q, "queued"), 0, -1) == [ids[0], ids[1]]
    assert await _claim(store, "gpu-2", 5, "fleet") == []  # and a second look changes nothing
    resumed = await store.claim(Q, "api-2", 5, LEASE_MS, mode="overflow", after_s=AFTER_S)
    assert [(j.id, j.remote_id, j.intent_open) for j in resumed] == [
        (ids[0], "remote-1", False),
        (ids[1], None, True),
    ]


async def test_overflow_takes_only_what_the_fleet_will_not_start_in_time(
    clocked: tuple[QueueStore, list[int], RedisClient],
) -> None:
    """Reach 3 of 6: overflow gets positions 3-5, the fleet 0-2; a plain claim would have taken the head."""
    store, _, redis = clocked
    ids = await _enqueue(store, 6)
    await publish_reach(redis, Q, 3.7, 1, AFTER_S, 60, 600)
    assert await _claim(store, "api-1", 10, "overflow") == ids[3:]
    assert await _claim(store, "gpu-1", 10, "fleet") == ids[:3]


async def test_a_job_that_waited_after_goes_to_overflow_without_any_reach(
    clocked: tuple[QueueStore, list[int], RedisClient],
) -> None:
    """No autoscaler estimate (none written, or expired): overflow takes only what waited `after` already."""
    store, now, _ = clocked
    old = await _enqueue(store, 2)
    now[0] += int(AFTER_S * 1000) - 1
    fresh = await _enqueue(store, 2)
    assert await _claim(store, "api-1", 10, "overflow") == []
    now[0] += 1
    assert await _claim(store, "api-1", 10, "overflow") == old
    assert await _claim(store, "gpu-1", 10, "fleet") == fresh


async def test_an_expired_reach_leaves_the_waited_rule(clocked: tuple[QueueStore, list[int], RedisClient]) -> None:
    store, _, redis = clocked
    ids = await _enqueue(store, 3)
    await publish_reach(redis, Q, 0, 0, AFTER_S, 60, 0.05)
    assert await redis.pttl(keyspace.overflow_reach(Q)) <= 50
    await redis.delete(keyspace.overflow_reach(Q))  # what its expiry does, without waiting for it
    assert await _claim(store, "api-1", 10, "overflow") == []
    assert await _claim(store, "gpu-1", 10, "fleet") == ids


async def test_a_deadline_before_the_predicted_start_goes_to_overflow(
    clocked: tuple[QueueStore, list[int], RedisClient],
) -> None:
    """Reach 10 (all in time by `after`), no idle machine, one start a minute, a 1-minute run. A job third in
    line starts in ~3 min and ends in ~4: a deadline in 3.5 min sends it to overflow; the first job, started in
    ~1 min, keeps a 5-minute deadline on the fleet."""
    store, _, redis = clocked
    first = await store.enqueue(Q, JobSpec(input=0, deadline_in=300))
    second = await store.enqueue(Q, JobSpec(input=1))
    third = await store.enqueue(Q, JobSpec(input=2, deadline_in=210))
    await publish_reach(redis, Q, 10, 0, 600, 60, 600)  # per position: 600 s / 10 = 1 min
    assert await _claim(store, "api-1", 10, "overflow") == [third]
    assert await _claim(store, "gpu-1", 10, "fleet") == [first, second]


async def test_interleaved_claims_of_both_kinds_give_every_job_to_exactly_one(
    clocked: tuple[QueueStore, list[int], RedisClient],
) -> None:
    """300 jobs, the reach changing between claims, both kinds claiming random batch sizes. A GPU worker finishes
    what it takes; overflow opens each job's intent, records a remote id for some, finishes some, and now and
    then dies (every lease lapses): its unfinished jobs come back to ready, and only overflow takes them again."""
    store, now, redis = clocked
    rng = random.Random(7)
    ids = await _enqueue(store, 300, max_attempts=100)  # lapses count against attempts: none may go dead here
    by: dict[str, set[str]] = {"fleet": set(), "overflow": set()}
    for round_no in range(1000):
        if not await redis.zcard(keyspace.state_set(Q, "queued")) and not await redis.zcard(
            keyspace.state_set(Q, "active")
        ):
            break
        await publish_reach(redis, Q, rng.uniform(0, 40), rng.randint(0, 3), AFTER_S, 60, 600)
        mode: ClaimMode = rng.choice(["fleet", "overflow"])
        jobs = await store.claim(Q, f"{mode}-{round_no}", rng.randint(1, 12), LEASE_MS, mode=mode, after_s=AFTER_S)
        for job in jobs:
            other = "overflow" if mode == "fleet" else "fleet"
            assert job.id not in by[other], f"{job.id} claimed by {mode} after {other} had it"
            by[mode].add(job.id)
            if mode == "fleet":
                await store.complete(job.id, job.token, "r")
                continue
            if not job.remote_id and not job.intent_open:
                await store.begin_many(Q, [(job.id, job.token, 0.0)])
                if rng.random() < 0.5:
                    await store.checkpoint(job.id, job.token, "sim", f"r-{job.id}")
            if rng.random() < 0.5:
                await store.complete(job.id, job.token, "r")
        now[0] += LEASE_MS + 1 if rng.random() < 0.2 else 1000  # now and then every lease lapses
    assert by["fleet"] | by["overflow"] == set(ids)
    assert by["fleet"] and by["overflow"]
    assert await redis.zcard(keyspace.state_set(Q, "succeeded")) == 300
