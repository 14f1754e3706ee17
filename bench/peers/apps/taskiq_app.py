"""taskiq with taskiq-redis's RedisStreamBroker (the broker its README recommends; it acknowledges messages), in
its own venv (redis-py >= 8, < 9). `python taskiq_app.py work CONCURRENCY` execs `taskiq worker` with one worker
process (`--workers 1`; the CLI's default is 2) and `--max-async-tasks CONCURRENCY`; everything else is taskiq's
default (ack when the result is saved, unacknowledged messages reclaimed after 10 min idle). `produce` calls
kiq(), 100 at a time."""

from __future__ import annotations

import asyncio
import os
import sys

import benchjob
from taskiq_redis import RedisStreamBroker

broker = RedisStreamBroker(url=benchjob.redis_url(), queue_name="bench")


@broker.task(task_name="bench.job")
async def job(run: str, i: int, n: int, sleep_s: float, track: bool) -> None:
    await benchjob.job_async(run, i, n, sleep_s, track)


async def produce(argv: list[str]) -> None:
    await broker.startup()

    async def enqueue(jobs: list[benchjob.JobArgs]) -> None:
        await asyncio.gather(*(job.kiq(*args) for args in jobs))

    await benchjob.produce_async(argv, enqueue)
    await broker.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "work":
        here = os.path.dirname(os.path.abspath(__file__))
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "taskiq",
                "worker",
                "taskiq_app:broker",
                "--workers",
                "1",
                "--max-async-tasks",
                sys.argv[2],
                "--app-dir",
                here,
                "--log-level",
                "WARNING",
            ],
        )
    else:
        asyncio.run(produce(sys.argv[2:]))
