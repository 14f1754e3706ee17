"""The benchmark job and how a worker process reports what it did. Imported by every app, in every venv: it needs
only the standard library and the sync redis-py client, which every peer installs.

The job is `job(run, i, n, sleep_s, track)`: wait `sleep_s` seconds (0: a no-op), and count itself done.

Counting stays out of the measured path: each worker process keeps its counters in memory (jobs done, jobs in
flight now, the peak in flight) and a reporter thread writes them to Valkey every 100 ms, plus at once when the
last of `n` jobs of a run is done (its wall-clock time is the run's finish time). Keys, for run id R:

    bench:R:done      hash pid -> jobs of the run done in that process
    bench:R:inflight  hash pid -> jobs started and not done yet
    bench:R:peak      hash pid -> the most in flight at once
    bench:R:finished  time.time() when the n-th job was done
    bench:R:warm      set once the warm-up job (i < 0) ran: the worker consumes
    bench:R:t0 / :t_enq   the producer's clock before its first and after its last enqueue

`track` (the durability runs) also writes each job's start and end to Valkey as it happens, so a process killed
with SIGKILL cannot take its counts with it: bench:R:starts and bench:R:ends, hashes i -> count.

A worker whose jobs run in short-lived child processes (RQ forks one per job) sets BENCH_SHARED_COUNTERS=1: the
counters are then kept in Valkey directly (field "shared"), one HINCRBY per start and end.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

REPORT_EVERY = 0.1
JobArgs = tuple[str, int, int, float, bool]  # run, i, n, sleep_s, track

_SETMAX = """
local v = redis.call('HINCRBY', KEYS[1], 'shared', ARGV[1])
if tonumber(ARGV[1]) > 0 and v > tonumber(redis.call('HGET', KEYS[2], 'shared') or '0') then
  redis.call('HSET', KEYS[2], 'shared', v)
end
return v
"""


def redis_url() -> str:
    return os.environ["BENCH_REDIS_URL"]


class Tracker:
    """The counters of one worker process (thread-safe; under gevent the lock and thread are green)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: dict[str, int] = {}
        self.inflight: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.finished: dict[str, float] = {}
        self.reported: set[str] = set()
        self.dirty: set[str] = set()
        self.shared = os.environ.get("BENCH_SHARED_COUNTERS") == "1"
        self._client: redis.Redis | None = None
        self._client_pid = 0
        self._thread: threading.Thread | None = None

    @property
    def client(self) -> redis.Redis:
        if self._client is None or self._client_pid != os.getpid():  # a forked child makes its own
            self._client = redis.Redis.from_url(redis_url())
            self._client_pid = os.getpid()
        return self._client

    def _ensure_reporter(self) -> None:
        if self._thread is None and not self.shared:
            with self.lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._report_loop, name="bench-reporter", daemon=True)
                    self._thread.start()

    def start(self, run: str, i: int, track: bool) -> None:
        if i < 0:
            return
        if track:
            self.client.hincrby(f"bench:{run}:starts", str(i), 1)
        if self.shared:
            self.client.eval(_SETMAX, 2, f"bench:{run}:inflight", f"bench:{run}:peak", 1)
            return
        self._ensure_reporter()
        with self.lock:
            now = self.inflight.get(run, 0) + 1
            self.inflight[run] = now
            if now > self.peak.get(run, 0):
                self.peak[run] = now
            self.dirty.add(run)

    def end(self, run: str, i: int, n: int, track: bool) -> None:
        if i < 0:
            self.client.set(f"bench:{run}:warm", "1", ex=3600)
            return
        if track:
            self.client.hincrby(f"bench:{run}:ends", str(i), 1)
        if self.shared:
            self.client.eval(_SETMAX, 2, f"bench:{run}:inflight", f"bench:{run}:peak", -1)
            if self.client.hincrby(f"bench:{run}:done", "shared", 1) == n:
                self.client.set(f"bench:{run}:finished", repr(time.time()), ex=3600)
            return
        last = False
        with self.lock:
            self.inflight[run] = self.inflight.get(run, 0) - 1
            done = self.done.get(run, 0) + 1
            self.done[run] = done
            if done == n:
                self.finished[run] = time.time()
                last = True
            self.dirty.add(run)
        if last:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            runs, self.dirty = self.dirty, set()
            rows = [
                (r, self.done.get(r, 0), self.inflight.get(r, 0), self.peak.get(r, 0), self.finished.get(r))
                for r in runs
            ]
        if not rows:
            return
        pid = str(os.getpid())
        pipe = self.client.pipeline(transaction=False)
        for run, done, inflight, peak, finished in rows:
            pipe.hset(f"bench:{run}:done", pid, done)
            pipe.hset(f"bench:{run}:inflight", pid, inflight)
            pipe.hset(f"bench:{run}:peak", pid, peak)
            if finished is not None and run not in self.reported:
                pipe.set(f"bench:{run}:finished", repr(finished), ex=3600)
                self.reported.add(run)
        pipe.execute()

    def _report_loop(self) -> None:
        while True:
            time.sleep(REPORT_EVERY)
            try:
                self.flush()
            except Exception as exc:  # a blip must not stop the reports
                print(f"bench reporter: {exc}", flush=True)


