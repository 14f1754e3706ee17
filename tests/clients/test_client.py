"""The producer faces: sync Client and AsyncClient over one core, the embedded default, a Redis that is down."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.admin_redis import redis_admin
from support.servers import closed_port, free_port

from offload import AsyncClient, Client, ConnectionFailed, JobNotFound, JobState
from offload.connection import connect, mask_url
from offload.eventloop import within
from offload.local.embedded import ensure_embedded, stop_embedded
from offload.queue.store import QueueStore


def test_sync_client_round_trip(valkey_url: str) -> None:
    with Client(valkey_url) as client:
        job_id = client.enqueue("gpu", {"prompt": "a haiku"}, priority=3, idempotency_key="k")
        assert client.enqueue("gpu", {"prompt": "other"}, idempotency_key="k") == job_id
        ids = client.enqueue_many("gpu", [{"input": {"n": 1}, "priority": 1}, {"n": 2}])
        assert len(ids) == 2
        job = client.get(job_id)
        assert job.state is JobState.QUEUED and job.priority == 3
        assert client.stats("gpu").counts["queued"] == 3
        assert client.cancel(ids[1]) == "cancelled"
        assert client.wait(ids[1], timeout=1).state is JobState.CANCELLED
        with pytest.raises(TimeoutError, match="still queued"):
            client.wait(job_id, timeout=0.2)
        with pytest.raises(JobNotFound):
            client.get("gpu:nope")


async def test_async_client_wait_sees_completion(valkey_url: str) -> None:
    async with AsyncClient(valkey_url) as client:
        job_id = await client.enqueue("gpu", {"prompt": "x"})
        waiter = asyncio.create_task(client.wait(job_id, timeout=10))
        worker = QueueStore(await connect(valkey_url))
        (claimed,) = await worker.claim("gpu", "w", 1)
        await worker.complete(job_id, claimed.token, f"results/{job_id}.json")
        job = await waiter
        assert job.state is JobState.SUCCEEDED and job.result == f"results/{job_id}.json"
        await worker.redis.aclose()


def test_embedded_default_starts_once_and_is_reused(tmp_home: Path) -> None:
    try:
        url = ensure_embedded()
        assert ensure_embedded() == url  # a second call reuses the running server
        assert (tmp_home / "valkey" / "server.json").exists()
        with Client() as client:  # no URL configured: the embedded default
            job_id = client.enqueue("demo", {"n": 1})
        # a separate process sees the same durable queue
        out = subprocess.run(
            [sys.executable, "-c", f"from offload import Client; print(Client().get({job_id!r}).state.value)"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert out.stdout.strip() == "queued"
        assert list((tmp_home / "valkey").glob("appendonly*")), "AOF must be on"
    finally:
        assert stop_embedded()


async def test_redis_down_at_start_retries_then_names_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"redis://:s3cret@127.0.0.1:{closed_port()}/0"
    started = time.monotonic()
    with pytest.raises(ConnectionFailed) as info:
        await connect(url, retry_for=1.0)
    assert time.monotonic() - started >= 0.9  # it retried instead of failing at once
    assert "127.0.0.1" in str(info.value) and "s3cret" not in str(info.value)


async def test_a_url_that_points_at_a_web_server_says_so_at_once() -> None:
    """A Redis URL with an HTTP server's port (a typo, a port taken by another service): one clear error naming
    the masked URL, without retrying for the connect timeout, and no protocol-parser traceback."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"redis://:s3cret@127.0.0.1:{server.server_address[1]}/0"
        started = time.monotonic()
        with pytest.raises(ConnectionFailed, match=r"answered, but not as Redis/Valkey") as info:
            await connect(url, retry_for=30)
        assert time.monotonic() - started < 10  # not the 30 s a server that is not up yet is waited for
        assert "s3cret" not in str(info.value) and "***" in str(info.value)
    finally:
        server.shutdown()
        server.server_close()


async def test_redis_that_comes_up_late_is_waited_for(tmp_path: Path) -> None:
    from support.servers import ValkeyServer

    server = ValkeyServer(tmp_path / "late")
    port = free_port()
    server._port = port  # start it on a port the client already targets
    task = asyncio.create_task(connect(f"redis://127.0.0.1:{port}/0", retry_for=20))
    await asyncio.sleep(0.5)  # the client is now retrying against a closed port
    assert not task.done()
    await asyncio.to_thread(server.start)
    try:
        client = await within(task, 20)
        assert await client.ping()
        await client.aclose()
    finally:
        server.stop()


def test_mask_url_hides_passwords() -> None:
    assert mask_url("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert mask_url("redis://:pw@host/0") == "redis://:***@host/0"
    assert mask_url("redis://host:6379") == "redis://host:6379"


async def test_thousands_of_callers_share_a_small_pool_without_starving(valkey_url: str) -> None:
    """5,000 concurrent commands through 4 connections all complete (a starving pool fails its waiters with "No
    connection available" once the pool timeout passes), and a caller that cannot get a connection within the pool
    timeout gets redis-py's clear error."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from offload.connection import GatedPool

    redis = await connect(valkey_url, max_connections=4)
    try:
        pool = redis_admin(redis).connection_pool
        assert isinstance(pool, GatedPool)
        replies = await asyncio.gather(*(redis_admin(redis).incr("gated-pool-test") for _ in range(5000)))
        assert sorted(replies) == list(range(1, 5001))
        assert len(pool._in_use_connections) == 0 and len(pool._available_connections) <= 4
        assert pool._gate._value == 4  # every slot handed back
        pool._gate_timeout = 0.2
        held = [await pool.get_connection() for _ in range(4)]
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await pool.get_connection()
        for c in held:
            await pool.release(c)
        assert await redis.get("gated-pool-test") == "5000"
    finally:
        await redis.delete("gated-pool-test")
        await redis.aclose()


async def test_a_start_up_read_is_sent_again_through_a_store_restart(tmp_path: Path) -> None:
    """The reads a process makes right after `connect` (its eviction policy, its replicas) ride out a store that
    restarts or resets connections just then, as `connect` itself does: a worker started during a failover waits
    instead of exiting 1. Anything that is not an outage is raised at once."""
    from support.servers import ValkeyServer

    from offload.connection import at_start
    from offload.errors import UnsafeEvictionPolicy
    from offload.queue.memory import require_noeviction

    with ValkeyServer(tmp_path / "v") as server:
        client = await connect(server.url)
        try:
            server.kill()  # the connection the client holds is gone, and nothing listens until the restart
            restart = asyncio.create_task(asyncio.to_thread(server.restart))
            memory = await at_start(lambda: require_noeviction(client), retry_for=30)
            await restart
            assert restart.done() and memory.problem is None
            with server.client() as c:
                c.config_set("maxmemory-policy", "allkeys-lru")
            started = time.monotonic()
            with pytest.raises(UnsafeEvictionPolicy):
                await at_start(lambda: require_noeviction(client), retry_for=30)
            assert time.monotonic() - started < 5  # refused, not retried for 30 s
        finally:
            await client.aclose()
