"""The dispatch worker against the lean QueueStore loop, in one run, on Valkey's shipped persistence and on offload's.

    python bench/worker_throughput.py [--quick] [--jobs 100000] [--io-jobs 20000] [--concurrency 100] [--reps 3]

Three workloads, each on a queue filled up front and drained by one worker process started for it:

- `lean_noop`: a loop written directly against `QueueStore` (claim up to the free slots, a task per job, ack
  every finished job with one `complete_many`): what the queue itself can do in one process;
- `worker_noop`: offload's dispatch worker (`offload.worker.dispatch.Worker`, unchanged) on the same no-op jobs,
  with an in-process synchronous backend in place of a remote API (submit answers at once, the output is not
  stored), so each job takes the worker's real path: claim, the submit intent, submit, complete, heartbeats;
- `worker_io50`: the dispatch worker on jobs whose submit waits 50 ms, `--concurrency` in flight: the bound is
  concurrency / 0.05 s (2,000/s at 100);
- `loop_io50`: no queue at all, `--concurrency` asyncio tasks that each await `asyncio.sleep(0.05)` in a loop,
  the same number of times: what the event loop itself delivers against that bound (a timer wakes up to a
  millisecond late: epoll's timeout is in whole milliseconds, rounded up), the ceiling of any asyncio worker.

Every workload runs on the event loop `offload worker` ships with (offload/eventloop.py: uvloop where installed;
OFFLOAD_EVENT_LOOP=asyncio for asyncio's own).

Two private Valkeys run side by side, on offload.local.embedded's allocator. The headline figures are taken on one
with Valkey's shipped persistence (RDB snapshots, no AOF: as bench/queue_throughput.py's headline and the peers
in bench/peers are measured). The two no-op workloads run again on one started as `offload.local.embedded` ships it
(AOF, `appendfsync everysec`, no RDB snapshots), which logs every write a script makes: `lean_noop_aof` and
`worker_noop_aof`. The repetitions interleave the workloads (lean, worker, io50, loop, lean on AOF, worker on
AOF, lean, ...) so that a noisy neighbour hurts all of them alike; each figure is the median over the
repetitions. The last line printed is JSON: {"worker_noop_per_s", "lean_noop_per_s", "worker_io50_per_s",
"io50_bound_per_s", "noop_ratio", "io50_ratio", "loop_io50_per_s", "io50_loop_ratio", "worker_noop_aof_per_s",
"lean_noop_aof_per_s", "noop_aof_ratio"} (`loop_*`: the event loop's own ceiling, and the worker against it;
`*_aof`: on the AOF server, null with --url, where only the given server is measured).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make `bench` importable
from redis.asyncio import Redis

from bench.queue_throughput import start_valkey  # offload.local.embedded's allocator; AOF everysec or Valkey's shipped
from offload import eventloop
from offload.backends.base import RemoteResult, Submission
from offload.connection import connect
from offload.eventloop import within
from offload.heap import freeze_startup
from offload.models import ClaimedJob
from offload.queue.backend_limits import BackendLimits
from offload.queue.replies import Verdict
from offload.queue.specs import JobSpec
from offload.queue.store import DEFAULT_LEASE_MS, CompleteItem, QueueStore
from offload.worker.dispatch import Worker, WorkerOptions, default_worker_id

QUEUE = "wbench"
WORKLOADS = ("lean_noop", "worker_noop", "worker_io50", "loop_io50")
AOF_WORKLOADS = ("lean_noop_aof", "worker_noop_aof")  # the no-op pair again, on the AOF server
IO_SLEEP_S = 0.05
ROOT = Path(__file__).resolve().parent.parent


async def fill(url: str, jobs: int, sleep_s: float) -> None:
    """An empty server, then `jobs` ready jobs (enqueued before the worker starts: only draining is timed)."""
    redis = await connect(url)
    try:
        await cast(Redis, redis).flushdb()  # a single-node bench server
        store = QueueStore(redis)
        specs = [JobSpec(input={"i": i, "sleep": sleep_s}, retention=600) for i in range(jobs)]
        for k in range(0, jobs, 10_000):
            await store.enqueue_many(QUEUE, specs[k : k + 10_000])
    finally:
        await redis.aclose()


class Done:
    """Counts acknowledged jobs; `finished` is set when all `jobs` are."""

    def __init__(self, jobs: int) -> None:
        self.jobs, self.count = jobs, 0
        self.finished = asyncio.Event()

    def add(self, codes: Sequence[str]) -> None:
        self.count += sum(1 for code in codes if code == "OK")
        if self.count >= self.jobs:
            self.finished.set()


class LocalBackend:
    """A synchronous remote API without a network: submit waits the job's seconds and answers with the result."""

    name = "local"
    synchronous = True

    async def submit(self, job_input: Any, *, tag: str, idempotency_key: str | None = None) -> Submission:
        if sleep_s := float(job_input["sleep"]):
            await asyncio.sleep(sleep_s)
        return Submission(remote_id=tag, result=RemoteResult("succeeded", output=None))

    async def poll(self, remote_id: str) -> RemoteResult:
        return RemoteResult("succeeded", output=None)

    async def cancel(self, remote_id: str) -> bool:
        return False  # nothing to stop: submit answered with the result

    async def find(self, tag: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


class CountingStore(QueueStore):
    """The QueueStore the worker acks through, counting every accepted ack."""

    def __init__(self, redis: Any, done: Done) -> None:
        super().__init__(redis)
        self.done = done

    async def complete_many(self, queue: str, items: Sequence[CompleteItem]) -> list[Verdict]:
        codes = await super().complete_many(queue, items)
        self.done.add(codes)
        return codes


async def run_worker(url: str, done: Done, concurrency: int) -> None:
    redis, control = await connect(url), await connect(url, max_connections=2)
    backend = LocalBackend()

    async def save(key: str, output: Any, run: str, fence: Any) -> str:
        return key

    options = WorkerOptions(queue=QUEUE, backend_name=backend.name, concurrency=concurrency)
    worker = Worker(
        CountingStore(redis, done),
        backend,
        save,
        BackendLimits(redis, backend.name, None),
        options,
        control=QueueStore(control),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await _until(done.finished, task)
    finally:
        stop.set()
        await task
        await redis.aclose()
        await control.aclose()


async def run_lean(url: str, done: Done, concurrency: int) -> None:
    """The lean loop: claim up to the free slots, a task per job, one `complete_many` for all finished jobs."""
    redis = await connect(url)
    store = QueueStore(redis)
    worker_id = default_worker_id()
    running: dict[str, asyncio.Task[None]] = {}
    finished: list[ClaimedJob] = []
    slot, work_done = asyncio.Event(), asyncio.Event()

    async def run_job(job: ClaimedJob) -> None:
        if sleep_s := float(orjson.loads(job.input_json)["sleep"]):
            await asyncio.sleep(sleep_s)
        finished.append(job)
        work_done.set()

    async def acknowledge() -> None:
        while True:
            await work_done.wait()
            work_done.clear()
            batch = finished[:]
            del finished[:]
            codes = await store.complete_many(QUEUE, [(job.id, job.token, job.output_key, None) for job in batch])
            for job in batch:
                running.pop(job.id, None)
            done.add(codes)
            slot.set()

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(DEFAULT_LEASE_MS / 3000)
            await store.heartbeat(QUEUE, worker_id, list(running))

    async def claim_loop() -> None:
        idle = 0.02
        while not done.finished.is_set():  # not only cancel(): 3.11's wait_for can swallow a cancellation
            free = concurrency - len(running)
            claimed = await store.claim(QUEUE, worker_id, min(free, 500)) if free > 0 else []
            for job in claimed:
                running[job.id] = asyncio.create_task(run_job(job))
            if claimed and len(claimed) == min(free, 500):
                idle = 0.02
                continue
            slot.clear()
            with contextlib.suppress(TimeoutError):
                await within(slot.wait(), idle if free > 0 else None)
            idle = min(idle * 2, 0.5) if not claimed else 0.02

    helpers = [asyncio.create_task(h()) for h in (acknowledge, heartbeat, claim_loop)]
    try:
        await _until(done.finished, *helpers)
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await redis.aclose()


async def run_loop(done: Done, concurrency: int) -> None:
    """The event loop's own ceiling: `concurrency` tasks each sleeping IO_SLEEP_S in turn until `done.jobs`
    sleeps have ended; no queue, no worker."""
    started = 0

    async def one() -> None:
        nonlocal started
        while started < done.jobs:
            started += 1
            await asyncio.sleep(IO_SLEEP_S)
            done.add(("OK",))

    await asyncio.gather(*(one() for _ in range(concurrency)))


async def _until(event: asyncio.Event, *tasks: asyncio.Task[None]) -> None:
    """Wait for `event`; a task that ends first (a crash) raises here instead of hanging the bench."""
    waiter = asyncio.create_task(event.wait())
    try:
        await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if event.is_set():
            return
        for task in tasks:
            if task.done():
                task.result()
                raise RuntimeError("the worker stopped before every job was done")
    finally:
        waiter.cancel()


async def child(workload: str, url: str, jobs: int, concurrency: int) -> None:
    """One workload in this (fresh) process; prints {"jobs", "seconds"}: from the first claim to the last ack.
    Start-up objects are frozen first, as `offload worker` does once it is ready (offload/heap.py), for every
    workload alike."""
    freeze_startup()
    done = Done(jobs)
    t0 = time.perf_counter()
    if workload == "lean_noop":
        await run_lean(url, done, concurrency)
    elif workload == "loop_io50":
        await run_loop(done, concurrency)
    else:
        await run_worker(url, done, concurrency)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"jobs": done.count, "seconds": elapsed}))


