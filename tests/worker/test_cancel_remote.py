"""Cancel of a waiting job whose remote job may still run: a drained (or crashed) dispatch worker handed the job back
with its remote id, or with a submission whose outcome is unknown. Before, the cancel answered "cancelled" at once
and the remote job ran to the end, paid for. Now the cancel answers "requested" until a dispatch worker has
cancelled the remote job: the job goes first in the ready set (ahead of any backlog, out of a far retry or delay,
past a reached cap), is never submitted again, and `offload status` says what it waits for.

Real Valkey, the real simulator over HTTP (which records cancels), real dispatch workers in the test's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from test_cli import cli
from test_worker_faults import configure, job_input, make_settings, remote_jobs, serving, stats, until

from offload.connection import connect
from offload.errors import InvalidTransition
from offload.queue.replies import Verdict
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig()) as url:
        yield str(url)


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


async def state_of(store: QueueStore, job_id: str) -> str:
    return (await store.get(job_id)).state.value


async def test_cancel_of_a_drained_job_cancels_its_remote_job_before_anything_else(
    valkey_url: str, sim: str, store: QueueStore, tmp_path: Path
) -> None:
    """A worker drains while the job's remote job runs (60 s); the job waits with its remote id behind a backlog of
    higher-priority long jobs. The cancel answers "requested" (again on a repeat) while no worker runs, status says
    so; the next worker, with one slot, cancels the remote job at the simulator first and the job ends cancelled,
    submitted once."""
    await configure(sim, latency=60)
    settings = make_settings(valkey_url, {"kind": "local", "path": str(tmp_path)}, sim, "http-job", concurrency=1)
    [job_id] = await store.enqueue_many("q", [JobSpec(input=job_input("drained"))])
    async with serving(settings, grace_s=0.1, lease_ms=3000) as first:

        async def submitted() -> bool:
            return (await store.get(job_id)).remote_id is not None

        await until(submitted, "the remote job to be recorded", first)
    drained = await store.get(job_id)
    assert drained.state.value == "queued" and drained.remote_id is not None  # handed back, remote job running
    backlog = await store.enqueue_many("q", [JobSpec(input=job_input(f"b-{i}"), priority=10) for i in range(30)])

    assert await store.cancel(job_id) == "requested"
    assert await store.cancel(job_id) == "requested"  # a repeat: still waiting for a worker to cancel it
    [remote] = await remote_jobs(sim, "drained")
    assert remote["status"] != "cancelled" and (await stats(sim))["cancels"] == {}
    status = await asyncio.to_thread(cli, valkey_url, "status", job_id)  # the CLI runs its own loop
    assert status.exit_code == 0 and "no worker of the queue is alive" in " ".join(status.stdout.split())

    async with serving(settings, lease_ms=3000) as second:

        async def cancelled() -> bool:
            return await state_of(store, job_id) == "cancelled"

        await until(cancelled, "the drained job to be cancelled", second)
        seen = await stats(sim)
    assert seen["cancels"] == {"jobs": 1}
    assert seen["submissions_by_input_id"]["drained"] == 1  # never submitted again
    [remote] = await remote_jobs(sim, "drained")
    assert remote["status"] == "cancelled"
    assert sum(seen["submissions_by_input_id"].get(f"b-{i}", 0) for i in range(30)) <= 4  # not behind the backlog
    with pytest.raises(InvalidTransition):
        await store.cancel(job_id)
    assert {await state_of(store, b) for b in backlog} <= {"queued", "active", "submitted"}


@pytest.mark.parametrize("where", ["retrying", "held", "unknown-outcome"])
async def test_a_waiting_job_with_a_remote_job_is_claimed_first_past_caps_and_far_retries(
    store: QueueStore, where: str
) -> None:
    """Store level, for each way a job waits with something remote: in a retry an hour away (its remote id kept, as
    after a storage failure), held over a cap, or queued with a submission whose outcome is unknown (a worker lost
    inside the call). The cancel answers "requested", and the next claim, with a full cap, takes it first, ahead of
    50 jobs of higher priority, flagged for the worker to cancel."""
    [job_id] = await store.enqueue_many("q", [JobSpec(input="x")])
    (c,) = await store.claim("q", "w1", 1)
    if where == "unknown-outcome":
        assert (await store.begin_many("q", [(c.id, c.token, 0.0)]))[0].verdict is Verdict.OK
        assert await store.release_leases("q", "w1") == 1  # as a worker killed in the call would be reaped
    else:
        await store.checkpoint(c.id, c.token, "gpu", "remote-1")
        if where == "retrying":
            assert await store.fail(c.id, c.token, "storing failed", keep_remote=True, delay_ms=3_600_000) == "retrying"
        else:
            await store.hold(c.id, c.token, "daily jobs cap reached", "20260101")
    assert await state_of(store, job_id) == ("queued" if where == "unknown-outcome" else where)
    await store.enqueue_many("q", [JobSpec(input=i, priority=100) for i in range(50)])

    assert await store.cancel(job_id) == "requested"
    (first,) = await store.claim("q", "w2", 1, job_cap=0)  # the cap is reached: no fresh job
    assert first.id == job_id and first.cancel_requested
    assert first.remote_id == (None if where == "unknown-outcome" else "remote-1")
    assert first.intent_open == (where == "unknown-outcome")
    assert await store.cancel(job_id) == "requested"  # held by the worker now: still requested
    await store.ack_cancel(first.id, first.token)
    assert await state_of(store, job_id) == "cancelled"
    (plain,) = await store.claim("q", "w3", 1)  # a job with nothing remote is still cancelled at once
    assert await store.fail(plain.id, plain.token, "transient", delay_ms=3_600_000) == "retrying"
    assert await store.cancel(plain.id) == "cancelled"


async def test_a_cancelled_running_job_handed_back_by_a_drain_goes_first(store: QueueStore) -> None:
    """Cancelled while its worker held it, then handed back (drain) before that worker cancelled it: first in
    line for the next claim, not at its old place."""
    await store.enqueue_many("q", [JobSpec(input="old")])
    (c,) = await store.claim("q", "w1", 1)
    await store.checkpoint(c.id, c.token, "gpu", "remote-2")
    assert await store.cancel(c.id) == "requested"
    await store.enqueue_many("q", [JobSpec(input=i, priority=100) for i in range(20)])
    assert await store.release_leases("q", "w1") == 1
    (first,) = await store.claim("q", "w2", 1)
    assert first.id == c.id and first.cancel_requested and first.remote_id == "remote-2"
