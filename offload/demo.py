"""`offload demo`: the main job on the embedded default, end to end.

It brings the local stack up if it is not running (embedded Valkey, embedded S3, the GPU API simulator, two
dispatch workers), enqueues a batch, shows it move with a live progress bar, and ends with where the results
are and how to read one.
"""

from __future__ import annotations

import asyncio
import os

import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from offload import stack
from offload.config import load_settings
from offload.connection import connect
from offload.embedded import data_dir
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.storage import S3StorageSettings, create_storage

PROMPTS = ("a haiku about queues", "a limerick about GPUs", "a sonnet about retries", "an ode to idempotency")


async def run_demo(console: Console, jobs: int = 40, timeout: float = 300.0) -> str:
    """Run a batch through the local stack; returns the id of the first job."""
    for name, where in await asyncio.to_thread(stack.up):
        console.print(f"[bold]{name:<10}[/] {where}")
    settings = load_settings(stack.config_path(), env={**os.environ, **stack.secret_env()})
    redis = await connect(settings.redis_url)
    store = QueueStore(redis)
    try:
        specs = [JobSpec(input={"prompt": PROMPTS[i % len(PROMPTS)], "n": i}) for i in range(jobs)]
        ids = await store.enqueue_many(stack.QUEUE, specs)
        console.print(f"\nenqueued {jobs} jobs on queue {stack.QUEUE!r}; the simulator takes 1-3 s per job")
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("", total=jobs)
            while True:
                states = [job.state.value for job in await asyncio.gather(*(store.get(i) for i in ids))]
                counts = {
                    s: states.count(s)
                    for s in ("queued", "active", "submitted", "retrying", "succeeded", "dead", "cancelled")
                }
                finished = counts["succeeded"] + counts["dead"] + counts["cancelled"]
                progress.update(
                    bar,
                    completed=finished,
                    description=(
                        f"queued {counts['queued']}  in flight {counts['active'] + counts['submitted']}  "
                        f"succeeded {counts['succeeded']}  retrying {counts['retrying']}  dead {counts['dead']}"
                    ),
                )
                if finished == jobs or loop.time() > deadline:
                    break
                await asyncio.sleep(0.2)
        first = await store.get(ids[0])
        storage = create_storage(settings.storage)
        try:
            body = orjson.loads(await storage.get_bytes(first.output_key)) if first.result else None
        finally:
            await storage.aclose()
        block = settings.storage
        if isinstance(block, S3StorageSettings):  # the local stack's: its embedded S3 server
            console.print(
                f"\nresults are in {block.endpoint_url} bucket {block.bucket!r} "
                f"under results/ (files under {data_dir() / 's3' / 'results'})"
            )
        console.print(f"job {first.id}: {first.state.value}, stored at {first.result}")
        console.print(f"its output: {orjson.dumps(body).decode()[:300]}")
        console.print(
            f"\nread one:     offload result {first.id} --download out.json"
            "\nwatch queues: offload queues --watch"
            "\nstop it all:  offload down"
        )
        return ids[0]
    finally:
        await redis.aclose()
