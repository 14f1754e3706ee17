"""offload's side of the no-op and 50 ms workloads, in the project's venv.

    python offload_app.py work-dispatch CONCURRENCY   # offload's dispatch worker (offload.worker.dispatch.Worker)
    python offload_app.py work-store CONCURRENCY      # a lean loop over QueueStore: the queue's own ceiling
    python offload_app.py produce RUN N SLEEP TRACK TIMEOUT

`work-dispatch` runs the real dispatch worker class, unchanged, with an in-process backend in place of a remote
API: `submit` waits the job's seconds (asyncio.sleep) and returns the result at once, the way a synchronous API
such as chat completions does, and the output is not stored anywhere (the peers store none either). So every
job takes the worker's real path: claim (in batches), the cap check (only when a cap is set), the shared
cool-down check, submit, record the remote id, complete (the per-job store writes of all tasks coalesced into
batched script calls), and one heartbeat per interval for all leases.

`work-store` is what a worker written directly against QueueStore can do: claim up to the free slots in one
call, run each job as a task, and acknowledge finished jobs with complete_many (every job done since the last
call, in one script call). A job counts as done when its acknowledgement returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson

from offload import eventloop
from offload.backends.base import RemoteResult, Submission
from offload.connection import connect
from offload.eventloop import within
from offload.models import ClaimedJob
from offload.queue.backend_limits import BackendLimits
from offload.queue.replies import Verdict
from offload.queue.specs import JobSpec
from offload.queue.store import DEFAULT_LEASE_MS, CompleteItem, QueueStore
from offload.worker.dispatch import Worker, WorkerOptions, default_worker_id

if TYPE_CHECKING:  # at run time apps/ is on sys.path; mypy sees it as part of the bench package
    from bench.peers.apps import benchjob
else:
    import benchjob

QUEUE = "bench"
ENQUEUE_BATCH = 5_000


def _args(job_input: Any) -> benchjob.JobArgs:
    return (
        str(job_input["run"]),
        int(job_input["i"]),
        int(job_input["n"]),
        float(job_input["sleep"]),
        bool(job_input["track"]),
    )


class LocalBackend:
    """A remote API that answers synchronously after the job's seconds, without a network."""

    name = "local"
    synchronous = True

    def __init__(self) -> None:
        self.args: dict[str, benchjob.JobArgs] = {}

    async def submit(self, job_input: Any, *, tag: str, idempotency_key: str | None = None) -> Submission:
        run, i, _, sleep_s, track = args = _args(job_input)
        self.args[tag] = args
        benchjob.TRACKER.start(run, i, track)
        if sleep_s:
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
    """QueueStore that counts a job done once its completion was acknowledged."""

    def __init__(self, redis: Any, backend: LocalBackend) -> None:
        super().__init__(redis)
        self.backend = backend

    async def complete_many(self, queue: str, items: Sequence[CompleteItem]) -> list[Verdict]:
        """The worker acks through here (batched); a job counts as done once its ack is accepted."""
        codes = await super().complete_many(queue, items)
        for (job_id, *_), code in zip(items, codes, strict=True):
            if code == "OK" and job_id in self.backend.args:
                run, i, n, _, track = self.backend.args.pop(job_id)
                benchjob.TRACKER.end(run, i, n, track)
        return codes


async def work_dispatch(concurrency: int) -> None:
    redis = await connect(benchjob.redis_url())
    backend = LocalBackend()

    async def save(key: str, output: Any, run: str, fence: Any) -> str:
        return key

    options = WorkerOptions(queue=QUEUE, backend_name=backend.name, concurrency=concurrency)
    worker = Worker(CountingStore(redis, backend), backend, save, BackendLimits(redis, backend.name, None), options)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await worker.run(stop)
    finally:
        await redis.aclose()


async def work_store(concurrency: int) -> None:
    redis = await connect(benchjob.redis_url())
    store = QueueStore(redis)
    worker_id = default_worker_id()
    running: dict[str, asyncio.Task[None]] = {}
    finished: list[tuple[ClaimedJob, benchjob.JobArgs]] = []
    slot, work_done = asyncio.Event(), asyncio.Event()

    async def run_job(job: ClaimedJob) -> None:
        run, i, _, sleep_s, track = args = _args(orjson.loads(job.input_json))
        benchjob.TRACKER.start(run, i, track)
        if sleep_s:
            await asyncio.sleep(sleep_s)
        finished.append((job, args))
        work_done.set()

    async def acknowledge() -> None:
        while True:
            await work_done.wait()
            work_done.clear()
            batch = finished[:]
            del finished[:]
            codes = await store.complete_many(QUEUE, [(job.id, job.token, job.output_key, None) for job, _ in batch])
            for (job, (run, i, n, _, track)), code in zip(batch, codes, strict=True):
                running.pop(job.id, None)
                if code == "OK":
                    benchjob.TRACKER.end(run, i, n, track)
            slot.set()

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(DEFAULT_LEASE_MS / 3000)
            await store.heartbeat(QUEUE, worker_id, list(running))

    helpers = [asyncio.create_task(acknowledge()), asyncio.create_task(heartbeat())]
    idle = 0.02
    try:
        while True:  # the dispatch worker's claim loop: batches of up to 500, idle back-off 20 ms .. 0.5 s
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
    finally:
        for task in helpers:
            task.cancel()
        await redis.aclose()


async def produce(argv: list[str]) -> None:
    run, n, sleep_s, track, _ = benchjob.parse_produce(argv)
    redis = await connect(benchjob.redis_url())
    store = QueueStore(redis)

    def spec(i: int) -> JobSpec:
        return JobSpec(input={"run": run, "i": i, "n": n, "sleep": sleep_s, "track": track}, retention=3600)

    await store.enqueue(QUEUE, spec(-1))
    await asyncio.to_thread(benchjob.wait_warm, run)
    specs = [spec(i) for i in range(n)]
    benchjob.stamp(run, "t0")
    for k in range(0, n, ENQUEUE_BATCH):
        await store.enqueue_many(QUEUE, specs[k : k + ENQUEUE_BATCH])
    benchjob.stamp(run, "t_enq")
    await redis.aclose()


def main() -> None:
    command = sys.argv[1]
    if command == "work-dispatch":
        eventloop.run(work_dispatch(int(sys.argv[2])))  # the loop `offload worker` runs on
    elif command == "work-store":
        eventloop.run(work_store(int(sys.argv[2])))
    elif command == "produce":
        asyncio.run(produce(sys.argv[2:]))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
