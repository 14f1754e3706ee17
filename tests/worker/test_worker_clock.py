"""Wrong clocks on real processes: `offload worker` processes, the simulator and a Valkey whose
wall clock the test steps while it runs, with worker processes whose own clock is a day ahead (libfaketime:
bench/chaos/faketime.py). Results go to a local directory: S3 refuses a request signed a day off
(RequestTimeTooSkewed), which is not what these tests are about.

- a worker whose clock is a day ahead beside one on the true clock, daily cap 5: 5 paid in the store's day, the
  held jobs released when the store's day rolls over, 5 more then (on main: the skewed worker's own window paid 10);
- the store's clock steps back an hour while a worker lies SIGKILLed with jobs leased and other jobs wait out a
  retry backoff: they come back within seconds (on main: an hour), the step is in the events stream and the log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import test_worker_crash as crash
import yaml
from support.admin_redis import redis_admin
from support.eventually import seconds_until
from support.servers import ValkeyServer
from test_worker_crash import QUEUE, Fleet, SimProcess, base_env, job_input

from bench.chaos.faketime import ClockFile
from offload.caps import next_window_s
from offload.connection import connect
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

sim, fleets = crash.sim, crash.fleets  # fixtures shared with test_worker_crash
LEASE_MS = 3000
DAY_S = 86_400


def local_config(path: Path, valkey_url: str, sim: SimProcess, **queue: Any) -> Path:
    config = {
        "redis_url": valkey_url,
        "storage": {"kind": "local", "path": str(path.parent / "results")},
        "backends": {"gpu": {"kind": "http-job", "base_url": sim.url, "api_key": "sim-key"}},
        "queues": {QUEUE: {"backend": "gpu", "poll_interval": 0.5, "poll_timeout": 120, **queue}},
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def store_day_ends_in(redis: RedisClient) -> float:
    """Seconds until the store's next UTC midnight, by its own clock."""
    seconds, micros = await redis.time()
    now = int(seconds) + int(micros) / 1e6
    return next_window_s(now) - now


@pytest.fixture
async def sstore(stepped_valkey: ValkeyServer) -> AsyncIterator[QueueStore]:
    redis = await connect(stepped_valkey.url)
    yield QueueStore(redis, lease_ms=LEASE_MS)
    await redis.aclose()


async def test_a_worker_whose_clock_is_a_day_ahead_pays_no_more_than_the_daily_cap(
    stepped_valkey: ValkeyServer, sim: SimProcess, sstore: QueueStore, fleets: Callable[..., Fleet], tmp_path: Path
) -> None:
    """Two workers, one on the true clock, one a day ahead (a bad RTC, a restored VM), daily cap 5, 12 jobs. The
    cap window is the store's UTC day: 5 paid, the rest held or queued; when the store's day rolls over (its clock
    stepped to just before midnight) the held jobs are released and 5 more paid."""
    sim.configure(latency=0.3)
    config = local_config(tmp_path / "offload.yaml", stepped_valkey.url, sim, daily_job_cap=5, concurrency=4)
    fleet = fleets(config=config)
    env = {**base_env(), "OFFLOAD_LEASE_MS": str(LEASE_MS)}
    fleet.start("true", env=env)
    fleet.start("ahead", env=ClockFile(tmp_path / "ahead-clock", DAY_S).env(env))

    async def up() -> bool:
        return fleet.ready("true") and fleet.ready("ahead")

    await seconds_until(up, 60, "both workers serving", why=fleet.problems)
    # told at start, before it pays anything: its S3 requests would be refused
    assert "this host's clock is 24.0 h ahead of the job store's" in fleet.log("ahead").read_text()
    assert "this host's clock is" not in fleet.log("true").read_text()
    await sstore.enqueue_many(QUEUE, [JobSpec(input=job_input(f"cap-{i}")) for i in range(12)])
    seen: dict[str, int] = {}

    def settled(succeeded: int, waiting: int) -> Callable[[], Any]:
        async def check() -> bool:
            seen.update((await sstore.stats(QUEUE)).counts)
            return (
                seen["succeeded"] == succeeded
                and seen["held"] + seen["queued"] == waiting
                and seen["active"] + seen["submitted"] == 0
            )

        return check

    def why() -> str:
        return f"counts {seen}, submissions {sim.stats()['submissions']}\n{fleet.problems()}"

    await seconds_until(settled(5, 7), 60, "5 succeeded and 7 waiting at the cap", every=0.1, why=why)
    # each worker claims and begins in turn for a while: neither finds a window of its own with room
    await asyncio.sleep(0)
    for _ in range(20):
        assert sim.stats()["submissions"] == 5, why()
        await asyncio.sleep(0.1)
    day1, jobs_counted, _ = await sstore.usage(QUEUE)
    assert jobs_counted == 5

    assert stepped_valkey.clock is not None
    stepped_valkey.clock.step(await store_day_ends_in(sstore.redis) - 2)  # the store's midnight in 2 s
    await seconds_until(settled(10, 2), 60, "5 more paid in the store's next day", every=0.1, why=why)

    async def released() -> bool:  # what is held now was held in the second day (its cap is spent too)
        held = await redis_admin(sstore.redis).zrange(keyspace.prefix(QUEUE) + "held", 0, -1, withscores=True)
        return all(window > int(day1) for _, window in held)

    await seconds_until(released, 60, "the jobs held in the store's first day released", every=0.1, why=why)
    day2, jobs_counted, _ = await sstore.usage(QUEUE)
    assert day2 > day1 and jobs_counted == 5
    assert sim.stats()["submissions"] == 10, why()
    assert not sim.stats()["duplicate_input_ids"]


