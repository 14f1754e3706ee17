"""A real offload server (uvicorn on a free port, in a thread of the test process) and helpers to talk to it
over TCP with httpx. Each test uses fresh queue names, so one server serves a whole module."""

from __future__ import annotations

import asyncio
import secrets
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx

from bench import web
from offload.config import Settings
from offload.connection import connect
from offload.queue.store import QueueStore
from offload.server.runner import running_server
from offload.server.state import ServerOptions

BUCKET = "server-results"
T = TypeVar("T")


def new_queue(tag: str = "q") -> str:
    return f"{tag}-{secrets.token_hex(4)}"


@contextmanager
def server(
    redis_url: str,
    storage: dict[str, Any] | None = None,
    settings: dict[str, Any] | Settings | None = None,
    *,
    port: int = 0,
    **options: Any,
) -> Iterator[tuple[str, str]]:
    """The one way a test runs an API server: yields (base URL, bootstrap admin token). `settings` a dict (local
    storage unless `storage` or the dict names one) or a whole `Settings`; `port` a fixed one, for a test that
    stops a server and starts one at the same address; `options` are ServerOptions fields."""
    admin = options.pop("admin_key", None) or "boot-" + secrets.token_urlsafe(24)
    if not isinstance(settings, Settings):
        storage = storage or (settings or {}).get("storage")
        storage = storage or {"kind": "local", "path": tempfile.mkdtemp(prefix="offload-server-")}
        settings = Settings.model_validate({**(settings or {}), "storage": storage})
    options.setdefault("auth_fail_limit", 100_000)  # tests present bad keys on purpose; test_security tests the limit
    options.setdefault("maintenance_interval_s", 0.2)
    opts = ServerOptions(redis_url=redis_url, settings=settings, admin_key=admin, **options)
    with running_server(opts, port=port) as url:
        yield url, admin


def client(url: str, token: str | None = None, *, header: str = "bearer") -> httpx.Client:
    headers = {}
    if token and header == "bearer":
        headers["Authorization"] = f"Bearer {token}"
    elif token:
        headers["X-API-Key"] = token
    return web.client(base_url=url, headers=headers, timeout=30)


def direct_key(redis_url: str, scope: str, queue: str) -> str:
    """A key created the way `offload keys create` does (straight in Redis), before any server runs."""
    from offload.access.api_keys import KeyStore

    async def go() -> str:
        redis = await connect(redis_url)
        try:
            return (await KeyStore(redis).create(scope, [queue], f"test {scope}"))[1]
        finally:
            await redis.aclose()

    return asyncio.run(go())


def make_key(url: str, admin: str, scope: str, queues: list[str] | None = None) -> str:
    with client(url, admin) as c:
        r = c.post("/v1/keys", json={"scope": scope, "queues": queues or [], "name": f"test {scope}"})
        assert r.status_code == 201, r.text
        token: str = r.json()["token"]
        return token


def store_call(redis_url: str, fn: Callable[[QueueStore], Awaitable[T]]) -> T:
    """Run `fn(store)` on a connection of its own, from code without an event loop (the server runs in a thread)."""

    async def go() -> T:
        redis = await connect(redis_url)
        try:
            return await fn(QueueStore(redis))
        finally:
            await redis.aclose()

    return asyncio.run(go())
