"""Dramatiq with the Redis broker, in its own venv. `python dramatiq_app.py work CONCURRENCY` execs the dramatiq
CLI with one worker process of CONCURRENCY threads (`--processes 1 --threads N`); everything else is Dramatiq's
default (its Redis broker acks after the job, requeues a dead worker's messages after its heartbeat timeout),
except that the worker's Redis pool is sized to its threads.
`produce` calls send(), one message per job."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import benchjob
import dramatiq
from dramatiq.brokers.redis import RedisBroker

# redis-py 8's pool holds at most 100 connections and raises past that ("Too many connections": acks fail and
# are retried 5 s later), so the worker's pool is sized to its threads.
_threads = os.environ.get("BENCH_THREADS")
_url = benchjob.redis_url() + (f"?max_connections={int(_threads) + 10}" if _threads else "")
dramatiq.set_broker(RedisBroker(url=_url))


@dramatiq.actor(queue_name="bench")
def job(run: str, i: int, n: int, sleep_s: float, track: bool) -> None:
    benchjob.job_sync(run, i, n, sleep_s, track)


def enqueue(jobs: Iterable[benchjob.JobArgs]) -> None:
    for args in jobs:
        job.send(*args)


if __name__ == "__main__":
    if sys.argv[1] == "work":
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["BENCH_THREADS"] = sys.argv[2]
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "dramatiq",
                "dramatiq_app",
                "--processes",
                "1",
                "--threads",
                sys.argv[2],
                "--path",
                here,
                "--queues",
                "bench",
            ],
        )
    else:
        benchjob.produce_sync(sys.argv[2:], enqueue)
