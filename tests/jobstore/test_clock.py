"""One clock, the job store's: cap windows are the UTC day of Valkey's TIME, a producer's `delay`
counts from the store's now, and a step back of the store's clock moves the times it had scheduled back with it.

The clocks are real ones made wrong: a Valkey whose wall clock the test steps while it runs, and producer processes
whose clock is a day off (libfaketime, bench/chaos/faketime.py). Only the window arithmetic runs on a virtual clock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from support.admin_redis import redis_admin
from support.eventually import seconds_until
from support.server_helpers import server
from support.servers import ValkeyServer

from bench.chaos.faketime import ClockFile
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.state import periods
from offload.caps import next_window_s, window_of
from offload.config import Settings
from offload.connection import connect
from offload.eventloop import within
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.scripts import SCRIPTS
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.queue.store_clock import warn_host_skew
from offload.redis_client import RedisClient
from offload.server.registry import WorkerRegistry
from offload.server.schemas import RegisterRequest

HOUR_S, DAY_S = 3600, 86_400


async def store_now(redis: RedisClient) -> float:
    seconds, micros = await redis.time()
    return int(seconds) + int(micros) / 1e6


async def step_store_clock(valkey: ValkeyServer, redis: RedisClient, offset_s: float) -> None:
    """Set the store's clock offset and wait until its TIME shows it (libfaketime re-reads the file)."""
    assert valkey.clock is not None
    valkey.clock.set(offset_s)

    async def stepped() -> bool:
        return abs(await store_now(redis) - time.time() - offset_s) < 2

    await seconds_until(stepped, 10, f"the store's clock at {offset_s:+g} s")


async def test_the_cap_window_is_the_utc_day_of_the_stores_clock(valkey_url: str) -> None:
    """The scripts' civil date (no os.date in Valkey's Lua) against Python's, at random instants over four centuries
    and at the edges that break date arithmetic (leap days, century years, the last ms of a day); and the release
    reply's wait for the next window ends exactly at the next UTC midnight."""
    rng = random.Random(34)
    edges = [
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(2000, 2, 29, 23, 59, 59, 999_000, tzinfo=UTC),
        datetime(2000, 3, 1, tzinfo=UTC),
        datetime(2100, 2, 28, 23, 59, 59, tzinfo=UTC),
        datetime(2100, 3, 1, tzinfo=UTC),
        datetime(2024, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC),
        datetime(2025, 1, 1, tzinfo=UTC),
        datetime(2026, 11, 30, 12, tzinfo=UTC),
    ]
    instants = [int(d.timestamp() * 1000) for d in edges]
    instants += [rng.randrange(0, int(datetime(2370, 1, 1, tzinfo=UTC).timestamp() * 1000)) for _ in range(300)]
    redis = await connect(valkey_url)
    try:
        for ms in instants:
            store = QueueStore(redis, clock_ms=functools.partial(int, ms))  # the store's clock stopped at ms
            expected = window_of(ms / 1000)  # the Python rule: clock.lua keeps the same
            assert (await store.usage("q"))[0] == expected, f"window of {ms} ms"
            done = await store.release_held("q")
            assert done.window == expected
            assert round(done.next_window_s * 1000) == round(next_window_s(ms / 1000) * 1000) - ms
    finally:
        await redis.aclose()