def measure(workload: str, url: str, jobs: int, concurrency: int, timeout: float) -> float:
    """Fill the queue, drain it with a fresh worker process; returns jobs per second."""
    if workload != "loop_io50":
        asyncio.run(fill(url, jobs, IO_SLEEP_S if workload == "worker_io50" else 0.0))
    cmd = [sys.executable, __file__, "--child", workload, "--url", url, "--jobs", str(jobs)]
    cmd += ["--concurrency", str(concurrency)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{workload} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["jobs"] != jobs:
        raise SystemExit(f"{workload}: {result['jobs']} of {jobs} jobs completed")
    return float(jobs / result["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition (a smoke run)")
    parser.add_argument("--jobs", type=int, default=None, help="no-op jobs per run (100,000; quick 3,000)")
    parser.add_argument("--io-jobs", type=int, default=None, help="50 ms jobs per run (20,000; quick 1,000)")
    parser.add_argument("--concurrency", type=int, default=100, help="jobs in flight, every workload")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (3; quick 1); medians are reported")
    parser.add_argument("--url", default=None, help="an existing server (its current database is FLUSHED)")
    parser.add_argument("--child", choices=WORKLOADS + AOF_WORKLOADS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    jobs = args.jobs if args.jobs is not None else 3_000 if args.quick else 100_000
    if args.child:
        workload = args.child.removesuffix("_aof")  # the same workload; only the server differs
        eventloop.run(child(workload, args.url, jobs, args.concurrency))  # the loop `offload worker` runs on
        return
    io_jobs = args.io_jobs if args.io_jobs is not None else 1_000 if args.quick else 20_000
    reps = args.reps if args.reps is not None else 1 if args.quick else 3
    if min(jobs, io_jobs, reps, args.concurrency) < 1:
        parser.error("--jobs, --io-jobs, --reps and --concurrency must be at least 1")
    bound = args.concurrency / IO_SLEEP_S
    timeout = 60 + max(jobs / 2_000, io_jobs / bound * 3)
    rates = _measure_all(args.url, jobs, io_jobs, reps, args.concurrency, timeout)
    print(f"jobs={jobs} io_jobs={io_jobs} concurrency={args.concurrency} reps={reps} (medians)")
    _report(rates, bound)


def _measure_all(
    given_url: str | None, jobs: int, io_jobs: int, reps: int, concurrency: int, timeout: float
) -> dict[str, list[float]]:
    """Every workload `reps` times, interleaved, on the given server or on two started side by side."""
    workdir = tempfile.mkdtemp(prefix="offload-wbench-")
    procs: list[subprocess.Popen[bytes]] = []
    urls: dict[str, str] = {}  # "shipped" (Valkey's own persistence) and "aof" (offload.local.embedded's)
    if given_url:
        urls["shipped"] = given_url
    else:
        for name, aof in (("shipped", False), ("aof", True)):
            Path(workdir, name).mkdir()
            proc, urls[name] = start_valkey(str(Path(workdir, name)), aof=aof)
            procs.append(proc)
    order = WORKLOADS + (AOF_WORKLOADS if "aof" in urls else ())
    rates: dict[str, list[float]] = {w: [] for w in order}
    try:
        for url in urls.values():
            _wait_ready(url)
        for rep in range(reps):
            for workload in order:
                n = io_jobs if workload.endswith("io50") else jobs
                url = urls["aof" if workload in AOF_WORKLOADS else "shipped"]
                rates[workload].append(measure(workload, url, n, concurrency, timeout))
                print(f"rep {rep + 1}/{reps}  {workload:<16} {rates[workload][-1]:>10,.0f} jobs/s", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return rates


def _report(rates: dict[str, list[float]], bound: float) -> None:
    """The medians for people, then the JSON line."""
    lean, worker, io50, loop = (statistics.median(rates[w]) for w in WORKLOADS)
    lean_aof, worker_aof = (statistics.median(rates[w]) if rates.get(w) else None for w in AOF_WORKLOADS)
    print("on Valkey's shipped persistence (RDB snapshots):")
    print(f"lean QueueStore loop, no-op   {lean:>10,.0f} jobs/s")
    print(f"dispatch worker, no-op        {worker:>10,.0f} jobs/s ({worker / lean:.0%} of the lean loop)")
    print(f"dispatch worker, 50 ms jobs   {io50:>10,.0f} jobs/s ({io50 / bound:.0%} of the bound {bound:,.0f}/s)")
    print(f"asyncio sleeps alone, 50 ms   {loop:>10,.0f} /s     ({loop / bound:.0%} of the bound)")
    print(f"  the worker's 50 ms jobs against the event loop's own ceiling: {io50 / loop:.1%}")
    if lean_aof is not None and worker_aof is not None:
        print("on offload.local.embedded's persistence (AOF appendfsync everysec):")
        print(f"lean QueueStore loop, no-op   {lean_aof:>10,.0f} jobs/s")
        share = worker_aof / lean_aof
        print(f"dispatch worker, no-op        {worker_aof:>10,.0f} jobs/s ({share:.0%} of the lean loop)")
    print(
        json.dumps(
            {
                "worker_noop_per_s": round(worker),
                "lean_noop_per_s": round(lean),
                "worker_io50_per_s": round(io50),
                "io50_bound_per_s": round(bound),
                "noop_ratio": round(worker / lean, 3),
                "io50_ratio": round(io50 / bound, 3),
                "loop_io50_per_s": round(loop),
                "io50_loop_ratio": round(io50 / loop, 3),
                "worker_noop_aof_per_s": round(worker_aof) if worker_aof is not None else None,
                "lean_noop_aof_per_s": round(lean_aof) if lean_aof is not None else None,
                "noop_aof_ratio": round(worker_aof / lean_aof, 3) if worker_aof and lean_aof else None,
            }
        )
    )


def _wait_ready(url: str) -> None:
    async def ping() -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                redis = await connect(url)
                await redis.ping()
                await redis.aclose()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    asyncio.run(ping())


if __name__ == "__main__":
    main()
