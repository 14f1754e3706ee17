"""RQ, in its own venv. `python rq_app.py work CONCURRENCY` runs RQ's default worker, which runs one job at a time
and forks a work horse for each (CONCURRENCY is ignored: RQ has no in-process concurrency; more jobs at once means
more worker processes). The job's counters therefore live in Valkey (the harness sets
BENCH_SHARED_COUNTERS=1). `produce` uses
Queue.enqueue_many (one pipeline per 1,000 jobs)."""

from __future__ import annotations

import sys
from collections.abc import Iterable

import benchjob
from redis import Redis
from rq import Queue, Worker


def job(run: str, i: int, n: int, sleep_s: float, track: bool) -> None:
    benchjob.job_sync(run, i, n, sleep_s, track)


def main() -> None:
    connection = Redis.from_url(benchjob.redis_url())
    queue = Queue("bench", connection=connection)
    if sys.argv[1] == "work":
        Worker([queue], connection=connection).work(logging_level="WARNING")
        return

    def enqueue(jobs: Iterable[benchjob.JobArgs]) -> None:
        items = list(jobs)
        for k in range(0, len(items), 1000):
            queue.enqueue_many([Queue.prepare_data("rq_app.job", args=args) for args in items[k : k + 1000]])

    benchjob.produce_sync(sys.argv[2:], enqueue)


if __name__ == "__main__":
    main()
