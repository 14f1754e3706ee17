"""The SIGKILL test of the peer benchmark: kill a worker with jobs in flight, start a new one at once, and count
the jobs lost, run again and finished twice, and the time until every job is done (`Crash`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sized
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import redis

from bench import web
from bench.peers.harness import OFFLOAD_GPU_QUEUE, POLL, Bench, Proc, merge_problems
from bench.peers.sessions import offload_serving
from bench.peers.systems import System

S = TypeVar("S", bound=Sized)


@dataclass
class Crash:
    system: str
    n: int
    sleep_s: float
    concurrency: int
    cap: float
    in_flight_at_kill: int = 0
    done_at_kill: int = 0
    lost: int = 0  # in flight at the kill, never finished within the cap
    rerun: int = 0  # in flight at the kill, started again (the work paid twice)
    duplicated: int = 0  # finished more than once
    unfinished: int = 0  # not finished within the cap (lost ones included)
    all_done_s: float | None = None  # kill -> every job finished; None: not within the cap
    samples: list[tuple[float, int]] = field(default_factory=list)  # (s since kill, jobs finished)
    log_problems: list[tuple[str, int]] = field(default_factory=list)  # both workers' warnings and errors
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _counts(client: redis.Redis, key: str) -> dict[str, int]:
    return {str(k): int(v) for k, v in client.hgetall(key).items()}


def crash_peer(bench: Bench, system: System, db: int, crash: Crash, kill_after: float) -> Crash:
    """Start a worker, enqueue, SIGKILL the worker `kill_after` s after its budget of jobs started, start a
    new one at once, and watch every job's starts and ends (written to Valkey by the job as it happens)."""
    client = bench.client(db)
    client.flushdb()
    rid = f"{system.name}-crash"
    worker = bench.worker(system, db, crash.concurrency, "crash1")
    producer = bench.producer(system, db, rid, crash.n, crash.sleep_s, True)
    second: Proc | None = None
    try:
        target = 1 if system.one_at_a_time else min(crash.concurrency, crash.n)
        deadline = time.monotonic() + 150
        while client.hlen(f"bench:{rid}:starts") < target:
            if time.monotonic() > deadline or not worker.alive():
                raise RuntimeError(f"jobs did not start\nworker:\n{worker.tail()}\nproducer:\n{producer.tail()}")
            time.sleep(POLL)
        time.sleep(kill_after)
        worker.kill()
        t_kill = time.time()
        starts0, ends0 = _counts(client, f"bench:{rid}:starts"), _counts(client, f"bench:{rid}:ends")
        second = bench.worker(system, db, crash.concurrency, "crash2")
        in_flight = {i for i in starts0 if ends0.get(i, 0) == 0}
        crash.in_flight_at_kill, crash.done_at_kill = len(in_flight), len(ends0)
        ends = _watch_after_kill(crash, t_kill, lambda: _counts(client, f"bench:{rid}:ends"))
        starts = _counts(client, f"bench:{rid}:starts")
        crash.lost = sum(1 for i in in_flight if ends.get(i, 0) == 0)
        crash.rerun = sum(1 for i in in_flight if starts.get(i, 0) > 1)
        crash.duplicated = sum(1 for v in ends.values() if v > 1)
        crash.unfinished = crash.n - len(ends)
    except Exception as exc:
        crash.error = str(exc)[:2000]
    finally:
        for proc in (worker, producer, second):
            if proc is not None and proc.alive():
                proc.kill()
        client.close()
        crash.log_problems = merge_problems(worker.problems(), second.problems() if second else [])
    return crash


def crash_offload(bench: Bench, db: int, crash: Crash, kill_after: float) -> Crash:
    """The same with the real `offload worker` against the simulator: a job's start is its remote submission
    (counted by the simulator per job), its end is `succeeded`."""
    from offload.queue.keyspace import prefix

    client = bench.client(db)
    client.flushdb()
    sim_url = bench.sim(crash.sleep_s)
    config = bench.offload_config(db, sim_url, crash.concurrency, "crash")
    worker = bench.offload_worker(config, crash.concurrency, "crash1")
    second: Proc | None = None
    tag = f"crash{os.getpid()}-{time.time_ns()}"

    def submissions() -> dict[str, int]:
        by_id: dict[str, int] = web.get(f"{sim_url}/_sim/stats", timeout=10).json()["submissions_by_input_id"]
        return {k.rsplit("-", 1)[1]: v for k, v in by_id.items() if k.startswith(tag)}

    succeeded_key = prefix(OFFLOAD_GPU_QUEUE) + "succeeded"
    try:
        ids = asyncio.run(_enqueue_crash_jobs(bench.url(db), worker, tag, crash.n))
        index = {job_id: str(i) for i, job_id in enumerate(ids)}

        def ends() -> set[str]:
            return {index[j] for j in client.zrange(succeeded_key, 0, -1) if j in index}

        target = min(crash.concurrency, crash.n)
        deadline = time.monotonic() + 60
        while len(submissions()) < target:
            if time.monotonic() > deadline or not worker.alive():
                raise RuntimeError(f"jobs did not start\nworker:\n{worker.tail()}")
            time.sleep(POLL)
        time.sleep(kill_after)
        worker.kill()
        t_kill = time.time()
        starts0, ends0 = submissions(), ends()
        second = bench.offload_worker(config, crash.concurrency, "crash2")
        in_flight = {i for i in starts0 if i not in ends0}
        crash.in_flight_at_kill, crash.done_at_kill = len(in_flight), len(ends0)
        done = _watch_after_kill(crash, t_kill, ends)
        starts = submissions()
        totals = client.hgetall(prefix(OFFLOAD_GPU_QUEUE) + "stats")
        crash.lost = sum(1 for i in in_flight if i not in done)
        crash.rerun = sum(1 for i in in_flight if starts.get(i, 0) > 1)
        crash.duplicated = max(int(totals.get("succeeded", 0)) - len(done), 0)
        crash.unfinished = crash.n - len(done)
    except Exception as exc:
        crash.error = str(exc)[:2000]
    finally:
        for proc in (worker, second):
            if proc is not None and proc.alive():
                proc.kill()
        client.close()
        crash.log_problems = merge_problems(worker.problems(), second.problems() if second else [])
    return crash


async def _enqueue_crash_jobs(url: str, worker: Proc, tag: str, n: int) -> list[str]:
    """`n` jobs tagged `tag`, enqueued once the offload worker serves."""
    from offload.connection import connect
    from offload.queue.specs import JobSpec
    from offload.queue.store import QueueStore

    r = await connect(url)
    store = QueueStore(r)
    try:
        await offload_serving(store, worker)
        specs = [JobSpec(input={"id": f"{tag}-{i}"}, retention=3600) for i in range(n)]
        return await store.enqueue_many(OFFLOAD_GPU_QUEUE, specs)
    finally:
        await r.aclose()


def _watch_after_kill(crash: Crash, t_kill: float, finished: Callable[[], S]) -> S:
    """Every 0.5 s until `crash.cap` after the kill: the jobs finished so far, and when all of them were."""
    while True:
        now = time.time() - t_kill
        done = finished()
        crash.samples.append((round(now, 2), len(done)))
        if crash.all_done_s is None and len(done) >= crash.n:
            crash.all_done_s = now
        if now > crash.cap:
            return done
        time.sleep(0.5)