async def test_a_step_back_of_the_stores_clock_moves_deadlines_retries_and_delays_back_once(
    stepped_valkey: ValkeyServer,
) -> None:
    """The store's clock steps back an hour while a worker is dead with jobs leased, jobs wait out a retry backoff,
    a `delay` and a `run_at`, and a job is held for a cap window of tomorrow. The next script that stamps the queue
    (here the server's maintenance, `reap`) moves the dead worker's deadline, the retry and the delay back by the
    step, once, releases the held job, and records it; the `run_at` (a time of day) stays. Then the jobs come back
    within their few seconds, not an hour."""
    redis = await connect(stepped_valkey.url)
    store = QueueStore(redis, lease_ms=8000)  # the dead worker's lease outlives the test's steps before the reap
    q = "clock"
    try:
        retry_id, leased_id, held_id = await store.enqueue_many(q, [JobSpec(input=i) for i in range(3)])
        claimed = {c.id: c for c in await store.claim(q, "dead-worker", 3)}
        assert await store.fail(retry_id, claimed[retry_id].token, "remote 5xx", delay_ms=4000) == "retrying"
        await store.hold(held_id, claimed[held_id].token, "daily jobs cap reached", "99991231")
        (delayed_id,) = await store.enqueue_many(q, [JobSpec(input="d", delay=4)])
        at = await store_now(redis)
        (run_at_id,) = await store.enqueue_many(q, [JobSpec(input="r", run_at=at + 4)])
        before = {
            name: dict(await redis_admin(redis).zrange(keyspace.prefix(q) + name, 0, -1, withscores=True))
            for name in ("workers", "retry", "delayed")
        }
        await step_store_clock(stepped_valkey, redis, -HOUR_S)

        await store.reap(q)
        events = await redis.xrange(keyspace.events(q), "-", "+")
        steps = [f for _, f in events if f["state"] == "clock_stepped_back"]
        assert len(steps) == 1, steps
        step_ms = int(steps[0]["step_ms"])
        assert HOUR_S * 1000 - 30_000 < step_ms <= HOUR_S * 1000 + 2000, step_ms  # less the time unread before it
        assert (int(steps[0]["moved"]), int(steps[0]["released"])) == (2, 1)  # the retry and the delay; the held
        after = {
            name: dict(await redis_admin(redis).zrange(keyspace.prefix(q) + name, 0, -1, withscores=True))
            for name in ("workers", "retry", "delayed")
        }
        assert after["workers"]["dead-worker"] == before["workers"]["dead-worker"] - step_ms
        assert after["retry"][retry_id] == before["retry"][retry_id] - step_ms
        assert after["delayed"][delayed_id] == before["delayed"][delayed_id] - step_ms
        assert after["delayed"][run_at_id] == before["delayed"][run_at_id], "a run_at is a time of day: it stays"
        assert (await store.get(retry_id)).run_at == after["retry"][retry_id]  # the record says so too
        await store.reap(q)
        again = [f for _, f in await redis.xrange(keyspace.events(q), "-", "+") if f["state"] == "clock_stepped_back"]
        assert len(again) == 1, "moved twice"
        assert (await store.release_held(q)).released == 1  # tomorrow's hold: the window it is in decides again

        async def back() -> bool:
            await store.reap(q)
            states = {j: (await store.get(j)).state for j in (retry_id, leased_id, delayed_id)}
            return set(states.values()) == {JobState.QUEUED}

        took = await seconds_until(back, 30, "the dead worker's job, the retry and the delayed job back in ready")
        assert took < 30  # they were due within seconds of the step
        assert (await store.get(run_at_id)).state is JobState.DELAYED  # due an hour from the store's now
    finally:
        await redis.aclose()


