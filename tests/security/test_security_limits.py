"""Bounded resources per key (and the self-report, key-length and failed-auth limits): bodies are refused before they
are read or parsed, event streams share one multiplexed reader and end when their key is revoked, half-open connections
are closed, a server at its connection limit says 503, failed authentication is rate limited per address across servers,
and workers' self-reports are bounded. Real servers over TCP, real Valkey."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from support.eventually import eventually_sync
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer

from bench import web

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with server(
        valkey.url, max_batch=100, max_wait_s=1, key_recheck_s=0.5, header_timeout_s=1.0, sse_keepalive_s=1.0
    ) as srv:
        yield srv


def test_an_8_mib_batch_from_any_wrong_key_is_cheap() -> None:
    """bench/hostile_bodies.py against a real `offload server` process: answered in under a second, with a 4xx,
    and the server's peak RSS stays far below 300 MB (it was 5.6 GB for 8 MiB from a key of another queue)."""
    proc = subprocess.run(
        [sys.executable, "bench/hostile_bodies.py", "--mib", "8"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(400 <= s < 500 for s in doc["statuses"].values()), doc
    assert all(t < 1.0 for t in doc["seconds"].values()), doc
    assert doc["peak_rss_mb"] < 300 and doc["healthz_max_ms"] < 1000, doc


def test_routes_that_need_no_big_body_refuse_one_before_reading_it(api: tuple[str, str]) -> None:
    url, boot = api
    padded = b'{"scope": "viewer"' + b" " * (100 << 10) + b"}"  # valid JSON, 100 KiB
    with client(url, boot) as admin:
        r = admin.post("/v1/keys", content=padded, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"] == "too_large", r.text
        q = new_queue("big")  # enqueue routes keep the server's --max-body
        r = admin.post(
            f"/v1/queues/{q}/jobs",
            content=b'{"input": "' + b"x" * (200 << 10) + b'"}',
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 201, r.text


def test_batch_size_is_in_the_schema_and_errors_are_capped(api: tuple[str, str]) -> None:
    url, boot = api
    q = new_queue("batch")
    spec = web.get(f"{url}/openapi.json").json()
    assert spec["components"]["schemas"]["BatchEnqueueRequest"]["properties"]["jobs"]["maxItems"] == 100
    with client(url, boot) as admin:
        r = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{}] * 101})
        assert r.status_code == 413 and "limit of 100" in r.json()["detail"], r.text
        r = admin.post(f"/v1/queues/{q}/jobs/batch", json={"jobs": [{"priority": "x"}] * 100})  # 200 problems
        problems = r.json()["detail"]
        assert r.status_code == 422 and len(problems) == 51 and "150 more" in problems[-1]["msg"], problems[-1]


def _blocked_clients(url: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        return int(r.info("clients")["blocked_clients"])
    finally:
        r.close()


def test_event_streams_share_one_reader_and_follow_only_known_queues(
    api: tuple[str, str], valkey: ValkeyServer
) -> None:
    url, boot = api
    queues = [new_queue("ev") for _ in range(150)]
    r = redis.Redis.from_url(valkey.url)
    r.sadd("offload:queues", *queues)
    r.close()
    with client(url, boot) as admin:
        assert admin.get("/v1/events", params={"queue": [new_queue("nope")]}).status_code == 404
        too_many = [f"q{i}" for i in range(1001)]
        r2 = admin.get("/v1/events", params={"queue": too_many[:1001]})
        assert r2.status_code in (414, 422, 431), r2.status_code  # over max_stream_queues (or the URL limit)
    streams: list[Any] = []
    stop = threading.Event()

    def follow() -> None:
        with (
            web.client(base_url=url, headers={"Authorization": f"Bearer {boot}"}, timeout=30) as c,
            c.stream("GET", "/v1/events", params={"queue": queues}) as s,
        ):
            streams.append(s.status_code)
            for _ in s.iter_raw():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=follow, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        eventually_sync(lambda: len(streams) == 3, 10, "three streams")
        assert streams == [200, 200, 200]
        time.sleep(0.5)  # let every reader block
        assert _blocked_clients(valkey.url) <= 1  # one XREAD for 450 followed queues, not a pooled connection each
        with client(url, boot) as admin:
            t0 = time.monotonic()
            for q in queues[:20]:
                assert admin.get(f"/v1/queues/{q}").status_code in (200, 404)
            assert time.monotonic() - t0 < 5.0  # not waiting on the pool the readers hold
            admin.post(f"/v1/queues/{queues[7]}/jobs", json={"input": 1})
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_an_event_stream_ends_when_its_key_is_revoked(api: tuple[str, str]) -> None:
    url, boot = api
    q = new_queue("revoke")
    with client(url, boot) as admin:
        admin.post(f"/v1/queues/{q}/jobs", json={"input": 1})
        created = admin.post("/v1/keys", json={"scope": "producer", "queues": [q]}).json()
    got: list[str] = []
    ended = threading.Event()

    def follow() -> None:
        with client(url, created["token"]) as c, c.stream("GET", f"/v1/queues/{q}/events") as s:
            for line in s.iter_lines():
                got.append(line)
        ended.set()

    threading.Thread(target=follow, daemon=True).start()
    eventually_sync(lambda: any("connected" in g for g in got), 10, "the stream to open")
    with client(url, boot) as admin:
        assert admin.delete(f"/v1/keys/{created['id']}").status_code == 204
        assert ended.wait(10), "the stream kept going after its key was revoked"
        assert "event: revoked" in got


def test_half_open_connections_are_closed(api: tuple[str, str]) -> None:
    """A client that never finishes its headers (slowloris) loses the connection after header_timeout_s."""
    host, port = api[0].removeprefix("http://").split(":")
    socks = []
    for _ in range(30):
        s = socket.create_connection((host, int(port)), timeout=15)
        s.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
    try:
        deadline = time.monotonic() + 15
        for s in socks:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1024) == b"", "the server kept a connection that never sent its headers"
    finally:
        for s in socks:
            s.close()
    assert web.get(f"{api[0]}/healthz").status_code == 200


def test_a_server_at_its_connection_limit_answers_503(valkey: ValkeyServer) -> None:
    with server(valkey.url, max_connections=8, sse_keepalive_s=0.5) as (url, boot):
        q = new_queue("full")
        with client(url, boot) as admin:
            admin.post(f"/v1/queues/{q}/jobs", json={"input": 1})
        clients: list[httpx.Client] = []
        streams: list[Any] = []
        statuses: list[int] = []
        try:
            while len(clients) < 12 and 503 not in statuses:  # each holds a connection and a request
                c = web.client(base_url=url, headers={"Authorization": f"Bearer {boot}"}, timeout=30)
                clients.append(c)
                streams.append(c.stream("GET", f"/v1/queues/{q}/events"))
                statuses.append(streams[-1].__enter__().status_code)
            assert statuses[-1] == 503 and 5 <= len(statuses) <= 8, statuses
            assert web.get(f"{url}/healthz", timeout=10).status_code == 503
        finally:
            for s in streams:
                s.__exit__(None, None, None)
            for c in clients:
                c.close()
        eventually_sync(
            lambda: web.get(f"{url}/healthz", timeout=10).status_code == 200, 15, "the server to accept again"
        )


def test_failed_authentication_is_limited_per_address_across_servers(valkey: ValkeyServer) -> None:
    """Bad keys from one address are refused on every server once past the limit; its good keys never are."""
    r = redis.Redis.from_url(valkey.url)
    r.delete("offload:authfail:ip:127.0.0.1")
    try:
        with (
            server(valkey.url, auth_fail_limit=5) as (url_a, boot),
            server(valkey.url, auth_fail_limit=5) as (url_b, boot_b),
        ):
            with client(url_a, "ofk_000000000000_guess") as guess:
                assert [guess.get("/v1/queues").status_code for _ in range(5)] == [401] * 5
                blocked = guess.get("/v1/queues")
                assert blocked.status_code == 429 and int(blocked.headers["Retry-After"]) >= 1, blocked.text
            with client(url_a, boot) as good:  # a valid key is served whatever its address did
                assert good.get("/v1/queues").status_code == 200
            with client(url_b, "ofk_000000000000_other-guess") as guess_b:  # the count lives in Redis
                assert guess_b.get("/v1/queues").status_code == 429
            with client(url_b, boot_b) as good_b:
                assert good_b.get("/v1/queues").status_code == 200
    finally:
        r.delete("offload:authfail:ip:127.0.0.1")
        r.close()


def test_worker_self_reports_are_bounded(api: tuple[str, str]) -> None:
    url, boot = api
    q = new_queue("report")
    with client(url, make_key(url, boot, "worker", [q])) as w:
        for bad in (
            {"gpus": [{"name": "x" * 1000}]},
            {"gpus": [{"name": "a"}] * 17},
            {"instance_id": "as 1; rm"},
            {"gpus": [{"name": "a", "firmware": "x"}]},
            {"concurrency": 1_000_000},
        ):
            r = w.post("/v1/workers/register", json={"queues": [q], **bad})
            assert r.status_code == 422, (bad, r.text)
        wid = w.post("/v1/workers/register", json={"queues": [q], "gpus": [{"name": "A100"}]}).json()["worker_id"]
        fake = [f"{q}:{i:028x}" for i in range(5000)]  # jobs it does not hold
        assert w.post(f"/v1/workers/{wid}/heartbeat", json={"jobs": fake}).status_code == 200
    with client(url, boot) as admin:
        me = next(x for x in admin.get("/v1/workers").json() if x["id"] == wid)
        assert me["in_flight"] == 0 and me["gpus"] == [{"name": "A100"}]


def test_a_short_admin_key_is_refused_at_start() -> None:
    env = {**os.environ, "OFFLOAD_ADMIN_KEY": "x" * 31, "OFFLOAD_REDIS_URL": "redis://127.0.0.1:1/0"}
    proc = subprocess.run(
        [sys.executable, "-m", "offload", "server", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert proc.returncode != 0 and "OFFLOAD_ADMIN_KEY must be at least 32 characters" in proc.stderr, proc.stderr
