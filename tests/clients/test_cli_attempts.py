"""A job's attempts under `offload status` (table and --json) and from `Client.attempts`, against a real Valkey: a
job that failed once and runs again shows both attempts, the error as it was recorded, the running one's token
never."""

from __future__ import annotations

import asyncio

import orjson
from typer.testing import CliRunner

from offload import Client
from offload.cli.app import app
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

runner = CliRunner()


async def _failed_once(url: str) -> tuple[str, str, str]:
    redis = await connect(url)
    store = QueueStore(redis)
    try:
        job_id = await store.enqueue("gpu", JobSpec(input={"p": 1}, max_attempts=3))
        (first,) = await store.claim("gpu", "host-a:11", 1)
        await store.fail(first.id, first.token, "HTTP 502 from <provider>", delay_ms=0)
        (second,) = await store.claim("gpu", "host-b:22", 1)
        return job_id, first.token, second.token
    finally:
        await redis.aclose()


def test_status_and_client_show_each_attempt(valkey_url: str) -> None:
    job_id, ended_token, live_token = asyncio.run(_failed_once(valkey_url))
    table = runner.invoke(app, ["status", job_id, "--url", valkey_url])
    assert table.exit_code == 0, table.output
    assert "host-a:11" in table.stdout and "host-b:22" in table.stdout
    assert "HTTP 502 from <provider>" in table.stdout and "failed" in table.stdout and "running" in table.stdout
    assert live_token not in table.stdout
    doc = runner.invoke(app, ["status", job_id, "--json", "--url", valkey_url])
    history = orjson.loads(doc.stdout)["attempt_history"]
    assert history["made"] == 2
    assert [(a["number"], a["outcome"], a["token"]) for a in history["attempts"]] == [
        (1, "failed", ended_token),
        (2, None, None),
    ]
    with Client(valkey_url) as client:
        kept, made = client.attempts(job_id)
    assert made == 2 and kept[0].error == "HTTP 502 from <provider>" and kept[1].claimed_by == "host-b:22"
