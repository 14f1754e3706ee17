"""`offload demo`: the main job on the embedded default, end to end.

It brings the local stack up if it is not running (embedded Valkey, embedded S3, the GPU API simulator, two
dispatch workers), enqueues a batch, shows it move with a live progress bar, and ends with where the results
are and how to read one.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from offload.config import load_settings
from offload.connection import connect
from offload.env import process_env
from offload.local import stack
from offload.local.embedded import data_dir
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.storage import S3StorageSettings, create_storage

PROMPTS = ("a haiku about queues", "a limerick about GPUs", "a sonnet about retries", "an ode to idempotency")


def preview(value: Any, width: int = 60, items: int = 5) -> Any:
    """The value with long strings cut (ending in an ellipsis) and long lists shortened: still valid JSON, and one
    line of it shows the shape of the output without cutting through a token."""
    if isinstance(value, str):
        return value if len(value) <= width else value[: width - 1] + "…"
    if isinstance(value, list):
        shown = [preview(v, width, items) for v in value[:items]]
        return [*shown, f"… {len(value) - items} more"] if len(value) > items else shown
    if isinstance(value, dict):
        return {k: preview(v, width, items) for k, v in value.items()}
    return value


def command() -> str:
    """How this shell runs this install's `offload`: the bare name when PATH finds it, else its path (relative to
    the working directory when under it, as `.venv/bin/offload` after `make demo`)."""
    mine = Path(sys.executable).parent / "offload"
    if not mine.exists():
        return f"{sys.executable} -m offload"
    found = shutil.which("offload")
    if found is not None and Path(found).resolve() == mine.resolve():
        return "offload"
    with contextlib.suppress(ValueError):
        return str(mine.absolute().relative_to(Path.cwd()))
    return str(mine)


def hints(job_id: str) -> str:
    """What to run next, runnable as printed (a copied line works without the virtualenv on PATH)."""
    run = command()
    lines = [
        f"read one:     {run} result {job_id} --download out/",
        f"watch queues: {run} queues --watch",
        f"stop it all:  {run} down",
    ]
    activate = Path(run).parent / "activate"  # the virtualenv's, beside its `offload`
    if run != "offload" and activate.is_file():
        lines.append(f"(or run `source {activate}` once: then plain `offload` works in this shell)")
    return "\n" + "\n".join(lines)


async def run_demo(console: Console, jobs: int = 40, timeout: float = 300.0) -> str:
    """Run a batch through the local stack; returns the id of the first job."""
    for name, where in await asyncio.to_thread(stack.up):
        console.print(f"[bold]{name:<10}[/] {where}")
    settings = load_settings(stack.config_path(), env={**process_env(), **stack.secret_env()})
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
        console.print(f"job {first.id}: {first.state.value}, stored at {first.result}", soft_wrap=True)
        console.print(Text(f"its output: {orjson.dumps(preview(body)).decode()}"), soft_wrap=True)
        console.print(Text(hints(first.id)), soft_wrap=True)
        return ids[0]
    finally:
        await redis.aclose()
