"""Every route under every scope (allowed and denied), keys stored hashed, revocation, the `offload keys` CLI."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from support.admin_redis import redis_admin
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer
from typer.testing import CliRunner

from offload.cli.app import app
from offload.connection import connect

SCOPES = ("admin", "viewer", "producer", "worker")
READ = {"admin", "viewer", "producer"}
ADMIN = {"admin"}
PRODUCE = {"admin", "producer"}
WORK = {"admin", "worker"}
GLOBAL_READ = {"admin", "viewer"}


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with server(valkey.url, max_wait_s=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def world(api: tuple[str, str]) -> dict[str, Any]:
    """One queue with a job, a registered worker, and a key of each scope (producer and worker keys restricted to
    that queue; the viewer sees every queue, as a dashboard would)."""
    url, boot = api
    q, other = new_queue("auth"), new_queue("other")
    keys = {scope: make_key(url, boot, scope, [q] if scope in ("producer", "worker") else []) for scope in SCOPES}
    with client(url, boot) as c:
        job = c.post(f"/v1/queues/{q}/jobs", json={"input": 1}).json()["id"]
        c.post(f"/v1/queues/{other}/jobs", json={"input": 1})
        key_id = c.get("/v1/keys").json()[0]["id"]
    with client(url, keys["worker"]) as c:
        r = c.post("/v1/workers/register", json={"queues": [q], "host": "gpu-1"})
        assert r.status_code == 201, r.text
        worker = r.json()["worker_id"]
    return {"q": q, "other": other, "keys": keys, "job": job, "worker": worker, "key_id": key_id}


def routes(w: dict[str, Any]) -> list[tuple[str, str, Any, set[str]]]:
    q, job, wid = w["q"], w["job"], w["worker"]
    return [
        ("GET", "/v1/queues", None, READ),
        ("GET", f"/v1/queues/{q}", None, READ),
        ("POST", f"/v1/queues/{q}/jobs", {"input": 1}, PRODUCE),
        ("POST", f"/v1/queues/{q}/jobs/batch", {"jobs": [{"input": 1}]}, PRODUCE),
        ("GET", f"/v1/jobs/{job}", None, READ),
        ("GET", f"/v1/jobs/{job}/wait?timeout=0", None, READ),
        ("POST", f"/v1/jobs/{job}/cancel", None, PRODUCE),
        ("GET", f"/v1/queues/{q}/jobs?state=queued", None, READ),
        ("POST", f"/v1/queues/{q}/pause", None, ADMIN),
        ("POST", f"/v1/queues/{q}/resume", None, ADMIN),
        ("POST", f"/v1/queues/{q}/purge", {"state": "succeeded"}, ADMIN),
        ("GET", f"/v1/queues/{q}/dead", None, READ),
        ("POST", f"/v1/queues/{q}/dead/requeue", {"all": True}, ADMIN),
        ("POST", f"/v1/queues/{q}/dead/purge", None, ADMIN),
        ("GET", f"/v1/queues/{q}/held", None, READ),
        ("POST", f"/v1/queues/{q}/held/release", {"all": True}, ADMIN),
        ("SSE", "/v1/events", None, READ),
        ("SSE", f"/v1/queues/{q}/events", None, READ),
        ("GET", "/metrics", None, GLOBAL_READ),
        ("GET", "/v1/workers", None, GLOBAL_READ),
        ("POST", "/v1/workers/register", {"queues": [q]}, WORK),
        ("POST", f"/v1/workers/{wid}/claim", {"queue": q, "max": 1, "wait": 0}, WORK),
        ("POST", f"/v1/workers/{wid}/heartbeat", {"jobs": []}, WORK),
        ("POST", f"/v1/workers/{wid}/jobs/{job}/complete", {"token": f"{wid}/0", "output": 1}, WORK),
        ("POST", f"/v1/workers/{wid}/jobs/{job}/fail", {"token": f"{wid}/0", "error": "x"}, WORK),
        ("POST", f"/v1/workers/{wid}/jobs/{job}/cancelled", {"token": f"{wid}/0"}, WORK),
        ("GET", "/v1/keys", None, ADMIN),
        ("POST", "/v1/keys", {"scope": "viewer"}, ADMIN),
        ("DELETE", "/v1/keys/000000000000", None, ADMIN),
    ]


def call(c: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if method == "SSE":  # read the status, not the endless body
        with c.stream("GET", path) as r:
            r.read() if r.status_code >= 400 else None
            return r
    return c.request(method, path, json=body) if body is not None else c.request(method, path)


def test_every_route_needs_a_key(api: tuple[str, str], world: dict[str, Any]) -> None:
    with client(api[0]) as anon, client(api[0], "ofk_000000000000_not-a-real-key") as forged:
        for method, path, body, _ in routes(world):
            for c in (anon, forged):
                r = call(c, method, path, body)
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"] == "unauthorized"


@pytest.mark.parametrize("scope", SCOPES)
def test_scope_allows_and_denies(api: tuple[str, str], world: dict[str, Any], scope: str) -> None:
    header = "bearer" if scope in ("admin", "worker") else "x-api-key"  # both ways of sending a key
    with client(api[0], world["keys"][scope], header=header) as c:
        for method, path, body, allowed in routes(world):
            r = call(c, method, path, body)
            if scope in allowed:
                assert r.status_code not in (401, 403), (scope, method, path, r.status_code, r.text)
            else:
                assert r.status_code == 403, (scope, method, path, r.status_code)
                assert r.json()["error"] == "forbidden" and scope in r.json()["detail"]


def test_queue_restrictions(api: tuple[str, str], world: dict[str, Any]) -> None:
    q, other = world["q"], world["other"]
    with client(api[0], world["keys"]["producer"]) as producer:
        assert producer.post(f"/v1/queues/{other}/jobs", json={"input": 1}).status_code == 403
        assert producer.get(f"/v1/queues/{other}").status_code == 403
        assert [s["queue"] for s in producer.get("/v1/queues").json()] == [q]  # only its own queues
    with client(api[0], make_key(api[0], api[1], "viewer", [q])) as viewer:  # a viewer restricted to q
        assert viewer.get(f"/v1/queues/{other}/jobs").status_code == 403
        assert viewer.get(f"/v1/queues/{q}/jobs").status_code == 200
        assert viewer.get("/metrics").status_code == 403  # spans every queue
    with client(api[0], world["keys"]["worker"]) as worker:  # a worker key for queue A cannot claim from B
        r = worker.post(f"/v1/workers/{world['worker']}/claim", json={"queue": other, "max": 1})
        assert r.status_code == 403
        assert worker.post("/v1/workers/register", json={"queues": [other]}).status_code == 403
    other_worker = make_key(api[0], api[1], "worker", [q])  # another worker key cannot drive this worker
    with client(api[0], other_worker) as c:
        r = c.post(f"/v1/workers/{world['worker']}/heartbeat", json={"jobs": []})
        assert r.status_code == 403 and "another key" in r.json()["detail"]


def test_keys_are_stored_hashed_and_revocable(api: tuple[str, str], valkey: ValkeyServer) -> None:
    url, boot = api
    q = new_queue()
    with client(url, boot) as admin:
        created = admin.post("/v1/keys", json={"scope": "producer", "queues": [q], "name": "ci"}).json()
        token = created["token"]
        assert token.startswith("ofk_") and len(token) > 40
        listed = admin.get("/v1/keys").json()
        assert any(k["id"] == created["id"] for k in listed)
        assert token not in orjson.dumps(listed).decode() and "hash" not in listed[0]

    async def dump() -> str:
        redis = await connect(valkey.url)
        parts = []
        async for k in redis_admin(redis).scan_iter(count=1000):
            kind = await redis_admin(redis).type(k)
            v = await redis.hgetall(k) if kind == "hash" else await redis.get(k) if kind == "string" else ""
            parts.append(f"{k}={v}")
        await redis.aclose()
        return "\n".join(parts)

    everything = asyncio.run(dump())
    secret = token.removeprefix("ofk_").split("_", 1)[1]  # the secret itself may hold "_" (urlsafe base64)
    assert len(secret) == 43, secret
    leaked = [name for name, text in (("token", token), ("secret", secret), ("bootstrap", boot)) if text in everything]
    assert leaked == []  # only the hash is stored, and the bootstrap key is never written
    import hashlib

    hash_stored = hashlib.sha256(token.encode()).hexdigest() in everything
    assert hash_stored  # a bare flag: a failure must not print the whole store
    with client(url, token) as producer:
        assert producer.post(f"/v1/queues/{q}/jobs", json={"input": 1}).status_code == 201
        with client(url, boot) as admin:
            assert admin.delete(f"/v1/keys/{created['id']}").status_code == 204
            assert admin.delete(f"/v1/keys/{created['id']}").status_code == 404
        r = producer.post(f"/v1/queues/{q}/jobs", json={"input": 1})
        assert r.status_code == 401 and token not in r.text


def test_keys_cli(valkey: ValkeyServer, api: tuple[str, str]) -> None:
    runner = CliRunner()
    q = new_queue()
    r = runner.invoke(app, ["keys", "create", "--scope", "worker", "--queues", q, "--url", valkey.url, "--json"])
    assert r.exit_code == 0, r.output
    doc = orjson.loads(r.stdout)
    assert doc["scope"] == "worker" and doc["queues"] == [q]
    with client(api[0], doc["token"]) as c:
        assert c.post("/v1/workers/register", json={"queues": [q]}).status_code == 201
    r = runner.invoke(app, ["keys", "list", "--url", valkey.url])
    assert r.exit_code == 0 and doc["id"] in r.stdout and doc["token"] not in r.stdout
    r = runner.invoke(app, ["keys", "create", "--scope", "producer", "--url", valkey.url])
    assert r.exit_code == 1 and "needs --queues" in r.stderr
    r = runner.invoke(app, ["keys", "create", "--scope", "root", "--queues", q, "--url", valkey.url])
    assert r.exit_code == 1 and "unknown scope" in r.stderr
    assert runner.invoke(app, ["keys", "revoke", doc["id"], "--yes", "--url", valkey.url]).exit_code == 0
    with client(api[0], doc["token"]) as c:
        assert c.post("/v1/workers/register", json={"queues": [q]}).status_code == 401
    assert runner.invoke(app, ["keys", "revoke", doc["id"], "--yes", "--url", valkey.url]).exit_code == 1