async def test_a_producer_whose_clock_is_a_day_off_gets_its_delay_from_the_stores_now(
    stepped_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Producer processes whose clocks are a day behind and a day ahead enqueue with delay=10: each job is due 10 s
    after the store's now (its `created_at`, stamped by the same script), not 10 s after the producer's clock."""
    code = (
        "import sys\n"
        "from offload.client import Client\n"
        "with Client(sys.argv[1]) as c:\n"
        "    print(c.enqueue('produced', {'n': sys.argv[2]}, delay=10))\n"
    )
    for skew in (-DAY_S, DAY_S):
        clock = ClockFile(tmp_path / f"producer{skew}", skew)
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", code, stepped_valkey.url, str(skew)],
            env=clock.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        redis = await connect(stepped_valkey.url)
        try:
            job = await QueueStore(redis).get(out.stdout.strip().splitlines()[-1])
        finally:
            await redis.aclose()
        assert job.state is JobState.DELAYED and job.run_at is not None
        assert abs(job.run_at - (job.created_at + 10_000)) < 1000, (skew, job.run_at - job.created_at)


async def test_the_shared_rate_limit_rides_a_step_back_of_the_stores_clock(stepped_valkey: ValkeyServer) -> None:
    """A backend's GCRA state is a time on the store's clock: after a step back of an hour, the next request waits
    one interval at most, not the hour until the clock catches up."""
    redis = await connect(stepped_valkey.url)
    args = [1000, 1]  # one request a second, no burst
    key_set = [keyspace.backend_rate("gcra"), keyspace.backend_cooldown("gcra")]
    try:
        for _ in range(3):
            await SCRIPTS.rate_acquire(redis, key_set, args)
        await step_store_clock(stepped_valkey, redis, -HOUR_S)
        wait_ms = int(await SCRIPTS.rate_acquire(redis, key_set, args))
        assert 0 <= wait_ms <= 3000, wait_ms
        assert int(await SCRIPTS.rate_acquire(redis, key_set, args)) <= 4000  # and it keeps the pace after it
    finally:
        await redis.aclose()


async def test_a_backends_cool_down_rides_a_step_back_of_the_stores_clock(stepped_valkey: ValkeyServer) -> None:
    """A 429's cool-down of 2 s, set just before a step back of an hour: its key's expiry is kept on the store's
    clock too, so every worker paused for the hour (a fault-harness run's 46 claimed jobs were never sent). It ends
    after its own length, for a process that reads it afresh, with a rate limit or without."""
    from offload.queue.backend_limits import BackendLimits

    redis = await connect(stepped_valkey.url)
    try:
        await BackendLimits(redis, "cool", None).cool_down(2.0)
        await step_store_clock(stepped_valkey, redis, -HOUR_S)
        started = time.monotonic()
        await within(BackendLimits(redis, "cool", None).acquire(), 10)
        await within(BackendLimits(redis, "cool", 100.0).acquire(), 10)
        assert time.monotonic() - started <= 4.0
        assert await redis.exists(keyspace.backend_cooldown("cool")) == 0  # over, not waiting for the clock
    finally:
        await redis.aclose()


async def test_the_autoscaler_and_the_gpu_worker_registry_keep_the_stores_time(stepped_valkey: ValkeyServer) -> None:
    """The store's clock is a day ahead of this host (or this host a day behind it): the autoscaler's spend day and
    instance times and a GPU worker's heartbeat stamp are the store's, as on any other server that may lead or
    take that worker's next heartbeat, not this host's."""
    redis = await connect(stepped_valkey.url)
    try:
        await step_store_clock(stepped_valkey, redis, DAY_S)
        settings = Settings.model_validate({"autoscaler": {"worker_key": "ofk_worker_key"}})
        scaler = Autoscaler(redis, settings, owner="s1", env={})
        assert await scaler.tick()
        store_day = window_of(await store_now(redis))
        assert periods(scaler.clock())[0] == store_day
        assert abs(scaler.clock() - await store_now(redis)) < 5
        await scaler.aclose()
        registry = WorkerRegistry(QueueStore(redis), ttl_ms=30_000)
        await registry.clock.sync(redis)
        worker_id = await registry.register("key-1", RegisterRequest(queues=["gpu"], host="gpu-1"))
        record = await registry.get(worker_id)
        assert record is not None
        assert abs(int(record["last_heartbeat"]) / 1000 - await store_now(redis)) < 5
    finally:
        await redis.aclose()


def test_a_host_clock_off_the_stores_by_more_than_a_minute_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """The start-up line: nothing within a minute (hosts kept in time), minutes or hours beyond, and which side."""
    caplog.set_level(logging.WARNING, "offload.queue")
    warn_host_skew(1_000_000.0, 1_000_059.0)
    warn_host_skew(1_000_000.0, 999_941.0)
    assert not caplog.records
    warn_host_skew(1_000_000.0, 1_000_000.0 - 20 * 60)
    warn_host_skew(1_000_000.0, 1_000_000.0 + 3 * 3600)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("this host's clock is 20 min behind the job store's")
    assert lines[1].startswith("this host's clock is 3.0 h ahead of the job store's")
    assert all("S3 refuses requests signed more than 15 minutes off" in line for line in lines)


async def test_a_server_started_beside_a_store_hours_off_says_so(
    stepped_valkey: ValkeyServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The server reads the store's clock as it starts and names the difference (the worker's is in
    tests/worker/test_worker_clock.py, on a process under libfaketime)."""
    redis = await connect(stepped_valkey.url)
    try:
        await step_store_clock(stepped_valkey, redis, -2 * 3600)
    finally:
        await redis.aclose()
    caplog.set_level(logging.WARNING, "offload.queue")
    with server(stepped_valkey.url):
        pass
    assert any("this host's clock is 2.0 h ahead of the job store's" in r.getMessage() for r in caplog.records)
