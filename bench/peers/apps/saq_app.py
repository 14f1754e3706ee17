"""SAQ with its Redis queue, in its own venv (redis-py < 8; SAQ 0.26.4 also needs typing_extensions).
`python saq_app.py work CONCURRENCY` runs one worker with concurrency = CONCURRENCY; everything else is SAQ's
default (job timeout 10 s, one attempt, stuck jobs swept every 60 s), except that jobs longer than the default
timeout allows are enqueued with a longer one (the harness passes it). `produce` calls enqueue(), 100 at a time."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import benchjob
from saq import Queue, Worker


async def job(ctx: dict[str, Any], *, run: str, i: int, n: int, sleep_s: float, track: bool) -> None:
    await benchjob.job_async(run, i, n, sleep_s, track)


async def produce(queue: Queue, argv: list[str]) -> None:
    timeout = benchjob.parse_produce(argv)[4]
    options: dict[str, Any] = {"timeout": timeout} if timeout else {}

    async def enqueue(jobs: list[benchjob.JobArgs]) -> None:
        await asyncio.gather(
            *(queue.enqueue("job", run=r, i=i, n=n, sleep_s=s, track=t, **options) for r, i, n, s, t in jobs)
        )

    await queue.connect()
    await benchjob.produce_async(argv, enqueue)
    await queue.disconnect()


async def work(queue: Queue, concurrency: int) -> None:
    await Worker(queue, functions=[job], concurrency=concurrency).start()


if __name__ == "__main__":
    q = Queue.from_url(benchjob.redis_url(), name="bench")
    if sys.argv[1] == "work":
        asyncio.run(work(q, int(sys.argv[2])))
    else:
        asyncio.run(produce(q, sys.argv[2:]))
