"""/metrics: values read from Redis, so two server instances report the same counters after real job traffic."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from support.server_helpers import client, new_queue, server
from support.servers import ValkeyServer

from offload.connection import connect
from offload.queue import keyspace
from offload.queue.backend_limits import BackendLimits
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


def scrape(url: str, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with client(url, token) as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def traffic(redis_url: str, queue: str) -> None:
    """5 enqueued; 4 claimed: 3 succeed, 1 dies; 2 counted against today's cap; backend counters bumped."""

    async def go() -> None:
        redis = await connect(redis_url)
        store = QueueStore(redis)
        ids = await store.enqueue_many(queue, [JobSpec(input=i) for i in range(5)])
        assert len(ids) == 5
        jobs = await store.claim(queue, "metrics-worker", 4, lease_ms=60_000)
        for j in jobs[:2]:
            assert await store.reserve(j.id, job_cap=100, spend_cap=None) is None
        for j in jobs[:3]:
            await store.complete(j.id, j.token, f"s3://b/{j.output_key}")
        assert await store.fail(jobs[3].id, jobs[3].token, "bad", retryable=False) == "dead"
        limits = BackendLimits(redis, "gpu", None)
        for outcome in ("submitted", "submitted", "throttled", "errors"):
            await limits.count(outcome)
        await redis.aclose()

    asyncio.run(go())


def _shared(scraped: dict[Any, float], queue: str) -> dict[Any, float]:
    """The families every server reads from Redis, for this queue (and the backend's counters)."""
    families = ("offload_jobs", "offload_job_", "offload_queue_jobs", "offload_backend")
    return {k: v for k, v in scraped.items() if k[0].startswith(families) and dict(k[1]).get("queue", queue) == queue}


def test_metrics_counters_are_shared_and_correct(valkey: ValkeyServer) -> None:
    q = new_queue("metrics")
    settings: dict[str, Any] = {
        "backends": {"gpu": {"kind": "http-job", "base_url": "http://127.0.0.1:9"}},
        "queues": {q: {"backend": "gpu", "daily_job_cap": 100, "daily_spend_cap": 5.0}},
    }
    with server(valkey.url, settings=settings) as (url1, boot1), server(valkey.url, settings=settings) as (url2, boot2):
        with client(url1, boot1) as c:  # a remote worker counts as live
            worker = c.post("/v1/workers/register", json={"queues": [q], "instance_id": "i-1"})
            assert worker.status_code == 201
        traffic(valkey.url, q)
        one, two = scrape(url1, boot1), scrape(url2, boot2)
        deadline = time.monotonic() + 10
        while _shared(one, q) != _shared(two, q) and time.monotonic() < deadline:
            one, two = scrape(url1, boot1), scrape(url2, boot2)
    lq = (("queue", q),)

    def m(name: str, **labels: str) -> float:
        return one[(name, tuple(sorted({"queue": q, **labels}.items())))]

    assert m("offload_jobs_total", event="enqueued") == 5
    assert m("offload_jobs_total", event="succeeded") == 3
    assert m("offload_jobs_total", event="failed") == 1
    assert m("offload_jobs_total", event="dead") == 1
    assert m("offload_queue_jobs", state="queued") == 1
    assert m("offload_queue_jobs", state="succeeded") == 3
    assert m("offload_job_wait_seconds_count") == 4
    assert m("offload_job_run_seconds_count") == 3
    assert m("offload_job_run_seconds_bucket", le="+Inf") == 3
    assert m("offload_job_wait_seconds_bucket", le="60.0") == 4  # cumulative: all four waited under a minute
    assert m("offload_budget_used", kind="jobs") == 2 and m("offload_budget_cap", kind="jobs") == 100
    assert m("offload_budget_cap", kind="spend") == 5.0
    assert m("offload_workers") == 1  # the worker still holds a lease
    assert one[("offload_backend_requests_total", (("backend", "gpu"), ("outcome", "submitted")))] == 2
    assert one[("offload_backend_requests_total", (("backend", "gpu"), ("outcome", "throttled")))] == 1
    assert m("offload_remote_workers") == 1
    assert one[("offload_queue_paused", lq)] == 0
    # the second server instance reads the same numbers from Redis (scraped again while they differ, for a few
    # seconds: a state gauge may move between two scrapes when either server's maintenance runs in between)
    assert _shared(one, q) == _shared(two, q)


async def test_noted_outcomes_are_written_once_per_interval_and_none_is_lost(valkey: ValkeyServer) -> None:
    """A worker notes an outcome per job; under a steady stream of notes (some arriving during every write's
    round trip) the counters go out once per NOTE_EVERY_S, not back to back, and after `flush` Redis holds
    every one of them."""
    from offload.queue import backend_limits as limits_module
    from offload.queue.keyspace import backend_counts

    redis = await connect(valkey.url)
    backend = new_queue("notes")
    limits = BackendLimits(redis, backend, None)
    writes = 0
    send = limits._send

    async def counted(counts: Any) -> None:
        nonlocal writes
        writes += 1
        await send(counts)

    limits._send = counted  # type: ignore[method-assign]  # the real write, counted
    try:
        noted, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.5:
            limits.note("submitted")
            noted += 1
            await asyncio.sleep(0)
        elapsed = time.monotonic() - t0
        await limits.flush()
        assert noted > 1000  # many notes per write's round trip: the case that wrote back to back
        assert 1 <= writes <= elapsed / limits_module.NOTE_EVERY_S + 2, (writes, noted)
        assert int(await redis.hget(backend_counts(backend), "submitted") or 0) == noted
    finally:
        await redis.delete(backend_counts(backend))
        await redis.aclose()


def test_a_routed_queues_backends_report_where_jobs_went_and_their_cool_downs(valkey: ValkeyServer) -> None:
    """Issue 39: what the dispatch workers note for a routed queue's backends (worker/routing.py) reaches /metrics:
    submissions per backend by reason, and cool-downs begun. (Before: no such families.)"""
    q = new_queue("routed")
    settings: dict[str, Any] = {
        "backends": {
            "ra": {"kind": "http-job", "base_url": "http://127.0.0.1:9"},
            "rb": {"kind": "http-job", "base_url": "http://127.0.0.1:9"},
        },
        "queues": {q: {"backends": ["ra", "rb"]}},
    }

    async def note() -> None:
        redis = await connect(valkey.url)
        await redis.delete(keyspace.backend_counts("ra"), keyspace.backend_counts("rb"))
        for name, what in (("ra", "first"), ("ra", "opened"), ("rb", "fallback"), ("rb", "fallback")):
            await BackendLimits(redis, name, None).count(f"route:{what}")
        await redis.aclose()

    asyncio.run(note())
    with server(valkey.url, settings=settings) as (url, boot):
        seen = scrape(url, boot)
    assert seen[("offload_routed_submissions_total", (("backend", "ra"), ("reason", "first")))] == 1
    assert seen[("offload_routed_submissions_total", (("backend", "rb"), ("reason", "fallback")))] == 2
    assert seen[("offload_backend_cool_downs_total", (("backend", "ra"),))] == 1
    assert seen[("offload_backend_cool_downs_total", (("backend", "rb"),))] == 0
