"""arq, in its own venv (redis-py < 6). `python arq_app.py work CONCURRENCY` runs one worker with max_jobs =
CONCURRENCY; everything else is arq's default (poll every 0.5 s, job timeout 300 s, results kept 1 h).
`produce` calls enqueue_job, 100 at a time."""

from __future__ import annotations

import asyncio
import sys
from typing import Any, ClassVar

import benchjob
from arq import create_pool
from arq.connections import RedisSettings
from arq.worker import run_worker

SETTINGS = RedisSettings.from_dsn(benchjob.redis_url())


async def job(ctx: dict[str, Any], run: str, i: int, n: int, sleep_s: float, track: bool) -> None:
    await benchjob.job_async(run, i, n, sleep_s, track)


class WorkerSettings:
    functions: ClassVar[list[Any]] = [job]
    redis_settings = SETTINGS
    max_jobs = 100


async def produce(argv: list[str]) -> None:
    pool = await create_pool(SETTINGS)

    async def enqueue(jobs: list[benchjob.JobArgs]) -> None:
        await asyncio.gather(*(pool.enqueue_job("job", *args) for args in jobs))

    await benchjob.produce_async(argv, enqueue)
    await pool.aclose()


if __name__ == "__main__":
    if sys.argv[1] == "work":
        WorkerSettings.max_jobs = int(sys.argv[2])
        run_worker(WorkerSettings)
    else:
        asyncio.run(produce(sys.argv[2:]))
