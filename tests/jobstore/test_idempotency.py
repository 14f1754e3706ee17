"""An idempotency key answers its job's id as long as the key lives, also after the job finished and its record
was trimmed (a key lives at least a day past its job's end, often longer than the record): on every enqueue path
(the Python clients and the store, the HTTP API single and batch, `offload enqueue` and `--file`, the tutorial's
list through ingest.lua). Before, a repeat after the trim made a new job, and a dispatch worker paid for it again.

Real Valkey, the real simulator over HTTP and a real dispatch worker; records are trimmed by the real reaper on the
real clock (retention 1 s), polled for, never slept on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypedDict, TypeVar

import orjson
import pytest
from support.admin_redis import redis_admin
from support.server_helpers import client, new_queue, server
from test_cli import as_json, cli
from test_worker_faults import configure, job_input, make_settings, serving, stats, until

from offload.client import AsyncClient
from offload.connection import connect
from offload.errors import JobNotFound
from offload.queue import keyspace
from offload.queue.keyspace import prefix
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

T = TypeVar("T")


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig()) as url:
        yield str(url)


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


async def trimmed(store: QueueStore, queue: str, job_id: str) -> None:
    """Run the reaper (as every worker and server does) until the finished job's record is trimmed."""

    async def gone() -> bool:
        await store.reap(queue)
        try:
            await store.get(job_id)
        except JobNotFound:
            return True
        return False

    await until(gone, f"the record of {job_id} to be trimmed", timeout=30)


async def finish(store: QueueStore, queue: str, job_id: str) -> None:
    """Run one job through the store's own claim and complete (a worker's two scripts)."""
    (job,) = await store.claim(queue, "w-test", 1)
    assert job.id == job_id
    await store.complete(job.id, job.token, f"s3://bucket/results/{job.id}.json")


def with_valkey(url: str, fn: Callable[[QueueStore], Awaitable[T]]) -> T:
    async def go() -> T:
        redis = await connect(url)
        try:
            return await fn(QueueStore(redis))
        finally:
            await redis.aclose()

    return asyncio.run(go())


class _Keyed(TypedDict):
    idempotency_key: str
    retention: int


async def test_a_key_repeated_after_its_record_was_trimmed_is_not_paid_for_again(
    valkey_url: str, sim: str, store: QueueStore, tmp_path: Path
) -> None:
    """The job runs (one paid submission), its record is trimmed while its key lives, the producer repeats the
    enqueue: the same id comes back, marked, and nothing is submitted again (a sentinel job enqueued after it
    is the proof the worker had every chance to)."""
    await configure(sim)
    settings = make_settings(valkey_url, {"kind": "local", "path": str(tmp_path)}, sim, "http-job")
    spec: _Keyed = {"idempotency_key": "order-17", "retention": 1}
    async with AsyncClient(valkey_url) as producer, serving(settings) as worker:
        first = await producer.enqueue("q", job_input("paid-once"), **spec)

        async def succeeded() -> bool:
            return (await store.get(first)).state.value == "succeeded"

        await until(succeeded, "the first run to succeed", worker)
        await trimmed(store, "q", first)
        assert await redis_admin(store.redis).ttl(prefix("q") + "idem:order-17") > 3600  # the key outlives the record
        assert await producer.enqueue("q", job_input("paid-once"), **spec) == first
        (again,) = await store.enqueue_results("q", [JobSpec(input=job_input("paid-once"), **spec)])
        assert again.id == first and again.record_gone
        sentinel = await producer.enqueue("q", job_input("sentinel"))

        async def sentinel_done() -> bool:
            return (await store.get(sentinel)).state.value == "succeeded"

        await until(sentinel_done, "the sentinel to succeed", worker)
    assert (await stats(sim))["submissions_by_input_id"] == {"paid-once": 1, "sentinel": 1}
    counts = (await store.stats("q")).counts
    assert counts["queued"] == counts["active"] == counts["delayed"] == counts["retrying"] == 0


async def test_the_bulk_path_marks_each_trimmed_key_and_enqueues_the_rest(store: QueueStore) -> None:
    """One enqueue_many call with a trimmed key, a live key, a new key and no key."""
    old = await store.enqueue("q", JobSpec(input=1, idempotency_key="old", retention=1))
    live = await store.enqueue("q", JobSpec(input=2, idempotency_key="live"))
    await finish(store, "q", old)
    await trimmed(store, "q", old)
    done = await store.enqueue_results(
        "q",
        [
            JobSpec(input=3, idempotency_key="old"),
            JobSpec(input=4, idempotency_key="live"),
            JobSpec(input=5, idempotency_key="new"),
            JobSpec(input=6),
        ],
    )
    assert [(d.id, d.record_gone) for d in done[:2]] == [(old, True), (live, False)]
    assert not done[2].record_gone and not done[3].record_gone and len({d.id for d in done}) == 4
    assert await store.enqueue_many("q", [JobSpec(input=7, idempotency_key="old")]) == [old]
    assert (await store.stats("q")).counts["queued"] == 3  # live, new and the keyless one: not the old one again


