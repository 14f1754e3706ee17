"""`offload demo`: the main job on the embedded default, for a first look on a fresh clone.

For now it shows the durable queue (the dispatch worker that runs the jobs arrives with issue #3): it starts or
reuses the embedded Valkey, enqueues a batch with priorities, a delayed job and an idempotent repeat, and
prints what the queue holds and how to look further.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from offload.connection import connect, mask_url, resolve_url
from offload.queue.store import JobSpec, QueueStore

PROMPTS = ("a haiku about queues", "a limerick about GPUs", "a sonnet about retries", "an ode to idempotency")


async def run_demo(console: Console, url: str | None = None, queue: str = "demo", jobs: int = 12) -> str:
    """Enqueue a small batch and print the queue; returns the id of the first job."""
    url = resolve_url(url)
    console.print(f"queue store   [bold]{mask_url(url)}[/] (embedded Valkey unless OFFLOAD_REDIS_URL is set)")
    redis = await connect(url)
    try:
        store = QueueStore(redis)
        specs = [JobSpec(input={"prompt": PROMPTS[i % len(PROMPTS)], "n": i}, priority=i % 3) for i in range(jobs)]
        ids = await store.enqueue_many(queue, specs)
        later = await store.enqueue(queue, JobSpec(input={"prompt": "tomorrow's news"}, delay=3600))
        once = await store.enqueue(queue, JobSpec(input={"prompt": "only once"}, idempotency_key="demo-once"))
        again = await store.enqueue(queue, JobSpec(input={"prompt": "only once"}, idempotency_key="demo-once"))
        console.print(f"enqueued      {len(ids)} jobs with priorities 0-2, 1 delayed by an hour, "
                      f"1 idempotent job enqueued twice -> same id: {once == again}")
        stats = await store.stats(queue)
        table = Table(title=f"queue {queue!r}")
        for name in stats.counts:
            table.add_column(name, justify="right")
        table.add_row(*(str(v) for v in stats.counts.values()))
        console.print(table)
        first = await store.get(ids[0])
        console.print(f"first job     {first.id}: {first.state.value}, input {first.input}, "
                      f"result goes to {first.output_key}")
        console.print(f"delayed job   {later}: runs at epoch ms {(await store.get(later)).run_at}")
        console.print("\nlook further:  offload status " + ids[0] + "\n               offload queues --watch"
                      "\n               offload jobs demo --state queued --json")
        return ids[0]
    finally:
        await redis.aclose()
