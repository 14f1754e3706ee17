"""Dispatch workers against a job store at its maxmemory and one that may evict: real
`offload worker` processes, the simulator as its own process, rclone S3, and a Valkey of each test's own that
the test reconfigures (CONFIG SET maxmemory / maxmemory-policy), as an operator's Redis would change under them.

On main, a store reaching its limit while answers arrived had its checkpoints refused and the failure accepted:
remote ids dropped and the jobs paid again, and the worker exited 1 on the OOM reply to its next claim. Expired
records were never trimmed at the limit, so nothing could bring the store back. And a store whose
maxmemory-policy changed to an evicting one went on being paid for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import test_worker_crash as crash
from support.eventually import seconds_until
from support.s3server import RcloneS3
from support.servers import ValkeyServer
from test_store_memory import expired_records, held, set_config, squeeze, squeeze_between
from test_worker import settings_for, start_worker
from test_worker_crash import QUEUE, Fleet, SimProcess, get_all, job_input, result_keys, worker_env, write_config

from bench import web
from offload.connection import connect
from offload.eventloop import within
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.memory import read_memory
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker import run as run_module
from offload.worker.dispatch import Worker

BUCKET, sim, bucket, fleets = (
    crash.BUCKET,
    crash.sim,
    crash.bucket,
    crash.fleets,
)  # fixtures shared with test_worker_crash


@pytest.fixture
async def ostore(own_valkey: ValkeyServer) -> AsyncIterator[QueueStore]:
    redis = await connect(own_valkey.url)
    yield QueueStore(redis)
    await redis.aclose()


async def counts(store: QueueStore) -> dict[str, int]:
    return (await store.stats(QUEUE)).counts


def submissions(sim: SimProcess) -> dict[str, int]:
    found: dict[str, int] = sim.stats()["submissions_by_input_id"]
    return found


async def test_a_worker_at_the_limit_while_answers_arrive_pays_each_job_once_and_never_exits(
    own_valkey: ValkeyServer,
    bucket: RcloneS3,
    sim: SimProcess,
    ostore: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    """Ten submissions are out when the store reaches its maxmemory; their answers arrive at the limit. Every
    remote id is recorded and every job completes there (checkpoint and complete run at the limit), no new job is
    claimed or submitted until memory is freed, the worker never exits, and each of the 20 jobs is paid once."""
    n = 20
    sim.configure(honour_idempotency_key=False, submit_latency="3-4", latency="0.5-1")  # like most providers
    config = write_config(tmp_path / "offload.yaml", own_valkey.url, bucket, sim, concurrency=10)
    fleet = fleets(config=config)
    ids = await ostore.enqueue_many(QUEUE, [JobSpec(input=job_input(f"full-{i}")) for i in range(n)])
    fleet.start("w0", env=worker_env(bucket))

    async def ten_submits_out() -> bool:
        return sum(submissions(sim).values()) >= 10

    await seconds_until(ten_submits_out, 60, "ten submissions out", why=fleet.problems)
    recorded_before = (await counts(ostore))["submitted"]
    squeeze(own_valkey)  # the answers (3-4 s after their submits) arrive at the limit

    async def in_flight_done() -> bool:
        return (await counts(ostore))["succeeded"] >= 10

    await seconds_until(in_flight_done, 90, "the ten jobs in flight to finish at the limit", why=fleet.problems)
    assert (await read_memory(ostore.redis)).full, "the store must still be at its limit"
    assert sum(submissions(sim).values()) == 10, "nothing new may be submitted at the limit"
    assert fleet.alive() == ["w0"], fleet.problems()

    set_config(own_valkey, "maxmemory", 0)  # the operator frees memory

    async def all_done() -> bool:
        return (await counts(ostore))["succeeded"] == n

    await seconds_until(all_done, 120, f"all {n} jobs to succeed once memory was freed", why=fleet.problems)
    jobs = await get_all(ostore, ids)
    log = fleet.log("w0").read_text(errors="replace")
    print(
        f"\nat the limit: {recorded_before} of 10 remote ids recorded before it; submissions "
        f"{sum(submissions(sim).values())} for {n} jobs; attempts {sorted({j.attempts for j in jobs})}"
    )
    assert fleet.alive() == ["w0"], fleet.problems()
    assert submissions(sim) == {f"full-{i}": 1 for i in range(n)}
    assert all(j.state == JobState.SUCCEEDED and j.attempts == 1 and j.remote_id for j in jobs)
    assert set(result_keys(bucket)) >= {f"results/{j}.json" for j in ids}
    assert "job store full" in log and "Traceback" not in log, log[-3000:]


async def test_a_worker_alone_trims_a_full_store_and_goes_back_to_work(
    own_valkey: ValkeyServer,
    bucket: RcloneS3,
    sim: SimProcess,
    ostore: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    """No server: finished records whose retention ran out fill the store to its limit. The worker's claims are
    refused; while they wait it trims (reap.lua deletes before its first write), the store has room again, and the
    queued jobs run, each paid once."""
    sim.configure(latency="0.2-0.5")
    base = held(own_valkey, lasting=True)
    old = await expired_records(ostore.redis, QUEUE)
    ids = await ostore.enqueue_many(QUEUE, [JobSpec(input=job_input(f"heal-{i}")) for i in range(5)])
    squeeze_between(own_valkey, base)
    assert (await read_memory(ostore.redis)).full
    config = write_config(tmp_path / "offload.yaml", own_valkey.url, bucket, sim)
    fleet = fleets(config=config)
    fleet.start("w0", env=worker_env(bucket))

    async def all_done() -> bool:
        return (await counts(ostore))["succeeded"] == 5

    await seconds_until(all_done, 90, "the queued jobs to run once the worker trimmed", why=fleet.problems)
    assert await ostore.redis.exists(*(f"offload:{{{QUEUE}}}:job:{j}" for j in old)) == 0
    assert submissions(sim) == {f"heal-{i}": 1 for i in range(5)}
    assert all(j.attempts == 1 for j in await get_all(ostore, ids))
    assert fleet.alive() == ["w0"], fleet.problems()


async def test_a_policy_changed_to_evict_stops_claims_and_submissions_until_fixed(
    own_valkey: ValkeyServer,
    bucket: RcloneS3,
    sim: SimProcess,
    ostore: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    """A running worker finds its store switched to allkeys-lru: it says so, claims and submits nothing (new
    jobs stay queued, unpaid), and once the policy is noeviction again it goes on and runs every job once."""
    sim.configure(latency="0.2-0.5")
    config = write_config(tmp_path / "offload.yaml", own_valkey.url, bucket, sim)
    fleet = fleets(config=config)
    fleet.start("w0", env=worker_env(bucket, OFFLOAD_STORE_CHECK_S="0.2"))
    await seconds_until(lambda: _ready(fleet), 60, "the worker to serve", why=fleet.problems)
    set_config(own_valkey, "maxmemory-policy", "allkeys-lru")

    async def said() -> bool:
        return "maxmemory-policy is allkeys-lru: offload needs noeviction" in fleet.log("w0").read_text()

    await seconds_until(said, 30, "the worker to say the policy is wrong", why=fleet.problems)
    ids = await ostore.enqueue_many(QUEUE, [JobSpec(input=job_input(f"evict-{i}")) for i in range(6)])
    await _unpaid_until_fixed(own_valkey, fleet, sim, ostore, ids, "evict")


async def _unpaid_until_fixed(
    own_valkey: ValkeyServer, fleet: Fleet, sim: SimProcess, ostore: QueueStore, ids: list[str], name: str
) -> None:
    """The worker, told the store may evict: 3 s (15 policy checks and many claim polls) with nothing sent, every
    job queued, the worker alive; then the policy fixed: every job runs, once, and the worker says so."""
    watched = time.monotonic() + 3.0
    while time.monotonic() < watched:
        assert submissions(sim) == {} and (await counts(ostore))["queued"] == len(ids)
        assert fleet.alive() == ["w0"], fleet.problems()
        await asyncio.sleep(0.2)
    set_config(own_valkey, "maxmemory-policy", "noeviction")

    async def all_done() -> bool:
        return (await counts(ostore))["succeeded"] == len(ids)

    await seconds_until(all_done, 60, "the jobs to run once the policy was fixed", why=fleet.problems)
    assert submissions(sim) == {f"{name}-{i}": 1 for i in range(len(ids))}
    assert all(j.attempts == 1 for j in await get_all(ostore, ids))
    assert fleet.alive() == ["w0"] and "noeviction again" in fleet.log("w0").read_text()


async def _ready(fleet: Fleet) -> bool:
    return fleet.ready("w0")


async def test_a_worker_started_on_a_store_that_may_evict_waits_paused_then_serves(
    own_valkey: ValkeyServer,
    bucket: RcloneS3,
    sim: SimProcess,
    ostore: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    """Restarted (systemd, Kubernetes) while its store is on allkeys-lru, a worker neither exits nor pays: it
    says so in one line, claims nothing, and serves once the policy is noeviction; every job runs once."""
    sim.configure(latency="0.2-0.5")
    set_config(own_valkey, "maxmemory-policy", "allkeys-lru")
    ids = await ostore.enqueue_many(QUEUE, [JobSpec(input=job_input(f"start-{i}")) for i in range(4)])
    config = write_config(tmp_path / "offload.yaml", own_valkey.url, bucket, sim)
    fleet = fleets(config=config)
    fleet.start("w0", env=worker_env(bucket, OFFLOAD_STORE_CHECK_S="0.2"))
    line = "maxmemory-policy is allkeys-lru: offload needs noeviction"

    async def said() -> bool:
        return line in fleet.log("w0").read_text()

    await seconds_until(said, 60, "the worker to say the policy is wrong", why=fleet.problems)
    await _unpaid_until_fixed(own_valkey, fleet, sim, ostore, ids, "start")
    assert fleet.log("w0").read_text().count(line) == 1  # one line, not one per check


async def test_a_policy_changed_during_the_start_up_pauses_the_worker_before_it_serves(
    own_valkey: ValkeyServer, bucket: RcloneS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up reads the store's memory, then checks durability (a WAIT that may time out) and builds its
    workers: seconds on a loaded host. The policy is read again right before a worker serves, so a store switched
    to allkeys-lru meanwhile pauses it from the start (a fault-harness run saw a worker started during an
    eviction spell pay 4.1 s into it, its start's reading 3.5 s old and its first periodic check not yet due);
    fixed, the job runs once."""
    real_open = run_module._Shared.open

    async def open_then_flip(cls: type[run_module._Shared], *args: Any, **kwargs: Any) -> run_module._Shared:
        shared = await real_open(*args, **kwargs)
        set_config(own_valkey, "maxmemory-policy", "allkeys-lru")  # after the start's reading
        return shared

    monkeypatch.setattr(run_module._Shared, "open", classmethod(open_then_flip))
    redis = await connect(own_valkey.url)
    store = QueueStore(redis)
    ready: list[Worker] = []
    with running_sim(SimConfig.model_validate({"default": {"latency": 0.2}})) as sim_url:
        settings = settings_for(own_valkey.url, bucket, str(sim_url), "http-job")
        ids = await store.enqueue_many("q", [JobSpec(input={"id": "flip"})])
        stop, task = await start_worker(settings, on_ready=ready.append)
        try:
            await seconds_until(lambda: _true(bool(ready)), 30, "the worker to be ready")
            assert not ready[0].policy.safe and "allkeys-lru" in (ready[0].policy.problem or "")
            assert await asyncio.to_thread(_submissions, str(sim_url)) == 0
            set_config(own_valkey, "maxmemory-policy", "noeviction")

            async def done() -> bool:
                return (await store.get(ids[0])).state is JobState.SUCCEEDED

            await seconds_until(done, 60, "the job to run once the policy was fixed")
            assert await asyncio.to_thread(_submissions, str(sim_url)) == 1
        finally:
            stop.set()
            await within(task, 30)
            await redis.aclose()