async def test_a_step_back_of_the_stores_clock_costs_a_crashed_workers_jobs_and_retries_seconds(
    stepped_valkey: ValkeyServer, sim: SimProcess, sstore: QueueStore, fleets: Callable[..., Fleet], tmp_path: Path
) -> None:
    """Worker A submits 4 jobs and is SIGKILLed; 3 other jobs wait out a 20 s retry backoff. The store's clock then
    steps back an hour and worker B starts: A's jobs are back with B (resumed by their remote ids, not paid again)
    and the retries claimed within seconds of their due time, the step is in the queue's events and in B's log."""
    sim.configure(latency=6)
    config = local_config(tmp_path / "offload.yaml", stepped_valkey.url, sim, concurrency=4)
    fleet = fleets(config=config)
    env = {**base_env(), "OFFLOAD_LEASE_MS": str(LEASE_MS)}
    retrying = await sstore.enqueue_many(QUEUE, [JobSpec(input=job_input(f"retry-{i}")) for i in range(3)])
    for c in await sstore.claim(QUEUE, "earlier-worker", 3):
        assert await sstore.fail(c.id, c.token, "remote 503", delay_ms=20_000) == "retrying"
    leased = await sstore.enqueue_many(QUEUE, [JobSpec(input=job_input(f"leased-{i}")) for i in range(4)])
    fleet.start("a", env=env)

    async def submitted() -> bool:
        return (await sstore.stats(QUEUE)).counts["submitted"] == 4

    await seconds_until(submitted, 60, "worker A's 4 jobs at the provider", why=fleet.problems)
    a_id = fleet.worker_id("a")
    assert a_id
    fleet.kill("a")
    assert stepped_valkey.clock is not None
    stepped_valkey.clock.set(-3600)
    t0 = time.monotonic()
    fleet.start("b", env=env)

    async def back() -> bool:
        jobs = [await sstore.get(j) for j in leased + retrying]
        with_b = [j for j in jobs if j.state in (JobState.ACTIVE, JobState.SUBMITTED) and j.lease_owner != a_id]
        return len(with_b) + sum(j.state is JobState.SUCCEEDED for j in jobs) == len(jobs)

    def why() -> str:
        return f"{fleet.tail('b')}\n{fleet.problems()}"

    await seconds_until(back, 60, "A's jobs and the retries with worker B", every=0.2, why=why)
    took = time.monotonic() - t0

    async def done() -> bool:
        return (await sstore.stats(QUEUE)).counts["succeeded"] == 7

    await seconds_until(done, 90, "all 7 jobs succeeded", every=0.2, why=why)
    assert took < 60
    events = await sstore.redis.xrange(keyspace.events(QUEUE), "-", "+")
    steps = [f for _, f in events if f["state"] == "clock_stepped_back"]
    # the step as the store saw it: less the time nobody read its clock before it (A dead, B starting)
    assert len(steps) == 1 and 3_540_000 < int(steps[0]["step_ms"]) <= 3_602_000, steps
    assert "stepped back" in fleet.log("b").read_text(), fleet.tail("b")
    stats = sim.stats()
    assert stats["submissions"] == 7 and not stats["duplicate_input_ids"], stats
