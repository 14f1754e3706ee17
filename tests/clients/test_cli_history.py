"""`offload history <queue>` and `client.history()` read the queue's history from the store: the table shows the
busy buckets with their counts and says how many were empty; `--json` and the Python client (sync and async) give
every point of the range; a bad range or an unknown queue is one error line. Real Valkey."""

from __future__ import annotations

import asyncio

from test_cli import as_json, cli, failed, ok, with_store

from offload.client import AsyncClient, Client
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


async def _ran(store: QueueStore) -> None:
    await store.enqueue_many("hq", [JobSpec(input=i) for i in range(3)])
    done, dies, _ = await store.claim("hq", "w1", 3)
    await store.complete(done.id, done.token, "results/a.json", cost=0.5)
    assert await store.fail(dies.id, dies.token, "bad input", retryable=False) == "dead"


def test_history_table_json_and_client(valkey_url: str) -> None:
    with_store(valkey_url, _ran)
    table = ok(valkey_url, "history", "hq").splitlines()
    header = next(line for line in table if "retried" in line)
    assert header.split()[:6] == ["from", "in", "ok", "retried", "dead", "cancelled"]
    rows = [line for line in table if line.strip()[:4].isdigit()]  # "2026-12-06 21:40 ..." (one minute, or two)
    assert 1 <= len(rows) <= 2, table
    assert sum(int(r.split()[2]) for r in rows) == 3 and sum(int(r.split()[3]) for r in rows) == 1  # in, ok
    assert table[-1].endswith("of 60 minutes without activity")
    doc = as_json(valkey_url, "history", "hq", "--range", "week")
    assert (doc["step_s"], len(doc["points"])) == (3600, 168)
    assert sum(p["dead"] for p in doc["points"]) == 1  # flat, as the API shows a point
    with Client(valkey_url) as c:
        points = c.history("hq", "day")
    assert len(points) == 24 and sum(p.counts["enqueued"] for p in points) == 3
    assert sum(p.spend_usd["serverless"] for p in points) == 0.5

    async def in_loop() -> int:
        async with AsyncClient(valkey_url) as ac:
            return sum(p.counts["succeeded"] for p in await ac.history("hq"))

    assert asyncio.run(in_loop()) == 1


def test_bad_range_and_unknown_queue_are_one_error_line(valkey_url: str) -> None:
    with_store(valkey_url, _ran)
    assert cli(valkey_url, "history", "hq", "--range", "month").exit_code == 2  # a usage error, named by typer
    assert "unknown queue 'nope'" in failed(cli(valkey_url, "history", "nope"))
