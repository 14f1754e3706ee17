"""The HTTP API against a real uvicorn server on a TCP port, a real Valkey and real S3 (rclone): jobs, queues,
dead-letter and held sets, errors as JSON, SSE."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import orjson
import pytest
from support.eventually import eventually_sync
from support.s3server import RcloneS3
from support.server_helpers import BUCKET, client, new_queue, server
from support.servers import ValkeyServer

from bench import web
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

T = TypeVar("T")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer, s3: RcloneS3) -> Iterator[tuple[str, str]]:
    with server(valkey.url, s3.settings(BUCKET), max_batch=50, max_body=64 * 1024, max_wait_s=5) as srv:
        yield srv


def store_call(url: str, fn: Callable[[QueueStore], Awaitable[T]]) -> T:
    async def go() -> T:
        redis = await connect(url)
        try:
            return await fn(QueueStore(redis))
        finally:
            await redis.aclose()

    return asyncio.run(go())


def finish(url: str, queue: str, n: int, *, fail: bool = False) -> list[str]:
    """Claim n jobs as a worker would and complete (or permanently fail) them."""

    async def go(store: QueueStore) -> list[str]:
        jobs = await store.claim(queue, "test-worker", n)
        for j in jobs:
            if fail:
                await store.fail(j.id, j.token, "bad input", retryable=False)
            else:
                await store.complete(j.id, j.token, f"s3://{BUCKET}/{j.output_key}")
        return [j.id for j in jobs]

    return list(store_call(url, go))


def test_health_is_public_and_ready(api: tuple[str, str]) -> None:
    with client(api[0]) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").json() == {"status": "ready"}
        spec = c.get("/openapi.json").json()
        assert "/v1/queues/{queue}/jobs" in spec["paths"] and c.get("/docs").status_code == 200


def test_enqueue_get_wait_cancel(api: tuple[str, str], admin: httpx.Client, valkey: ValkeyServer, s3: RcloneS3) -> None:
    q = new_queue()
    r = admin.post(f"/v1/queues/{q}/jobs", json={"input": {"prompt": "hi"}, "priority": 5, "max_attempts": 2})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert job_id.startswith(f"{q}:") and r.json()["duplicate"] is False
    job = admin.get(f"/v1/jobs/{job_id}").json()
    assert (job["state"], job["input"], job["priority"], job["max_attempts"]) == ("queued", {"prompt": "hi"}, 5, 2)
    assert "lease_token" not in job and "token" not in job

    # wait: times out while queued, then returns as soon as the job finishes
    r = admin.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 0.3})
    assert r.json()["timed_out"] is True and r.json()["state"] == "queued"
    s3.client().put_object(Bucket=BUCKET, Key=f"results/{job_id}.json", Body=b'{"ok": 1}')
    result: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: result.update(admin.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 20}).json())
    )
    waiter.start()
    finish(valkey.url, q, 1)
    waiter.join(20)
    assert result["state"] == "succeeded" and result["timed_out"] is False
    assert result["result"] == f"s3://{BUCKET}/results/{job_id}.json"
    assert web.get(result["result_url"]).json() == {"ok": 1}  # the presigned URL works without credentials

    # cancel: a waiting job at once; a finished one is a 409
    other = admin.post(f"/v1/queues/{q}/jobs", json={"input": 2}).json()["id"]
    assert admin.post(f"/v1/jobs/{other}/cancel").json() == {"id": other, "result": "cancelled"}
    r = admin.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 409 and r.json()["error"] == "conflict"


def test_list_with_cursor_pagination(admin: httpx.Client) -> None:
    q = new_queue()
    ids = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": i} for i in range(7)]}).json()["ids"]
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"state": "queued", "limit": 3}
        if cursor:
            params["cursor"] = cursor
        page = admin.get(f"/v1/queues/{q}/jobs", params=params).json()
        seen += [j["id"] for j in page["jobs"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids and pages == 3


def test_idempotency_key_single_and_batch(admin: httpx.Client) -> None:
    q = new_queue()
    first = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}, headers={"Idempotency-Key": "order-17"})
    again = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}, headers={"Idempotency-Key": "order-17"})
    assert first.status_code == 201 and again.status_code == 200
    assert again.json() == {"id": first.json()["id"], "duplicate": True, "record_gone": False}
    body = {"jobs": [{"input": i} for i in range(3)]}
    a = admin.post(f"/v1/queues/{q}/jobs/batch", json=body, headers={"Idempotency-Key": "batch-1"}).json()["ids"]
    b = admin.post(f"/v1/queues/{q}/jobs/batch", json=body, headers={"Idempotency-Key": "batch-1"}).json()["ids"]
    assert a == b and len(set(a)) == 3
    assert admin.get(f"/v1/queues/{q}").json()["counts"]["queued"] == 4


def test_errors_are_json_with_the_right_status(admin: httpx.Client) -> None:
    q = new_queue()
    assert admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}).status_code == 201
    # 422 with field paths
    r = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": 1}, {"input": 2, "priority": 5000}]})
    assert r.status_code == 422 and r.json()["error"] == "invalid"
    assert r.json()["detail"][0]["path"] == "body.jobs.1.priority"
    r = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1, "priorty": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["path"] == "body.priorty"
    r = admin.post(f"/v1/queues/{q}/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "invalid"
    r = admin.post("/v1/queues/bad name!/jobs", json={"input": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["path"] == "path.queue"
    r = admin.get(f"/v1/queues/{q}/jobs", params={"state": "nonsense"})
    assert r.status_code == 422 and r.json()["detail"][0]["path"] == "query.state"
    # values Redis cannot hold are input errors, not store failures (found by schemathesis)
    for field, value in (("retention", 10**17), ("delay", 1e308), ("run_at", 1e20)):
        r = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1, field: value})
        assert r.status_code == 422 and r.json()["detail"][0]["path"] == f"body.{field}", (field, r.text)
    r = admin.get(f"/v1/queues/{q}/jobs", params={"cursor": "7" * 20})
    assert r.status_code == 422 and r.json()["detail"][0]["path"] == "query.cursor"
    # 413: over the batch size, over the body limit (announced or chunked)
    r = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": i} for i in range(51)]})
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    r = admin.post(f"/v1/queues/{q}/jobs", json={"input": "x" * 70_000})
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    chunks = iter([b'{"input": "', b"y" * 70_000, b'"}'])
    r = admin.post(f"/v1/queues/{q}/jobs", content=chunks, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    # 404: unknown job, unknown queue, malformed id, unknown route
    for path in (f"/v1/jobs/{q}:0000deadbeef", "/v1/queues/never-seen-queue", "/v1/jobs/no-colon", "/v1/nothing"):
        r = admin.get(path)
        assert r.status_code == 404 and r.json()["error"] == "not_found", (path, r.text)
    assert admin.post("/v1/queues/never-seen-queue/dead/requeue", json={"all": True}).status_code == 404
    # 401 / 403 are JSON too
    with client(str(admin.base_url)) as anon:
        r = anon.get(f"/v1/queues/{q}")
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"


def test_queue_ops_dead_and_held(admin: httpx.Client, valkey: ValkeyServer) -> None:
    q = new_queue()
    ids = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": i} for i in range(4)]}).json()["ids"]
    dead = finish(valkey.url, q, 2, fail=True)
    page = admin.get(f"/v1/queues/{q}/dead").json()
    assert {j["id"] for j in page["jobs"]} == set(dead) and page["jobs"][0]["error"] == "bad input"
    assert admin.post(f"/v1/queues/{q}/dead/requeue", json={"ids": [dead[0]]}).json() == {"moved": [dead[0]]}
    assert admin.post(f"/v1/queues/{q}/dead/purge").json() == {"count": 1}

    # held: a worker holds one over a cap; release brings it back
    async def hold(store: QueueStore) -> str:
        (job,) = await store.claim(q, "w", 1)
        await store.hold(
            job.id,
            job.token,
            "daily jobs cap reached",  # today's window: not yet due
            time.strftime("%Y%m%d", time.gmtime()),
        )
        return job.id

    held = store_call(valkey.url, hold)
    assert [j["id"] for j in admin.get(f"/v1/queues/{q}/held").json()["jobs"]] == [held]
    assert admin.post(f"/v1/queues/{q}/held/release", json={"all": True}).json() == {"moved": [held]}
    # pause / resume / purge
    assert admin.post(f"/v1/queues/{q}/pause").json()["paused"] is True
    assert store_call(valkey.url, lambda s: s.claim(q, "w2", 10)) == []
    assert admin.post(f"/v1/queues/{q}/resume").json()["paused"] is False
    # 4 enqueued - 2 dead + 1 requeued; the held one was released
    assert admin.post(f"/v1/queues/{q}/purge", json={"state": "queued"}).json()["count"] == 3
    r = admin.post(f"/v1/queues/{q}/purge", json={"state": "active"})
    assert r.status_code == 422 and r.json()["detail"][0]["path"] == "body.state"
    stats = admin.get(f"/v1/queues/{q}").json()
    assert stats["counts"]["queued"] == 0 and stats["totals"]["enqueued"] == len(ids)
    assert stats["totals"]["dead"] == 2
    assert q in [s["queue"] for s in admin.get("/v1/queues").json()]


def test_sse_stream_delivers_events(api: tuple[str, str], admin: httpx.Client) -> None:
    q = new_queue()
    admin.post(f"/v1/queues/{q}/jobs", json={"input": 0})  # the queue exists
    events: list[dict[str, Any]] = []
    ready = threading.Event()

    def listen() -> None:
        with client(api[0], api[1]) as c, c.stream("GET", f"/v1/queues/{q}/events") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith(": connected"):
                    ready.set()
                if line.startswith("data: "):
                    events.append(orjson.loads(line[6:]))
                    return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert ready.wait(10)
    job_id = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}).json()["id"]
    t.join(10)
    assert events and events[0]["state"] == "queued" and events[0]["jobs"] == [job_id] and events[0]["queue"] == q

    # resumable: with Last-Event-ID the missed events are replayed first
    last = ""
    with client(api[0], api[1]) as c, c.stream("GET", f"/v1/queues/{q}/events", headers={"Last-Event-ID": "0-0"}) as r:
        for line in r.iter_lines():
            if line.startswith("id: "):
                last = line[4:]
            if line.startswith("data: ") and job_id in orjson.loads(line[6:])["jobs"]:
                break
    assert last


def test_all_queues_stream_follows_new_queues(api: tuple[str, str], admin: httpx.Client) -> None:
    q = new_queue("later")  # does not exist when the stream starts
    found: list[dict[str, Any]] = []
    ready = threading.Event()

    def listen() -> None:
        with client(api[0], api[1]) as c, c.stream("GET", "/v1/events") as r:
            for line in r.iter_lines():
                if line.startswith(": connected"):
                    ready.set()
                if line.startswith("data: ") and (doc := orjson.loads(line[6:]))["queue"] == q:
                    found.append(doc)
                    return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert ready.wait(10)

    def seen() -> bool:
        if not found:  # events from before the stream picked the queue up are not replayed: keep producing
            admin.post(f"/v1/queues/{q}/jobs", json={"input": 1})
        return bool(found)

    eventually_sync(seen, 15, "an event of the new queue", every=0.5)
    assert found[0]["state"] == "queued" and found[0]["jobs"][0].startswith(f"{q}:")


def test_rates_appear_after_samples(admin: httpx.Client) -> None:
    q = new_queue()
    admin.post(f"/v1/queues/{q}/jobs", json={"input": 0})

    def rated() -> Any:
        admin.post(f"/v1/queues/{q}/jobs", json={"input": 1})
        view = admin.get(f"/v1/queues/{q}").json()
        return view if view["rate_window_s"] else None

    view = eventually_sync(rated, 10, "a rate window")
    assert view["rates"]["enqueued"] > 0 and set(view["rates"]) >= {"enqueued", "succeeded", "dead"}


def test_enqueue_validation_uses_store_rules(admin: httpx.Client, valkey: ValkeyServer) -> None:
    q = new_queue()
    r = admin.post(f"/v1/queues/{q}/jobs", json={"input": 1, "output_key": "bad\tkey"})
    assert r.status_code == 422 and "output_key" in r.json()["detail"][0]["msg"]
    ok = admin.post(f"/v1/queues/{q}/jobs", json={"input": {"a": [1, 2]}, "delay": 60, "retention": 10})
    assert ok.status_code == 201
    job = store_call(valkey.url, lambda s: s.get(ok.json()["id"]))
    assert job.state.value == "delayed"


def test_workers_lists_dispatch_workers_from_the_store(admin: httpx.Client, valkey: ValkeyServer) -> None:
    q = new_queue()
    admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"input": i} for i in range(3)]})
    store_call(valkey.url, lambda s: s.claim(q, "cpu-box:4242:9f3a1c", 2, lease_ms=60_000))
    (w,) = [w for w in admin.get("/v1/workers").json() if w["id"] == "cpu-box:4242:9f3a1c"]
    assert (w["kind"], w["host"], w["queues"], w["in_flight"]) == ("dispatch", "cpu-box", [q], 2)
    assert w["lease_deadline"] > 0


async def test_a_new_stream_has_its_start_fixed_before_it_says_connected(valkey: ValkeyServer) -> None:
    """The hub's start-id lookup runs as a task; `started` waits for it, so an event written the moment after
    (a client enqueueing on `: connected`) reaches the stream. Without the wait the enqueue below, sent before the
    lookup's XREVRANGE, fixed the start past its own event, which was then never delivered."""
    from offload.server.events import EventHub

    redis = await connect(valkey.url)
    store = QueueStore(redis)
    hub = EventHub(store, block_ms=50)
    q = new_queue()
    try:
        # the stream exists, with history the new stream must not replay
        await store.enqueue(q, JobSpec(input={"n": 0}))
        with hub.subscribe([q]) as sub:
            await hub.started(sub)
            job_id = await store.enqueue(q, JobSpec(input={"n": 1}))
            event = await sub.next(5)
            assert event is not None and event[2]["state"] == "queued" and event[2]["jobs"] == job_id
            assert await sub.next(0.3) is None  # and the earlier enqueue was not replayed
    finally:
        await hub.aclose()
        await redis.aclose()
