"""The attacker's walk: every operation of the server's own OpenAPI description (generated, never hand-listed)
called with no key, a revoked key, a wrong secret for a real key's id, and a producer key and a worker key of
another queue, all through a trusted reverse proxy from one client address, against a server
holding every kind of secret (admin key, vault master key, provider and backend credentials, storage keys,
alert webhook token and SMTP password, a queue's instance.env). Every call is refused (401/403, or 429 once the
bad keys pass the failed-auth limit, which never refuses the valid keys from the same address; a listing that
takes no parameters may answer, with nothing of the victim queue in it), and none of the secrets appears
in any response, log line or stored record (every key of the Redis database is read). The server's autoscaler
runs meanwhile against a provider that echoes the request, credentials and worker key included, into its
errors, so redaction is walked too.

The operator's own configuration is there too (a provider made with the CLI, a vault credential for github.com,
an offload.yaml block with a deployment and an `instance.env`), and the admin key plays the attacker:
it makes a provider of its own at a path of the echoing listener and points blocks at it. Nothing of the
operator's (worker key, git token, offload.yaml's env) reaches that path, while the operator's provider gets what
the operator sent it, and a machine's instance token is redacted like any secret."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from support.eventually import eventually_sync
from support.s3server import RcloneS3
from support.security_helpers import echo_server, leaks, redis_dump
from support.server_helpers import BUCKET, client, new_queue, server
from support.servers import ValkeyServer, free_port

from bench import web
from offload.access.api_keys import KeyStore
from offload.autoscale.credentials import Credentials
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.vault import ENV as VAULT_ENV
from offload.autoscale.vault import Vault
from offload.connection import connect
from offload.queue.keyspace import hook_digest
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

IDENTITIES = ("anonymous", "revoked", "forged", "producer of another queue", "worker of another queue")
# Every identity comes through the trusted reverse proxy (127.0.0.1) from one client address, with a spoofed hop
# of its own in front: the bad keys' failures block that address and the forged key's id, never a valid key.
FORWARDED = {"X-Forwarded-For": "10.9.9.9, 198.51.100.7"}


def secret(tag: str) -> str:
    return f"{tag}-{secrets.token_hex(16)}"


@pytest.fixture(scope="module")
def world(valkey: ValkeyServer, s3: RcloneS3) -> Iterator[dict[str, Any]]:
    victim, mine, deployed = new_queue("victim"), new_queue("mine"), new_queue("deployed")
    given = {
        "admin key": secret("admin"),
        "vault master key": secret("vault"),
        "provider api key": secret("rpa"),
        "backend api key": secret("gpukey"),
        "webhook token": secret("hook"),
        "smtp password": secret("smtp"),
        "instance.env HF_TOKEN": secret("hf"),
        "offload.yaml instance.env": secret("yamlenv"),
        "vault git token": secret("ghp"),
        "storage secret": s3.secret_key,
        "replicate webhook secret": "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode(),
    }
    with valkey.client() as r:  # the session's store: an earlier test's failed-auth counters would count here
        r.flushdb()
    rented_key = operator_key(valkey.url, [victim, deployed])
    saved = os.environ.get(VAULT_ENV)
    os.environ[VAULT_ENV] = given["vault master key"]
    try:
        with echo_server() as echo:
            operator_setup(valkey.url, given, echo.url)
            settings = {
                "server": {"trusted_proxies": ["127.0.0.1/32"], "public_url": "https://cp.example.com"},
                "backends": {
                    "gpu": {"kind": "http-job", "base_url": echo.url, "api_key": given["backend api key"]},
                    # webhooks on: a provider that signs (Replicate) and one that signs nothing (RunPod)
                    "rep": {
                        "kind": "replicate",
                        "version": "v1",
                        "base_url": echo.url,
                        "api_key": given["backend api key"],
                        "webhook_secret": given["replicate webhook secret"],
                    },
                    "rp": {"kind": "runpod", "endpoint_id": "ep1", "base_url": echo.url, "api_key": "rp-key-0123"},
                },
                "autoscaler": {"public_url": "https://cp.example.com", "worker_key": rented_key, "tick": 0.1},
                "queues": {
                    deployed: {
                        "autoscale": {
                            "enabled": True,
                            "provider": "rp",
                            "max_workers": 1,
                            "poll_interval": "0.2s",
                            "scale_up": [{"trigger": "queue_depth", "threshold": 0}],
                            "instance": {"image": "img", "env": {"MODEL_TOKEN": given["offload.yaml instance.env"]}},
                            "deployment": {
                                "git_url": "https://github.com/example/private.git",
                                "handler": "app:run",
                                "git_credential": "gh",
                            },
                        }
                    }
                },
                "alerts": {
                    "cooldown": 0,
                    "webhooks": [{"url": f"{echo.url}/hook", "headers": {"X-Token": given["webhook token"]}}],
                    "email": {
                        "host": "127.0.0.1",
                        "port": free_port(),
                        "from_addr": "o@example.com",
                        "to": ["ops@example.com"],
                        "username": "o",
                        "password": given["smtp password"],
                    },
                },
            }
            with server(
                valkey.url,
                s3.settings(BUCKET, max_files_per_job=2, max_upload_bytes_per_job=100),
                settings=settings,
                admin_key=given["admin key"],
                max_wait_s=1,
                key_recheck_s=0.5,
                auth_fail_limit=20,
            ) as (url, _):
                yield {
                    "url": url,
                    "victim": victim,
                    "mine": mine,
                    "given": given,
                    "echo": echo,
                    "rented key": rented_key,
                    "deployed": deployed,
                    "valkey": valkey.url,
                }
    finally:
        if saved is None:
            os.environ.pop(VAULT_ENV, None)
        else:
            os.environ[VAULT_ENV] = saved


def operator_key(redis_url: str, queues: list[str]) -> str:
    """The worker key the operator configures for rented machines (`offload keys create`, straight in Redis)."""

    async def go() -> str:
        redis = await connect(redis_url)
        try:
            return (await KeyStore(redis).create("worker", queues, "rented machines"))[1]
        finally:
            await redis.aclose()

    return asyncio.run(go())


def operator_setup(redis_url: str, given: dict[str, str], echo_url: str) -> None:
    """What the operator does on the server's host (direct Redis access): the provider `rp` (at the echoing
    listener) and the vault credential `gh` for github.com."""

    async def go() -> None:
        redis = await connect(redis_url)
        try:
            vault = Vault(given["vault master key"])
            config = {
                "api_key": given["provider api key"],
                "base_url": echo_url,
                "gpu_type_id": "NVIDIA X",
                "api": "rest",
            }
            await ProviderStore(redis, vault).create("rp", "runpod", config)
            await Credentials(redis, vault).set("gh", given["vault git token"], "github.com")
        finally:
            await redis.aclose()

    asyncio.run(go())


def _attack(w: dict[str, Any], admin: httpx.Client, out: dict[str, Any]) -> None:
    """The admin key as the attacker: a provider of its own at `/evil` of the listener, a block of `mine` on it
    naming the operator's vault credential (refused), then without it (accepted, and refused at rental: the
    provider has no worker key of its own), and the offload.yaml block sent back masked with that provider."""
    evil = {"api_key": "evil-0123456789abcdef", "base_url": w["echo"].url + "/evil", "gpu_type_id": "X", "api": "rest"}
    r = admin.post("/v1/autoscale/providers", json={"name": "evil", "type": "runpod", "config": evil})
    assert r.status_code == 201, r.text
    block: dict[str, Any] = {
        "enabled": True,
        "provider": "evil",
        "max_workers": 1,
        "poll_interval": "0.2s",
        "scale_up": [{"trigger": "queue_depth", "threshold": 0}],
        "instance": {"image": "img"},
        "deployment": {"git_url": "https://github.com/example/private.git", "handler": "a:b", "git_credential": "gh"},
    }
    r = admin.put(f"/v1/autoscale/queues/{w['mine']}", json=block)
    assert r.status_code == 403 and "vault credential" in r.text, r.text
    del block["deployment"]["git_credential"]
    assert admin.put(f"/v1/autoscale/queues/{w['mine']}", json=block).status_code == 200
    shown = admin.get(f"/v1/autoscale/queues/{w['deployed']}").json()["autoscale"]
    r = admin.put(f"/v1/autoscale/queues/{w['deployed']}", json={**shown, "provider": "evil"})
    assert r.status_code in (403, 422), r.text  # the credential (403), or the masked env (422): never restored
    for q in (w["mine"], w["deployed"]):
        assert admin.post(f"/v1/queues/{q}/jobs", json={"input": 1}).status_code == 201
    for call in (admin.patch("/v1/autoscale/providers/rp", json={"base_url": w["echo"].url + "/evil"}),
                 admin.delete("/v1/autoscale/providers/rp")):  # fmt: skip
        assert call.status_code == 403, call.text
        out["responses"].append((f"{call.request.method} {call.request.url.path}", call.text))


def _setup(w: dict[str, Any]) -> dict[str, Any]:
    """As the admin: the victim queue with a job, a worker and an autoscale block on an echoing provider; keys."""
    g, victim = w["given"], w["victim"]
    out: dict[str, Any] = {"responses": []}
    with client(w["url"], g["admin key"]) as admin:

        def key(scope: str, queue: str) -> tuple[str, str]:
            r = admin.post("/v1/keys", json={"scope": scope, "queues": [queue]})
            assert r.status_code == 201, r.text
            return r.json()["id"], r.json()["token"]

        out["producer"], out["worker"] = key("producer", w["mine"])[1], key("worker", w["mine"])[1]
        out["victim worker"] = key("worker", victim)[1]
        revoked_id, out["revoked"] = key("producer", victim)
        assert admin.delete(f"/v1/keys/{revoked_id}").status_code == 204
        out["key id"] = revoked_id
        r = admin.post(f"/v1/queues/{victim}/jobs", json={"input": {"prompt": "victim's data"}})
        assert r.status_code == 201, r.text
        out["job"] = r.json()["id"]
        calls: tuple[Callable[[], httpx.Response], ...] = (
            lambda: admin.put(
                f"/v1/autoscale/queues/{victim}",
                json={
                    "enabled": True,
                    "provider": "rp",
                    "max_workers": 1,
                    "poll_interval": "0.2s",
                    "scale_up": [{"trigger": "queue_depth", "threshold": 0}],
                    "instance": {"image": "ghcr.io/example/worker:1", "env": {"HF_TOKEN": g["instance.env HF_TOKEN"]}},
                },
            ),
        )
        for call in calls:
            r = call()
            assert r.status_code in (200, 201), r.text
            out["responses"].append((f"{r.request.method} {r.request.url.path}", r.text))
        _attack(w, admin, out)
    with client(w["url"], out["victim worker"]) as vw:
        r = vw.post("/v1/workers/register", json={"queues": [victim], "host": "victim-gpu"})
        assert r.status_code == 201, r.text
        out["worker id"] = r.json()["worker_id"]
    return out


def _example(schema: dict[str, Any], components: dict[str, Any], name: str, w: dict[str, Any]) -> Any:
    """A small value valid for `schema`, aimed at the victim (queues, tokens) where a field names one."""
    if "$ref" in schema:
        return _example(components[schema["$ref"].rsplit("/", 1)[1]], components, name, w)
    for combo in ("anyOf", "oneOf", "allOf"):
        if combo in schema:
            options = [s for s in schema[combo] if s.get("type") != "null"] or schema[combo]
            return _example(options[0], components, name, w)
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {p: _example(props[p], components, p, w) for p in schema.get("required", [])}
    if kind == "array":
        item = _example(schema.get("items", {}), components, name, w)
        return [w["victim"] if name == "queues" else item] * max(1, schema.get("minItems", 0))
    if kind == "integer":
        return max(1, schema.get("minimum", 1))
    if kind == "number":
        return 0
    if kind == "boolean":
        return False
    return {
        "queue": w["victim"],
        "token": f"{w['worker id']}/1",
        "scope": "viewer",
        "state": "succeeded",
        "type": "mock",
        "name": "p",
        "error": "x",
    }.get(name, "x")


def operations(spec: dict[str, Any], w: dict[str, Any]) -> list[tuple[str, str, Any, bool, bool]]:
    """(method, path, json body or None, needs a key, is a parameterless GET) for every operation."""
    params = {
        "queue": w["victim"],
        "job_id": w["job"],
        "worker_id": w["worker id"],
        "key_id": w["key id"],
        "name": "rp",
        "instance_id": "as-none",
        "action": "protect",
        "backend": "rp",  # the webhook route: no key, proven by its URL secret (tests/webhooks/test_webhooks.py)
        "submission": "1",
        "secret": "not-the-secret",
    }
    components = spec.get("components", {}).get("schemas", {})
    out = []
    for template, methods in spec["paths"].items():
        path = re.sub(r"\{(\w+)\}", lambda m: params[m[1]], template)
        for method, op in methods.items():
            body = None
            if "requestBody" in op:
                schema = op["requestBody"]["content"]["application/json"]["schema"]
                body = _example(schema, components, "", w)
            out.append((method.upper(), path, body, bool(op.get("security")), method == "get" and path == template))
    return out


def _hooked_job(redis_url: str) -> tuple[str, str]:
    """(job id, its webhook URL's secret): a job of its own queue whose first submission went to backend `rep`
    (Replicate, which signs its webhooks), as a dispatch worker leaves it inside the submit call."""
    queue, hook_secret = new_queue("hooked"), secrets.token_urlsafe(24)

    async def go() -> str:
        redis = await connect(redis_url)
        try:
            store = QueueStore(redis)
            job_id = await store.enqueue(queue, JobSpec(input={"prompt": "hooked"}))
            (claimed,) = await store.claim(queue, "dispatch-1", 1, lease_ms=600_000)
            begun = await store.begin_many(queue, [(job_id, claimed.token, 0.0, hook_digest("rep", hook_secret))])
            assert begun == ["OK:1"], begun
            return job_id
        finally:
            await redis.aclose()

    return asyncio.run(go()), hook_secret


def _walk_hooks(w: dict[str, Any], ops: list[tuple[str, str, Any, bool, bool]], out: list[tuple[str, str]]) -> None:
    """The keyless operations (health, webhooks proven by their URL secret): a guessed secret is a 404; the
    real secret of a Replicate submission under the RunPod path is a 403, and under its
    own path without Replicate's signature a 401; the job records nothing."""
    keyless = [o for o in ops if not o[3]]
    assert any("/v1/hooks/" in o[1] for o in keyless), keyless
    job_id, hook_secret = _hooked_job(w["valkey"])
    body = {"id": "attacker-run", "status": "COMPLETED", "output": {"evil": True}}
    with web.client(base_url=w["url"], headers=FORWARDED, timeout=30) as c:
        for method, path, _, _, _ in keyless:
            status, text = _call(c, method, path, body)
            out.append((f"anyone: {method} {path}", text))
            assert status == 404 if "/v1/hooks/" in path else status < 500, (method, path, status, text)
        for backend, refused in (("rp", 403), ("rep", 401)):
            r = c.post(f"/v1/hooks/{backend}/{job_id}/1/{hook_secret}", json=body)
            out.append((f"anyone: POST /v1/hooks/{backend}/<job>/1/<real secret>", r.text))
            assert r.status_code == refused and r.json()["error"], (backend, r.text)

    async def recorded() -> tuple[str | None, int]:
        redis = await connect(w["valkey"])
        try:
            assert await QueueStore(redis).hook_body(job_id, 1) is None
            return await QueueStore(redis).current_remote(job_id)
        finally:
            await redis.aclose()

    assert asyncio.run(recorded()) == (None, 1)  # no remote id adopted, the submission still open
    w["hook secret"] = hook_secret


def _call(c: httpx.Client, method: str, path: str, body: Any) -> tuple[int, str]:
    """Status and body (for a stream that is let through: its first bytes)."""
    with c.stream(method, path, json=body, timeout=30) if body is not None else c.stream(method, path, timeout=30) as r:
        if r.headers.get("content-type", "").startswith("text/event-stream") and r.status_code == 200:
            return r.status_code, next(r.iter_text(), "")
        return r.status_code, r.read().decode(errors="replace")


def test_the_attackers_walk(world: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    w = {**world, **_setup(world)}
    g, url = w["given"], w["url"]
    admin = client(url, g["admin key"])
    # the autoscaler tried to rent for the victim queue, and the provider echoed credentials into its error
    eventually_sync(
        lambda: any("400" in e.get("message", "") for e in admin.get("/v1/autoscale/events").json()),
        30,
        "a refused rental in the autoscaler's journal",
    )
    echoed = [r for r in w["echo"].requests if r[0] == "POST" and r[1] == "/v2/pods"]
    assert echoed and g["provider api key"] in str(echoed[0][2]) and w["rented key"] in echoed[0][3]
    # a machine holding the rented worker key cannot pass itself off as an instance it was not rented as
    rented = [i["id"] for i in admin.get("/v1/autoscale/status").json()["instances"]]
    with client(url, w["rented key"]) as machine:
        for inst in [*rented[:3], "as-00000000000000ff"]:
            r = machine.post("/v1/workers/register", json={"queues": [w["victim"]], "instance_id": inst})
            assert r.status_code == 403, (inst, r.text)
    # the operator's offload.yaml block rented from the operator's provider: its git token and env went there...
    eventually_sync(
        lambda: any(g["vault git token"] in r[3] for r in w["echo"].requests if r[1] == "/v2/pods"),
        30,
        "the operator's deployment to reach the operator's provider",
    )
    # ...and the attacker's blocks were evaluated: the rental from its provider refused for want of a worker key
    eventually_sync(
        lambda: all(
            (admin.get("/v1/autoscale/status").json()["queues"].get(q) or {}).get("decision", {}).get("provider")
            for q in (w["mine"],)
        ),
        30,
        "the attacker's queue to be evaluated",
    )
    evil = [(f"{m} {p}", f"{h} {b}") for m, p, h, b in w["echo"].requests if p.startswith("/evil")]
    operators = {k: v for k, v in g.items() if k in ("offload.yaml instance.env", "vault git token", "admin key")}
    assert leaks({**operators, "rented worker key": w["rented key"]}, evil) == []
    instance_tokens = {
        f"instance token {i}": t
        for i, t in enumerate(re.findall(r'"OFFLOAD_INSTANCE_TOKEN":\s*"([^"]+)"', " ".join(r[3] for r in echoed)))
    }
    assert instance_tokens, "each rental carries its machine's instance token"

    spec = web.get(f"{url}/openapi.json").json()
    ops = operations(spec, w)
    assert len(ops) >= 40, len(ops)  # the whole API, from its own description
    victim_key_id = w["victim worker"].split("_")[1]
    tokens = {
        "anonymous": None,
        "revoked": w["revoked"],
        "forged": f"ofk_{victim_key_id}_not-its-secret",
        "producer of another queue": w["producer"],
        "worker of another queue": w["worker"],
    }
    responses: list[tuple[str, str]] = list(w["responses"])
    refused, limited = 0, 0
    for who in IDENTITIES:
        with client(url, tokens[who]) as c:
            c.headers.update(FORWARDED)
            for method, path, body, needs_key, listing in ops:
                if not needs_key:
                    continue
                status, text = _call(c, method, path, body)
                responses.append((f"{who}: {method} {path}", text))
                if who == "anonymous":
                    assert status == 401, (who, method, path, status, text)
                elif who in ("revoked", "forged"):  # past the failure limit: 429, for this address or key id
                    assert status in (401, 429), (who, method, path, status, text)
                    limited += status == 429
                elif listing and status < 300:  # e.g. GET /v1/queues: only the key's own queues
                    assert w["victim"] not in text, (who, method, path, text)
                else:  # valid keys from the blocked address: judged by their scope, never refused for it
                    assert status == 403, (who, method, path, status, text)
                refused += status in (401, 403, 429)
    keyed = len([o for o in ops if o[3]])
    assert refused >= 4 * keyed and limited >= keyed  # the forged key alone: refused for its id and address
    _walk_hooks(w, ops, responses)
    with client(url, w["victim worker"]) as vw:  # its id was attacked; the key itself still works
        vw.headers.update(FORWARDED)
        r = vw.post(f"/v1/workers/{w['worker id']}/heartbeat", json={"jobs": []})
        assert r.status_code == 200, r.text
    stored_counters = redis_dump(w["valkey"])
    assert "offload:authfail:ip:198.51.100.7" in stored_counters
    assert f"offload:authfail:key:{victim_key_id}" in stored_counters
    assert "authfail:ip:10.9.9.9" not in stored_counters and "authfail:ip:127.0.0.1" not in stored_counters
    with client(url, w["producer"]) as own:  # the per-job limits hold for a key on its own queue too
        first = own.post(f"/v1/queues/{w['mine']}/uploads", json={"name": "a", "size": 1})
        assert first.status_code == 201, first.text
        job_id = first.json()["job_id"]
        for size, setting in ((100, "max_upload_bytes_per_job"), (1, None), (1, "max_files_per_job")):
            r = own.post(f"/v1/queues/{w['mine']}/uploads", json={"name": "a", "size": size, "job_id": job_id})
            assert (r.status_code, setting is None or setting in r.text) == (413 if setting else 201, True), r.text
            responses.append((f"producer: upload of {size} bytes", r.text))

    for path in (
        "/v1/autoscale/providers",
        "/v1/autoscale/providers/rp",
        "/v1/autoscale/queues",
        f"/v1/autoscale/queues/{w['victim']}",
        "/v1/autoscale/status",
        "/v1/autoscale/events",
        "/v1/keys",
        "/v1/workers",
        f"/v1/jobs/{w['job']}",
        "/metrics",
        "/v1/queues",
    ):
        r = admin.get(path)
        assert r.status_code == 200, (path, r.text)
        responses.append((f"admin: GET {path}", r.text))
    admin.close()
    assert "****" in dict(responses)[f"admin: GET /v1/autoscale/queues/{w['victim']}"]  # HF_TOKEN, masked

    secrets_ = {
        **g,
        **instance_tokens,
        "rented worker key": w["rented key"],
        "revoked key": w["revoked"],
        "victim's worker key": w["victim worker"],
        "webhook URL secret": w["hook secret"],
    }
    logs = [
        (f"log {r.name}", r.getMessage() + (r.exc_text or ""))
        for r in caplog.records
        if not (r.name == "httpx" and "/v1/hooks/" in r.getMessage())  # the walk's own client, not the server
    ]
    alerts = [(f"alert to {p}", b) for m, p, _, b in w["echo"].requests if p == "/hook"]
    assert alerts, "the refused rental raised an alert"
    stored = [("redis", redis_dump(w["valkey"]))]
    assert leaks(secrets_, responses + logs + alerts + stored) == []
