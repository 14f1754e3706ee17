"""Celery with the Redis broker, in its own venv. `python celery_app.py work CONCURRENCY` runs one worker process
with the gevent pool (one process, CONCURRENCY jobs at once: the pool Celery documents for I/O-bound work; prefork
would need a process per job). `python celery_app.py produce RUN N SLEEP TRACK TIMEOUT` enqueues with
apply_async, one message per job. Everything else is Celery's default: no result backend, early ack,
prefetch multiplier 4, the Redis transport's 1 h visibility timeout."""

from __future__ import annotations

import sys

if len(sys.argv) > 1 and sys.argv[1] == "work":  # gevent must patch before anything else is imported
    from gevent import monkey

    monkey.patch_all()

from collections.abc import Iterable

import benchjob
from celery import Celery

app = Celery("bench", broker=benchjob.redis_url())
app.conf.worker_hijack_root_logger = False


@app.task(name="bench.job")
def job(run: str, i: int, n: int, sleep_s: float, track: bool) -> None:
    benchjob.job_sync(run, i, n, sleep_s, track)


def enqueue(jobs: Iterable[benchjob.JobArgs]) -> None:
    for args in jobs:
        job.apply_async(args=args, queue="bench")


if __name__ == "__main__":
    if sys.argv[1] == "work":
        app.worker_main(
            ["worker", "--pool", "gevent", "--concurrency", sys.argv[2], "--queues", "bench", "--loglevel", "WARNING"]
        )
    else:
        benchjob.produce_sync(sys.argv[2:], enqueue)
