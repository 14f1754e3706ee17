"""A worker whose clock the result storage refuses pays for nothing it could not store (worker/storage_gate.py).

Real processes: `offload worker` under libfaketime (bench/chaos/faketime.py, its offset changed while it runs),
`rclone serve s3` (which refuses a request signed more than 15 minutes off its clock), the simulator as its own
process and Valkey. S3 refuses such requests and boto3 does not correct for it (boto/boto3#1252).

- a worker started 3 h behind claims nothing (the start's probe is refused, said in one line); once its clock is
  right it runs every job, each sent once;
- a worker whose clock steps 3 h back while it runs finds out storing an output: that job is kept (its output is
  stored once the clock is right, not sent again), and no job is claimed or sent meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import test_worker_crash as crash
from support.eventually import seconds_until
from support.s3server import RcloneS3
from test_worker_crash import QUEUE, Fleet, SimProcess, job_input, worker_env, write_config

from bench.chaos.faketime import ClockFile
from offload.eventloop import within
from offload.models import JobState
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.storage import ClockRefused, StorageError
from offload.worker.storage_gate import StorageGate

BUCKET = crash.BUCKET
sim, fleets, bucket, store = crash.sim, crash.fleets, crash.bucket, crash.store
BEHIND_S = -3 * 3600
REFUSED = "no claim or submission starts until the storage takes this host's clock"
RESUMED = "the storage takes this host's clock again"


async def start_worker(fleet: Fleet, name: str, bucket: RcloneS3, clock: ClockFile) -> None:
    """`offload worker` `name` on the wall clock `clock` gives it (libfaketime), once it serves."""
    fleet.start(name, env=clock.env(worker_env(bucket)))

    async def serving() -> bool:
        return fleet.ready(name)

    await seconds_until(serving, 60, "the worker to start", why=fleet.problems)


async def states(store: QueueStore, ids: list[str]) -> list[JobState]:
    return [(await store.get(j)).state for j in ids]


async def nothing_sent_for_a_while(sim: SimProcess, store: QueueStore, ids: list[str], sent: int) -> None:
    """The worker would claim these at once (an enqueue wakes it): for two seconds none is claimed or sent."""
    for _ in range(20):
        assert sim.stats()["submissions"] == sent
        assert set(await states(store, ids)) == {JobState.QUEUED}
        await asyncio.sleep(0.1)


async def test_a_worker_started_with_a_clock_the_storage_refuses_claims_nothing_until_it_is_right(
    valkey_url: str,
    bucket: RcloneS3,
    sim: SimProcess,
    store: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    sim.configure(latency=0.2)
    fleet = fleets(config=write_config(tmp_path / "offload.yaml", valkey_url, bucket, sim))
    clock = ClockFile(tmp_path / "clock", BEHIND_S)
    before = sim.stats()["submissions"]
    await start_worker(fleet, "behind", bucket, clock)
    text = fleet.log("behind").read_text()
    assert REFUSED in text and "this host's clock is 3.0 h behind" in text, fleet.tail("behind")
    assert bucket.secret_key not in text
    ids = await store.enqueue_many(QUEUE, [JobSpec(input=job_input(f"start-{i}")) for i in range(3)])
    await nothing_sent_for_a_while(sim, store, ids, before)

    clock.set(0)

    async def done() -> bool:
        return set(await states(store, ids)) == {JobState.SUCCEEDED}

    await seconds_until(done, 60, "every job to run once the clock is right", why=lambda: fleet.tail("behind"))
    by_input = sim.stats()["submissions_by_input_id"]
    assert [by_input.get(f"start-{i}") for i in range(3)] == [1, 1, 1]
    text = fleet.log("behind").read_text()
    assert text.count(REFUSED) == 1 and RESUMED in text, fleet.tail("behind")


async def test_a_clock_step_found_storing_an_output_stops_new_payments_until_the_storage_takes_it(
    valkey_url: str,
    bucket: RcloneS3,
    sim: SimProcess,
    store: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    sim.configure(latency=0.5)
    fleet = fleets(config=write_config(tmp_path / "offload.yaml", valkey_url, bucket, sim))
    clock = ClockFile(tmp_path / "clock", 0)
    await start_worker(fleet, "stepped", bucket, clock)
    assert REFUSED not in fleet.log("stepped").read_text()
    (first,) = await store.enqueue_many(QUEUE, [JobSpec(input=job_input("step-first"))])

    async def submitted() -> bool:
        return (await store.get(first)).state == JobState.SUBMITTED

    await seconds_until(submitted, 30, "the first job at the provider", why=lambda: fleet.tail("stepped"))
    clock.set(BEHIND_S)  # while the remote job runs: its output is refused

    async def refused() -> bool:
        return REFUSED in fleet.log("stepped").read_text()

    await seconds_until(refused, 30, "the refusal of the first output", why=lambda: fleet.tail("stepped"))
    sent = sim.stats()["submissions"]
    later = await store.enqueue_many(QUEUE, [JobSpec(input=job_input(f"step-{i}")) for i in range(3)])
    await nothing_sent_for_a_while(sim, store, later, sent)
    assert (await store.get(first)).state == JobState.SUBMITTED  # kept, its remote job's result with it

    clock.set(0)

    async def done() -> bool:
        return set(await states(store, [first, *later])) == {JobState.SUCCEEDED}

    await seconds_until(done, 90, "every job to finish once the clock is right", why=lambda: fleet.tail("stepped"))
    by_input = sim.stats()["submissions_by_input_id"]
    assert [by_input.get(n) for n in ("step-first", "step-0", "step-1", "step-2")] == [1, 1, 1, 1]
    assert (await store.get(first)).attempts == 1  # stored on its first attempt: the wait cost it nothing
    assert RESUMED in fleet.log("stepped").read_text()


async def test_the_gate_opens_on_any_answer_but_the_refusal_and_says_it_once(caplog: pytest.LogCaptureFixture) -> None:
    """Closed by a refusal, the gate asks again until the storage answers anything else (an outage says nothing
    about this host's clock): one error line a minute, one line when it opens. Without a probe it opens again
    after `every_s` (the next output stored asks)."""
    caplog.set_level(logging.INFO, logger="offload")
    answers: list[Exception] = [ClockRefused("refused again"), ClockRefused("and again"), StorageError("an outage")]
    asked = 0

    async def probe() -> None:
        nonlocal asked
        asked += 1
        if answers:
            raise answers.pop(0)

    gate = StorageGate(probe, every_s=0.01)
    gate.refused(ClockRefused("this host's clock is 3.0 h behind"))
    assert not gate.open
    await within(gate.wait_open(), 10)
    assert asked == 3 and gate.open
    assert [r.levelname for r in caplog.records if "storage" in r.getMessage()] == ["ERROR", "WARNING"]
    alone = StorageGate(every_s=0.01)
    alone.refused(ClockRefused("x"))
    assert not alone.open
    await within(alone.wait_open(), 10)
    await gate.aclose()
    await alone.aclose()