async def test_a_tutorial_job_pushed_again_after_its_record_was_trimmed_is_not_ingested_again(
    store: QueueStore,
) -> None:
    """ingest.lua names a tutorial job by its id and keeps `idem:tutorial:<id>`: the key, not the record, says
    it ran."""
    entry = orjson.dumps({"id": "t-1", "input": {"n": 1}})
    await redis_admin(store.redis).rpush("tut:jobs", entry)
    assert await store.ingest("tut:jobs", "q", retention=1) == (1, 0)
    await finish(store, "q", "q:t-1")
    await trimmed(store, "q", "q:t-1")
    await redis_admin(store.redis).rpush("tut:jobs", entry)
    assert await store.ingest("tut:jobs", "q", retention=1) == (1, 0)  # taken off the list, counted, not run
    assert (await store.stats("q")).counts["queued"] == 0
    with pytest.raises(JobNotFound):
        await store.get("q:t-1")


def test_the_http_api_answers_a_trimmed_key_with_its_id_marked(valkey_url: str) -> None:
    with server(valkey_url) as (url, admin), client(url, admin) as c:
        q = new_queue("idem")
        body = {"input": {"n": 1}, "retention": 1}
        first = c.post(f"/v1/queues/{q}/jobs", json=body, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == 201 and first.json()["record_gone"] is False
        batch = c.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [body, body]}, headers={"Idempotency-Key": "b"})
        assert batch.status_code == 201 and batch.json()["record_gone"] == []
        ids = [first.json()["id"], *batch.json()["ids"]]

        async def run_and_trim(store: QueueStore) -> None:
            for job_id in ids:
                await finish(store, q, job_id)
            for job_id in ids:
                await trimmed(store, q, job_id)

        with_valkey(valkey_url, run_and_trim)
        again = c.post(f"/v1/queues/{q}/jobs", json=body, headers={"Idempotency-Key": "k-1"})
        assert again.status_code == 200
        assert again.json() == {"id": ids[0], "duplicate": True, "record_gone": True}
        assert c.get(f"/v1/jobs/{ids[0]}").status_code == 404
        batch = c.post(
            f"/v1/queues/{q}/jobs/batch", json={"jobs": [body, body, body]}, headers={"Idempotency-Key": "b"}
        )
        assert batch.status_code == 201
        doc = batch.json()
        assert doc["ids"][:2] == ids[1:] and doc["record_gone"] == ids[1:] and doc["ids"][2] not in ids
        counts = c.get(f"/v1/queues/{q}").json()["counts"]
        assert counts["queued"] == 1  # only the batch's new third item


def test_offload_enqueue_says_a_trimmed_key_ran_already(valkey_url: str, tmp_path: Path) -> None:
    line = '{"input": {"n": 1}, "idempotency_key": "cli-1"}'
    first = as_json(valkey_url, "enqueue", "-q", "cli", "--file", "-", input=line)
    (job_id,) = first["ids"]
    assert first["record_gone"] == []

    async def run_and_trim(store: QueueStore) -> None:
        await store.redis.hset(keyspace.job("cli", job_id), "retention", 1)  # --file lines take no retention
        await finish(store, "cli", job_id)
        await trimmed(store, "cli", job_id)

    with_valkey(valkey_url, run_and_trim)
    again = as_json(valkey_url, "enqueue", "-q", "cli", "--file", "-", input=line)
    assert again == {"count": 1, "ids": [job_id], "record_gone": [job_id]}
    single = as_json(valkey_url, "enqueue", "-q", "cli", "-i", "{}", "--idempotency-key", "cli-1")
    assert single == {"id": job_id, "record_gone": True}
    plain = cli(valkey_url, "enqueue", "-q", "cli", "-i", "{}", "--idempotency-key", "cli-1")
    assert plain.exit_code == 0 and plain.stdout == f"{job_id}\n"
    assert "already ran under their idempotency key" in plain.stderr
    assert with_valkey(valkey_url, lambda store: store.stats("cli")).counts["queued"] == 0