TRACKER = Tracker()


def job_sync(run: str, i: int, n: int, sleep_s: float, track: bool) -> None:
    """The job for thread, gevent and process workers: time.sleep stands for a blocking remote call."""
    TRACKER.start(run, i, track)
    if sleep_s:
        time.sleep(sleep_s)
    TRACKER.end(run, i, n, track)


async def job_async(run: str, i: int, n: int, sleep_s: float, track: bool) -> None:
    """The job for asyncio workers: asyncio.sleep stands for an awaited remote call."""
    import asyncio

    TRACKER.start(run, i, track)
    if sleep_s:
        await asyncio.sleep(sleep_s)
    TRACKER.end(run, i, n, track)


# -- producing ---------------------------------------------------------------------------------------------------


def parse_produce(argv: Sequence[str]) -> tuple[str, int, float, bool, int]:
    """`produce RUN N SLEEP_S TRACK(0/1) JOB_TIMEOUT_S`."""
    run, n, sleep_s, track, timeout = argv
    return run, int(n), float(sleep_s), track == "1", int(timeout)


def job_args(run: str, n: int, sleep_s: float, track: bool) -> list[JobArgs]:
    return [(run, i, n, sleep_s, track) for i in range(n)]


def wait_warm(run: str, timeout: float = 120.0) -> None:
    client = redis.Redis.from_url(redis_url())
    deadline = time.monotonic() + timeout
    while not client.exists(f"bench:{run}:warm"):
        if time.monotonic() > deadline:
            raise SystemExit(f"the worker did not run the warm-up job of {run} within {timeout:g}s")
        time.sleep(0.02)
    client.close()


def stamp(run: str, name: str) -> None:
    client = redis.Redis.from_url(redis_url())
    client.set(f"bench:{run}:{name}", repr(time.time()), ex=3600)
    client.close()


def produce_sync(argv: Sequence[str], enqueue: Callable[[Iterable[JobArgs]], None]) -> None:
    """The producer's protocol: a warm-up job, wait until a worker ran it, then time the enqueue of N jobs."""
    run, n, sleep_s, track, _ = parse_produce(argv)
    enqueue([(run, -1, n, 0.0, False)])
    wait_warm(run)
    stamp(run, "t0")
    enqueue(job_args(run, n, sleep_s, track))
    stamp(run, "t_enq")


async def produce_async(argv: Sequence[str], enqueue: Callable[[list[JobArgs]], Any], *, batch: int = 100) -> None:
    """As produce_sync, for asyncio clients: `enqueue(chunk)` is awaited for chunks of `batch` jobs (an async
    producer would send its jobs concurrently)."""
    import asyncio

    run, n, sleep_s, track, _ = parse_produce(argv)
    await enqueue([(run, -1, n, 0.0, False)])
    await asyncio.to_thread(wait_warm, run)
    stamp(run, "t0")
    jobs = job_args(run, n, sleep_s, track)
    for k in range(0, n, batch):
        await enqueue(jobs[k : k + batch])
    stamp(run, "t_enq")
