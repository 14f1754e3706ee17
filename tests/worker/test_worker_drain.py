"""Dispatch workers (real `offload worker` processes) drained by SIGTERM with work at the submit gate, the rate
limit and inside slow submit calls: a `systemctl restart` must cost nothing. The waiting jobs
go back unsent (intents closed), the calls out are awaited and checkpointed even past the grace, and the next
worker finishes everything: one paid submission per job, none counted as a possible duplicate. A second signal
cuts the drain: what that costs (one possible duplicate per call out) is what the docs say.

Real Valkey, `rclone serve s3`, the simulator as its own process ignoring Idempotency-Key (as most provider APIs
do: a resend is a second paid run), workers as processes (fixtures and helpers of test_worker_crash).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_worker_crash as crash
import yaml
from support.eventually import seconds_until
from support.s3server import RcloneS3
from test_worker_crash import BUCKET, OFFLOAD, QUEUE, Fleet, SimProcess, counts, job_input, spawn, worker_env

from bench import web
from offload.backends import create_backend
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

sim, bucket, fleets, store = crash.sim, crash.bucket, crash.fleets, crash.store  # shared fixtures
N_JOBS = 40


def drain_config(
    path: Path,
    valkey_url: str,
    s3: RcloneS3,
    sim: SimProcess,
    *,
    rate_limit: str | None = None,
    timeout: float = 30.0,
    **queue: Any,
) -> Path:
    """An offload.yaml for queue `q` on the simulator's tutorial job API (no tag to look a submission up by)."""
    backend: dict[str, Any] = {"kind": "http-job", "base_url": sim.url, "api_key": "sim-key", "timeout": timeout}
    if rate_limit is not None:
        backend["rate_limit"] = rate_limit
    config = {
        "redis_url": valkey_url,
        "storage": {**s3.settings(BUCKET), "secret_access_key": "${TEST_S3_SECRET}"},
        "backends": {"gpu": backend},
        "queues": {QUEUE: {"backend": "gpu", "poll_interval": 0.5, "poll_timeout": 120, **queue}},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def start(fleet: Fleet, name: str, env: dict[str, str], grace: float) -> subprocess.Popen[bytes]:
    """`offload worker --grace <grace>` (Fleet.start's grace is fixed); killed with the fleet at teardown."""
    assert fleet.config is not None
    cmd = [OFFLOAD, "worker", "--queue", QUEUE, "--config", str(fleet.config), "--grace", str(grace)]
    fleet.log(name).write_text("")
    fleet.procs[name] = spawn([*cmd, "--log-level", "info"], env, fleet.root, fleet.log(name))
    return fleet.procs[name]


async def exited(fleet: Fleet, name: str, timeout: float) -> int:
    proc = fleet.procs[name]

    async def gone() -> bool:
        return proc.poll() is not None

    await seconds_until(gone, timeout, f"worker {name} to exit", why=lambda: fleet.tail(name))
    crash._live.pop(proc.pid, None)
    return int(proc.returncode)


async def finish_with(fleet: Fleet, name: str, env: dict[str, str], store: QueueStore, ids: list[str]) -> None:
    """A second worker (no drain) finishes every job."""
    start(fleet, name, env, grace=3)

    async def all_done() -> bool:
        return (await counts(store))["succeeded"] == len(ids)

    await seconds_until(all_done, 120, f"worker {name} to finish every job", why=lambda: fleet.tail(name))


async def succeeded_once(store: QueueStore, ids: list[str]) -> Counter[str]:
    """How many `succeeded` transitions each job made (the events stream)."""
    events = await store.redis.xrange(keyspace.events(QUEUE), count=100_000)
    seen: Counter[str] = Counter()
    for _, fields in events:
        if fields.get("state") == "succeeded":
            seen.update((fields.get("jobs") or fields.get("id") or "").split())
    return Counter({j: seen[j] for j in ids})


async def assert_paid_once(sim: SimProcess, store: QueueStore, ids: list[str], inputs: list[str]) -> None:
    stats = sim.stats()
    assert stats["submissions_by_input_id"] == dict.fromkeys(inputs, 1), stats["submissions_by_input_id"]
    assert stats["submissions"] == len(ids)
    records = [await store.get(j) for j in ids]
    assert {r.state for r in records} == {JobState.SUCCEEDED}
    assert [r.possible_duplicates for r in records] == [0] * len(ids)
    assert await store.possible_duplicates(QUEUE) == {}
    assert await succeeded_once(store, ids) == Counter(dict.fromkeys(ids, 1))


def fast_submits(sim: SimProcess) -> None:
    """Submits answer at once from now on (the simulator's config merged: its jobs and log are kept)."""
    config = {"default": {"submit_latency": 0}}
    web.post(f"{sim.url}/_sim/config", params={"merge": "true"}, json=config).raise_for_status()


async def enqueue(store: QueueStore, label: str, n: int) -> tuple[list[str], list[str]]:
    inputs = [f"{label}-{i}" for i in range(n)]
    return await store.enqueue_many(QUEUE, [JobSpec(input=job_input(i)) for i in inputs]), inputs


# -- a restart with jobs waiting ---------------------------------------------------------------------------


@pytest.mark.parametrize("wait_at", ["gate", "rate-limit"])
async def test_sigterm_with_jobs_waiting_pays_each_job_once(
    valkey_url: str,
    bucket: RcloneS3,
    sim: SimProcess,
    store: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
    wait_at: str,
) -> None:
    """The reported scenario: 40 jobs on one worker (40 slots), submits that take 1 s, and either a submit gate of 4
    or a 5/s rate limit, so most jobs wait while a few calls are out. `systemctl restart` (SIGTERM, --grace 3):
    no waiting job is submitted during the grace, the calls out are awaited and checkpointed, the next worker
    finishes everything. On main: 44 (45) paid submissions for 40 jobs, the calls out cut at the grace's end
    and resent."""
    sim.configure(latency=0.5, submit_latency=1.0, honour_idempotency_key=False)
    limits: dict[str, Any] = {"submit_concurrency": 4} if wait_at == "gate" else {"rate_limit": "5/s"}
    config = drain_config(tmp_path / "offload.yaml", valkey_url, bucket, sim, concurrency=N_JOBS, **limits)
    fleet = fleets(config=config)
    env = worker_env(bucket)
    ids, inputs = await enqueue(store, f"drain-{wait_at}", N_JOBS)
    start(fleet, "A", env, grace=3)

    async def waiting() -> bool:
        c = await counts(store)
        return sim.stats()["submissions"] >= 4 and c["active"] >= N_JOBS // 2

    await seconds_until(waiting, 60, f"calls out and jobs waiting at the {wait_at}", why=lambda: fleet.tail("A"))
    fleet.procs["A"].send_signal(signal.SIGTERM)
    assert await exited(fleet, "A", 60) == 0, fleet.tail("A")
    sent_by_a = sim.stats()["submissions"]
    c = await counts(store)
    recorded = sum([(await store.get(j)).remote_id is not None for j in ids])
    open_intents = [j for j in ids if await store.redis.hget(keyspace.job(QUEUE, j), "sub_open") == "1"]
    await finish_with(fleet, "B", env, store, ids)
    print(
        f"\n{wait_at}: A sent {sent_by_a} of {N_JOBS} and recorded {recorded} remote ids, left {len(open_intents)} "
        f"intents open; paid submissions in all {sim.stats()['submissions']}"
    )
    assert c["active"] + c["submitted"] == 0, c  # every lease handed back
    assert recorded == sent_by_a, "an answer A got was not checkpointed"
    assert open_intents == [], "a drained worker left intents open"
    await assert_paid_once(sim, store, ids, inputs)


# -- a call out longer than the grace ------------------------------------------------------------------------


async def test_a_submit_call_out_past_the_grace_is_awaited_and_checkpointed(
    valkey_url: str,
    bucket: RcloneS3,
    sim: SimProcess,
    store: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    """Three submits that take 6 s, SIGTERM with --grace 1 while all three are out: the drain waits for their
    answers (bounded by the backend's 30 s timeout, not the grace), records the remote ids and hands the jobs
    back with them; the next worker polls them. Nothing is submitted twice. (On main the calls were cancelled at
    the grace's end, intents open, and resent.)"""
    sim.configure(latency=0.5, submit_latency=6.0, honour_idempotency_key=False)
    config = drain_config(tmp_path / "offload.yaml", valkey_url, bucket, sim, concurrency=4)
    fleet = fleets(config=config)
    env = worker_env(bucket)
    ids, inputs = await enqueue(store, "slow-submit", 3)
    start(fleet, "A", env, grace=1)

    async def all_out() -> bool:
        return int(sim.stats()["submissions"]) == 3  # logged by the simulator before it holds the answer

    await seconds_until(all_out, 60, "three submit calls out", why=lambda: fleet.tail("A"))
    fleet.procs["A"].send_signal(signal.SIGTERM)
    assert await exited(fleet, "A", 60) == 0, fleet.tail("A")
    records = [await store.get(j) for j in ids]
    assert all(r.state == JobState.QUEUED and r.remote_id for r in records), records
    assert all(sim.job(str(r.remote_id))["input_id"] == i for r, i in zip(records, inputs, strict=True))
    assert "drain cut" not in fleet.tail("A")
    await finish_with(fleet, "B", env, store, ids)
    assert [(await store.get(j)).remote_id for j in ids] == [r.remote_id for r in records]  # polled, not re-sent
    await assert_paid_once(sim, store, ids, inputs)


# -- a second signal cuts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_cuts_the_drain_at_the_cost_the_readme_states(
    valkey_url: str,
    bucket: RcloneS3,
    sim: SimProcess,
    store: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
    second: signal.Signals,
) -> None:
    """Two submits held 90 s (the backend's timeout 120 s) and a third job waiting at a gate of 2, --grace 60: the
    first SIGTERM drains (the waiting job goes back at once, unsent), a second signal cuts at once instead of
    waiting for the calls. The cost, as the docs' fault table says: each call cut leaves its intent open, and
    the next worker sends it again under the same Idempotency-Key counted as a possible duplicate (a second paid
    run here, where the provider ignores the key and cannot be asked by tag); the job that was waiting costs
    nothing."""
    sim.configure(latency=0.5, submit_latency=90.0, honour_idempotency_key=False)
    config = drain_config(
        tmp_path / "offload.yaml", valkey_url, bucket, sim, timeout=120, concurrency=4, submit_concurrency=2
    )
    fleet = fleets(config=config)
    env = worker_env(bucket)
    ids, inputs = await enqueue(store, f"cut-{second.name}", 3)
    start(fleet, "A", env, grace=60)

    async def two_out() -> bool:
        return sim.stats()["submissions"] == 2 and (await counts(store))["active"] == 3

    await seconds_until(two_out, 60, "two submit calls out, one job at the gate", why=lambda: fleet.tail("A"))
    sent = {i for i, n in sim.stats()["submissions_by_input_id"].items() if n}
    fleet.procs["A"].send_signal(signal.SIGTERM)
    [waiting] = [j for j, i in zip(ids, inputs, strict=True) if i not in sent]

    async def handed_back() -> bool:  # at once, unsent: also how the test knows the first signal was handled
        return (await store.get(waiting)).state == JobState.QUEUED

    await seconds_until(handed_back, 30, "the job waiting at the gate to go back", why=lambda: fleet.tail("A"))
    fleet.procs["A"].send_signal(second)
    assert await exited(fleet, "A", 30) == 0, fleet.tail("A")  # long before the held answers (90 s)
    assert "drain cut (a second signal) with 2 submit calls out" in fleet.tail("A")
    records = {i: await store.get(j) for j, i in zip(ids, inputs, strict=True)}
    assert all(r.state == JobState.QUEUED and r.remote_id is None for r in records.values()), records
    open_intents = {
        i for j, i in zip(ids, inputs, strict=True) if await store.redis.hget(keyspace.job(QUEUE, j), "sub_open") == "1"
    }
    assert open_intents == sent, "the cut calls' intents stay open, the waiting job's was never opened"
    fast_submits(sim)  # for B's resends; A's held calls run on to their end
    await finish_with(fleet, "B", env, store, ids)
    records = {i: await store.get(j) for j, i in zip(ids, inputs, strict=True)}
    assert {i: r.possible_duplicates for i, r in records.items()} == {i: int(i in sent) for i in inputs}
    assert await store.possible_duplicates(QUEUE) == {"gpu": 2}
    by_input = sim.stats()["submissions_by_input_id"]
    assert by_input == {i: 2 if i in sent else 1 for i in inputs}, by_input
    assert await succeeded_once(store, ids) == Counter(dict.fromkeys(ids, 1))


# -- the resend loops inside a submission ----------------------------------------------------------------------


def conflicts(sim: SimProcess, kind: str) -> int:
    """Submits the simulator answered with `kind` (429, idempotency_conflict: the 409 of a key in progress)."""
    return int(sim.stats()["faults"].get(f"jobs.submit {kind}", 0))


async def test_a_drain_ends_the_429_resubmit_loop_and_closes_the_intent(
    valkey_url: str,
    bucket: RcloneS3,
    sim: SimProcess,
    store: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    """Every submit answered 429 (Retry-After 1 s): the job pauses and sends again, up to 8 times. SIGTERM stops
    that loop at once: no submit after the one out at the signal, and the job goes back unspent, its intent
    closed (a 429 is an answer: nothing was accepted), so its next owner sends it uncounted. (On main the loop
    went on through the grace, and the job came back as a throttled retry with an attempt spent.)"""
    sim.configure(latency=0.5, rate_429=1.0, retry_after_seconds=1, honour_idempotency_key=False)
    config = drain_config(tmp_path / "offload.yaml", valkey_url, bucket, sim, concurrency=4)
    fleet = fleets(config=config)
    [job_id], _ = await enqueue(store, "throttled", 1)
    start(fleet, "A", worker_env(bucket), grace=60)

    async def throttled_twice() -> bool:
        return conflicts(sim, "429") >= 2

    await seconds_until(throttled_twice, 30, "two submits answered 429", why=lambda: fleet.tail("A"))
    fleet.procs["A"].send_signal(signal.SIGTERM)
    at_signal = conflicts(sim, "429")
    assert await exited(fleet, "A", 30) == 0, fleet.tail("A")
    assert conflicts(sim, "429") <= at_signal + 1, "the drained worker went on submitting"
    record = await store.get(job_id)
    assert (record.state, record.attempts, record.error) == (JobState.QUEUED, 0, None), record
    assert await store.redis.hget(keyspace.job(QUEUE, job_id), "sub_open") != "1", "a 429'd submission left open"
    [again] = await store.claim(QUEUE, "next-owner", 1)
    assert await store.begin_many(QUEUE, [(again.id, again.token, 0.0)]) == ["OK:1"]  # the same run, uncounted


async def test_a_drain_ends_the_409_resend_loop_leaving_the_intent_open(
    valkey_url: str,
    bucket: RcloneS3,
    sim: SimProcess,
    store: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    """A worker lost inside a 40 s submit (played by the test: it claims, begins, sends the request and hands the
    lease back with the intent open). Worker A sends that submission again under the same key and is answered
    409 (still being served), pausing 1, 2, 4 ... s between resends. SIGTERM ends that loop at once, and leaves
    the intent open: the first request may yet be accepted, so the next owner must adopt or count it. (On main
    the resends went on through the grace, a 60 s one here.)"""
    sim.configure(latency=0.5, submit_latency=40.0, honour_idempotency_key=True)
    config = drain_config(tmp_path / "offload.yaml", valkey_url, bucket, sim, timeout=120, concurrency=4)
    fleet = fleets(config=config)
    [job_id], [input_id] = await enqueue(store, "in-progress", 1)
    [claimed] = await store.claim(QUEUE, "lost-worker", 1, 60_000)
    assert await store.begin_many(QUEUE, [(job_id, claimed.token, 0.0)]) == ["OK:1"]
    backend = create_backend("gpu", {"kind": "http-job", "base_url": sim.url, "api_key": "k", "timeout": 120})
    lost = asyncio.create_task(backend.submit(job_input(input_id), tag=job_id, idempotency_key=f"{job_id}.1"))
    try:

        async def held() -> bool:
            return int(sim.stats()["submissions"]) == 1

        await seconds_until(held, 30, "the lost worker's submission to be held by the simulator")
        assert await store.release_leases(QUEUE, "lost-worker") == 1  # back to ready, the intent open
        start(fleet, "A", worker_env(bucket), grace=60)

        async def in_progress() -> bool:
            return conflicts(sim, "idempotency_conflict") >= 2

        await seconds_until(in_progress, 30, "two resends answered 409", why=lambda: fleet.tail("A"))
        fleet.procs["A"].send_signal(signal.SIGTERM)
        at_signal = conflicts(sim, "idempotency_conflict")
        assert await exited(fleet, "A", 20) == 0, fleet.tail("A")
        assert conflicts(sim, "idempotency_conflict") <= at_signal + 1, "the drained worker went on resending"
        record = await store.get(job_id)
        assert (record.state, record.remote_id, record.possible_duplicates) == (JobState.QUEUED, None, 1), record
        assert await store.redis.hget(keyspace.job(QUEUE, job_id), "sub_open") == "1", "an unknown outcome was closed"
        assert sim.stats()["submissions"] == 1
    finally:
        lost.cancel()
        await asyncio.gather(lost, return_exceptions=True)
        await backend.aclose()