async def _true(value: bool) -> bool:
    return value


def _submissions(sim_url: str) -> int:
    return int(web.get(f"{sim_url}/_sim/stats").json()["submissions"])


Drainer = Callable[[], Awaitable[None]]


@contextlib.asynccontextmanager
async def one_submission_at_a_time(
    valkey: ValkeyServer, bucket: RcloneS3, submit_latency: float, grace_s: float
) -> AsyncIterator[tuple[QueueStore, Callable[[], int], list[str], list[Worker], Drainer]]:
    """A worker in process submitting one job at a time (submit_concurrency 1) to an API that answers after
    `submit_latency`, four jobs enqueued; once the first is out the store's policy turns to volatile-lru. Yields
    (the store, the submissions the API saw, the job ids, the worker once ready, a call that drains it and returns
    when it is gone). The policy is noeviction again at the end."""
    redis = await connect(valkey.url)
    store = QueueStore(redis)
    workers: list[Worker] = []
    config = SimConfig.model_validate({"default": {"latency": 0.2, "submit_latency": submit_latency}})
    with running_sim(config) as sim_url:
        settings = settings_for(valkey.url, bucket, str(sim_url), "http-job", submit_concurrency=1, concurrency=4)
        ids = await store.enqueue_many("q", [JobSpec(input={"id": f"g-{i}"}) for i in range(4)])
        stop = asyncio.Event()
        task = asyncio.create_task(
            run_module.run_worker(
                settings, "q", stop=stop, install_signals=False, grace_s=grace_s, on_ready=workers.append
            )
        )

        async def drain() -> None:
            stop.set()
            await within(task, 20)

        try:

            async def first_out() -> bool:
                return _submissions(str(sim_url)) == 1

            await seconds_until(first_out, 30, "the first submission")
            set_config(valkey, "maxmemory-policy", "volatile-lru")
            yield store, lambda: _submissions(str(sim_url)), ids, workers, drain
        finally:
            set_config(valkey, "maxmemory-policy", "noeviction")
            stop.set()
            with contextlib.suppress(Exception):
                await task
            await redis.aclose()


