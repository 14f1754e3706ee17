"""Dispatch workers (real `offload worker` processes) through a Valkey outage with jobs in flight: a 30 s black
hole (Valkey SIGSTOPped: connections hang, commands time out, the ones already sent run when it wakes up) and
a Valkey killed and restarted a second later (AOF always). Once, a restart of about a second made every worker
exit, and each lease that ran out meanwhile counted as an attempt.

A maintenance loop in the test plays the server's part (`reap` every half second): after the outage it is
the first to reach Valkey, the hardest case, since every worker's lease has run out by the clock by then.
After the outage every job must succeed with one attempt and no lease expiry, each submitted once, and no
worker process may have exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import test_worker_crash as crash
from support.eventually import seconds_until
from support.s3server import RcloneS3
from support.servers import ValkeyServer
from test_worker_crash import QUEUE, Fleet, SimProcess, job_input, result_keys, worker_env, write_config

from offload.connection import connect
from offload.eventloop import within
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

BUCKET, sim, bucket, fleets = (
    crash.BUCKET,
    crash.sim,
    crash.bucket,
    crash.fleets,
)  # fixtures shared with test_worker_crash
LEASE_MS = 3000
N_JOBS = 30


@pytest.fixture
async def ostore(own_valkey: ValkeyServer) -> AsyncIterator[QueueStore]:
    redis = await connect(own_valkey.url)
    yield QueueStore(redis, lease_ms=LEASE_MS)
    await redis.aclose()


@contextlib.asynccontextmanager
async def maintenance(store: QueueStore) -> AsyncIterator[list[int]]:
    """The server's maintenance: reap every half second, riding out the outage like the server does."""
    reaped = [0]

    async def loop() -> None:
        while True:
            with contextlib.suppress(Exception):
                reaped[0] += (await within(store.reap(QUEUE), 2))[1]
            await asyncio.sleep(0.5)

    task = asyncio.create_task(loop())
    try:
        yield reaped
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def ride_out(
    valkey: ValkeyServer,
    bucket: RcloneS3,
    sim: SimProcess,
    store: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
    outage: Callable[[], None],
    label: str,
) -> None:
    sim.configure(latency="2-4")
    config = write_config(tmp_path / "offload.yaml", valkey.url, bucket, sim, max_attempts=1)
    fleet = fleets(config=config)
    env = worker_env(bucket, OFFLOAD_LEASE_MS=LEASE_MS)
    ids = await store.enqueue_many(
        QUEUE, [JobSpec(input=job_input(f"{label}-{i}"), max_attempts=1) for i in range(N_JOBS)]
    )
    for name in ("w0", "w1"):
        fleet.start(name, env=env)
    async with maintenance(store) as reaped:

        async def in_flight() -> bool:  # both workers up (a worker that cannot reach Valkey at its start gives
            # up after OFFLOAD_REDIS_CONNECT_TIMEOUT, by design) and jobs in flight
            return (
                all(fleet.ready(n) for n in fleet.procs)
                and (await store.stats(QUEUE)).counts["submitted"] >= N_JOBS // 2
            )

        await seconds_until(in_flight, 60, "jobs in flight", why=fleet.problems)
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, outage)
        down = time.monotonic() - t0

        async def all_done() -> bool:
            with contextlib.suppress(Exception):
                return (await store.stats(QUEUE)).counts["succeeded"] == N_JOBS
            return False

        took = await seconds_until(
            all_done, 90, f"{N_JOBS} jobs to succeed after the outage", every=0.2, why=fleet.problems
        )
    alive = fleet.alive()
    jobs = [await store.get(j) for j in ids]
    submissions = sim.stats()["submissions_by_input_id"]
    logs = "\n".join(fleet.log(n).read_text(errors="replace") for n in fleet.procs)
    print(
        f"\n{label}: Valkey away {down:.1f}s with {N_JOBS} jobs in flight on 2 workers; all succeeded "
        f"{took:.1f}s after it returned; attempts {sorted({j.attempts for j in jobs})}, lease expiries "
        f"{sorted({j.lease_expiries for j in jobs})}, reaped {reaped[0]}, submissions "
        f"{sum(submissions.values())}, workers alive {alive}"
    )
    assert alive == ["w0", "w1"], f"a worker exited: {fleet.problems()}"
    assert [j.attempts for j in jobs] == [1] * N_JOBS, "the outage cost jobs an attempt"
    assert [j.lease_expiries for j in jobs] == [0] * N_JOBS and reaped[0] == 0
    assert submissions == {f"{label}-{i}": 1 for i in range(N_JOBS)}
    assert set(result_keys(bucket)) >= {f"results/{j}.json" for j in ids}
    assert "job store unreachable" in logs and "answers again" in logs
    assert "Traceback" not in logs, logs[-3000:]


async def test_workers_ride_out_a_30s_valkey_black_hole(
    own_valkey: ValkeyServer,
    bucket: RcloneS3,
    sim: SimProcess,
    ostore: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    def black_hole() -> None:
        assert own_valkey.pid is not None
        os.kill(own_valkey.pid, signal.SIGSTOP)
        try:
            time.sleep(30)  # the fault itself: 30 s of silence, not a wait for something to happen
        finally:
            os.kill(own_valkey.pid, signal.SIGCONT)

    await ride_out(own_valkey, bucket, sim, ostore, fleets, tmp_path, black_hole, "blackhole")


async def test_workers_ride_out_a_1s_valkey_restart(
    own_valkey: ValkeyServer,
    bucket: RcloneS3,
    sim: SimProcess,
    ostore: QueueStore,
    fleets: Callable[..., Fleet],
    tmp_path: Path,
) -> None:
    def restart() -> None:
        own_valkey.kill()  # SIGKILL: only the fsynced AOF survives (appendfsync always: everything)
        time.sleep(1.0)
        own_valkey.restart()

    await ride_out(own_valkey, bucket, sim, ostore, fleets, tmp_path, restart, "restart")
