"""The server's part of lease safety: held jobs released by its maintenance, GPU workers' leases judged by token
and leases they never received handed back, and the possible-duplicate counter in /metrics. A real server
(uvicorn, in a thread) on the session's Valkey."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from support.eventually import eventually_sync
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer
from test_server_metrics import scrape

from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _with_store(url: str, fn: Callable[[QueueStore], Awaitable[T]]) -> T:
    redis = await connect(url)
    try:
        return await fn(QueueStore(redis))
    finally:
        await redis.aclose()


def test_the_servers_maintenance_releases_jobs_held_in_a_past_window(valkey: ValkeyServer) -> None:
    """Held jobs used to go back only when a dispatch worker's window changed; a queue whose
    workers were all stopped at midnight (or that only GPU workers serve) kept them a day longer."""
    q = new_queue("held")

    async def hold_some(store: QueueStore) -> list[str]:
        ids = await store.enqueue_many(q, [JobSpec(input=i) for i in range(3)])
        for c in await store.claim(q, "w", 3):
            await store.hold(c.id, c.token, "daily jobs cap reached", "20200101")
        await store.release_leases(q, "w")
        return ids

    ids = run(_with_store(valkey.url, hold_some))
    with server(valkey.url) as (url, boot), client(url, boot) as c:

        def released() -> bool:
            return all(c.get(f"/v1/jobs/{j}").json()["state"] == "queued" for j in ids)

        eventually_sync(released, 10, "the held jobs to be released")


def test_metrics_count_possible_duplicate_submissions(valkey: ValkeyServer) -> None:
    q = new_queue("dups")

    async def resend(store: QueueStore) -> None:
        [job] = await store.enqueue_many(q, [JobSpec(input=1)])
        (first,) = await store.claim(q, "lost-worker", 1, lease_ms=60_000)
        assert await store.begin_many(q, [(job, first.token, 0.0)], backend="gpu") == ["OK:1"]
        await store.release_leases(q, "lost-worker")  # (a drain hands back the open intent, as a crash would)
        (second,) = await store.claim(q, "next-worker", 1, lease_ms=60_000)
        assert await store.begin_many(q, [(job, second.token, 0.0)], backend="gpu") == ["OK:1:DUP"]

    run(_with_store(valkey.url, resend))
    settings = {
        "backends": {"gpu": {"kind": "http-job", "base_url": "http://127.0.0.1:9"}},
        "queues": {q: {"backend": "gpu"}},
    }
    with server(valkey.url, settings=settings) as (url, boot):
        got = scrape(url, boot)
    assert got[("offload_possible_duplicate_submissions_total", (("backend", "gpu"), ("queue", q)))] == 1


def test_a_gpu_workers_leases_are_judged_by_token_and_unknown_ones_handed_back(valkey: ValkeyServer) -> None:
    """A claim whose reply never reached the worker leaves a lease it does not know of: the server hands it
    back (uncounted) once it is a lease old. A token the worker sends for a job now leased under another
    token is reported lost."""
    q = new_queue("gpu")
    with server(valkey.url, worker_lease_ms=1000) as (url, boot):
        token = make_key(url, boot, "worker", [q])
        with client(url, boot) as admin, client(url, token) as c:
            ids = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": 1}, {"input": 2}]}).json()["ids"]
            wid = c.post("/v1/workers/register", json={"queues": [q]}).json()["worker_id"]
            jobs = c.post(f"/v1/workers/{wid}/claim", json={"queue": q, "max": 2, "wait": 0}).json()["jobs"]
            assert {j["id"] for j in jobs} == set(ids)
            kept, lost = jobs  # the reply with `lost` never arrived, as far as the worker knows
            beat = {"jobs": [kept["id"], lost["id"]], "tokens": [kept["token"], "wrong/1"]}
            assert c.post(f"/v1/workers/{wid}/heartbeat", json=beat).json()["lost"] == [lost["id"]]

            def handed_back() -> Any:
                reply = c.post(
                    f"/v1/workers/{wid}/heartbeat", json={"jobs": [kept["id"]], "tokens": [kept["token"]]}
                ).json()
                assert reply["lost"] == []
                doc = admin.get(f"/v1/jobs/{lost['id']}").json()
                return doc["state"] == "queued" and doc

            doc = eventually_sync(handed_back, 10, "the unknown lease to be handed back", every=0.2)
            assert doc["lease_expiries"] == 0 and doc["attempts"] == 0
            assert admin.get(f"/v1/jobs/{kept['id']}").json()["state"] == "active"


def test_a_heartbeat_handled_across_a_deregister_does_not_list_the_worker_again(
    valkey: ValkeyServer, monkeypatch: Any
) -> None:
    """A GPU worker's last heartbeat can still be in the server when its deregister completes (the worker
    cancels the beat, but the request was sent). That heartbeat re-stamped the registry record and the queue's
    liveness set, so the stopped worker was listed as alive for a TTL. Here the deregister's steps run inside the
    heartbeat, right after its registration check: the heartbeat answers 404 and the worker is not listed."""
    from offload.queue.keyspace import GPU_WORKERS, gpu_worker

    q = new_queue("gone")
    original = QueueStore.heartbeat
    raced: list[str] = []

    async def deregister_first(self: QueueStore, queue: str, worker_id: str, *args: Any, **kwargs: Any) -> Any:
        if not raced:
            raced.append(worker_id)
            await self.redis.delete(gpu_worker(worker_id))
            await self.redis.zrem(GPU_WORKERS, worker_id)
            await self.release_leases(queue, worker_id)
        return await original(self, queue, worker_id, *args, **kwargs)

    with server(valkey.url) as (url, boot):
        token = make_key(url, boot, "worker", [q])
        with client(url, boot) as admin, client(url, token) as c:
            admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": 1}]})
            wid = c.post("/v1/workers/register", json={"queues": [q]}).json()["worker_id"]
            (job,) = c.post(f"/v1/workers/{wid}/claim", json={"queue": q, "max": 1, "wait": 0}).json()["jobs"]

            def listed() -> list[str]:
                return [w["id"] for w in admin.get("/v1/workers").json() if q in w["queues"]]

            assert listed() == [wid]
            monkeypatch.setattr(QueueStore, "heartbeat", deregister_first)
            beat = c.post(f"/v1/workers/{wid}/heartbeat", json={"jobs": [job["id"]], "tokens": [job["token"]]})
            assert raced == [wid]
            assert beat.status_code == 404 and "register again" in beat.json()["detail"], beat.text
            assert listed() == []
            assert admin.get(f"/v1/jobs/{job['id']}").json()["state"] == "queued"