async def test_jobs_already_claimed_are_not_submitted_while_the_store_may_evict(
    own_valkey: ValkeyServer, bucket: RcloneS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The submit gate, in process: one submission at a time to an API that answers after 3 s. While the first is
    out the policy turns to volatile-lru; the jobs already claimed and waiting for the gate are held there, unsent
    and without an intent (the policy is read before the begin, not only before the call), and go once it is
    noeviction again. Each job is paid once."""
    monkeypatch.setenv("OFFLOAD_STORE_CHECK_S", "0.1")
    async with one_submission_at_a_time(own_valkey, bucket, 3.0, 5.0) as (store, sent, ids, workers, _):

        async def noticed() -> bool:
            return bool(workers) and not workers[0].policy.safe

        await seconds_until(noticed, 30, "the worker to notice the policy")

        async def first_done() -> bool:
            return (await store.stats("q")).counts["succeeded"] == 1

        await seconds_until(first_done, 30, "the first job to finish")
        waiting = [i for i in ids if (await store.get(i)).state is not JobState.SUCCEEDED]
        watched = time.monotonic() + 2.0  # the gate is free: the others would go within this
        while time.monotonic() < watched:
            assert sent() == 1
            # nor is their intent opened (the check before the begin: a write of new paid work)
            assert [await store.redis.hget(keyspace.job("q", i), "sub_open") for i in waiting] == [None] * 3
            await asyncio.sleep(0.1)
        assert (await store.stats("q")).counts["active"] == 3  # claimed, held at the gate, unsent
        set_config(own_valkey, "maxmemory-policy", "noeviction")

        async def all_done() -> bool:
            return (await store.stats("q")).counts["succeeded"] == 4

        await seconds_until(all_done, 60, "the held jobs to run once the policy was fixed")
        assert sent() == 4
        assert all(j.attempts == 1 for j in [await store.get(i) for i in ids])


async def test_a_drain_hands_back_at_once_the_jobs_held_by_an_evicting_store(
    own_valkey: ValkeyServer, bucket: RcloneS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job held before its payment by the store's eviction policy waits as one of the jobs ahead of their call:
    a drain hands it back at once, unsent, instead of holding the worker to its grace (here 30 s) and cutting it.
    The setting of the test above: the first job out when the policy turns; once it is done the next waits on the
    policy (inside the gate) and the two behind it at the gate, and the worker drains."""
    monkeypatch.setenv("OFFLOAD_STORE_CHECK_S", "0.1")
    async with one_submission_at_a_time(own_valkey, bucket, 2.0, 30.0) as (store, sent, ids, workers, drain):

        async def first_done_while_held() -> bool:
            return bool(workers) and not workers[0].policy.safe and (await store.stats("q")).counts["succeeded"] == 1

        await seconds_until(first_done_while_held, 30, "the first job to finish with the policy still unsafe")
        ahead = workers[0].ctx.ahead

        async def all_ahead() -> bool:
            return len(ahead) == 3  # one on the policy, two at the gate

        await seconds_until(all_ahead, 10, "the three jobs to wait as jobs ahead of their call")
        began = time.monotonic()
        await drain()
        took = time.monotonic() - began
        assert took < 10, took  # not the 30 s grace
        assert sent() == 1
        jobs = [await store.get(i) for i in ids]
        assert [j.state for j in jobs].count(JobState.QUEUED) == 3, jobs  # back, unsent: the next worker sends


async def test_a_worker_frozen_while_the_policy_changed_reads_it_again_before_paying(
    own_valkey: ValkeyServer,
    bucket: RcloneS3,
    sim: SimProcess,
    ostore: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    """SIGSTOPped with jobs claimed and one submission out, while its store turns to volatile-lru: on SIGCONT the
    worker must not trust the verdict it read before the freeze. The next job at the submit gate reads the policy
    again first, so nothing more is paid until it is noeviction; then every job runs once."""
    sim.configure(submit_latency="3", latency="0.2")
    config = write_config(tmp_path / "offload.yaml", own_valkey.url, bucket, sim, submit_concurrency=1)
    fleet = fleets(config=config)
    ids = await ostore.enqueue_many(QUEUE, [JobSpec(input=job_input(f"frozen-{i}")) for i in range(4)])
    proc = fleet.start("w0", env=worker_env(bucket, OFFLOAD_STORE_CHECK_S="0.2"))

    async def first_out() -> bool:
        return sum(submissions(sim).values()) == 1

    await seconds_until(first_out, 60, "the first submission", why=fleet.problems)
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        set_config(own_valkey, "maxmemory-policy", "volatile-lru")
        await asyncio.sleep(4)  # the fault itself: frozen past the first submit's answer, not a wait for anything
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    watched = time.monotonic() + 3.0
    while time.monotonic() < watched:
        assert sum(submissions(sim).values()) == 1, "a submission went out on a verdict older than the freeze"
        await asyncio.sleep(0.1)
    set_config(own_valkey, "maxmemory-policy", "noeviction")

    async def all_done() -> bool:
        return (await counts(ostore))["succeeded"] == 4

    await seconds_until(all_done, 60, "every job once the policy was fixed", why=fleet.problems)
    assert submissions(sim) == {f"frozen-{i}": 1 for i in range(4)}
    assert all(j.attempts == 1 for j in await get_all(ostore, ids))
    assert fleet.alive() == ["w0"], fleet.problems()
