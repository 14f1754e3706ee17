"""Shared fixtures: real servers only. `backend_url` runs a test on the embedded-style Valkey 9, on a Redis 7 the
tests start from the machine's redis-server (when it has one) and, only when OFFLOAD_TEST_REDIS_URL names one, on
that Redis (its DB flushed before and after each test)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from support.procs import no_process_outlives_the_session  # noqa: F401 (autouse: nothing outlives the session)
from support.s3server import RcloneS3
from support.servers import REDIS7, ValkeyServer, named_redis

from bench.chaos.faketime import ClockFile
from offload.connection import connect
from offload.queue.store import QueueStore

T = TypeVar("T")

# Parallel test workers (pytest-xdist) each get their own DB on a named Redis, counting down from the URL's.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
NAMED_REDIS = named_redis(_WORKER)
BACKENDS = ["valkey9", *(["redis7"] if REDIS7 else []), *(["named"] if NAMED_REDIS else [])]
_BACKEND_FIXTURE = {"valkey9": "valkey", "redis7": "redis7"}


@pytest.fixture(scope="session")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    """One Valkey 9 (AOF, appendfsync always) for the session; tests isolate by flushing."""
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.fixture(scope="session")
def redis7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    """One Redis 7 (the machine's redis-server, AOF) for the session: the compatibility half of `backend_url`."""
    assert REDIS7 is not None
    with ValkeyServer(tmp_path_factory.mktemp("redis7"), binary=REDIS7) as server:
        yield server


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest) -> Iterator[str]:
    url = NAMED_REDIS if request.param == "named" else request.getfixturevalue(_BACKEND_FIXTURE[request.param]).url
    assert url is not None
    r = redis.Redis.from_url(url)
    r.flushdb()
    yield url
    r.flushdb()
    r.close()


@pytest.fixture
def valkey_url(valkey: ValkeyServer) -> Iterator[str]:
    """Valkey 9 only, flushed: for tests whose subject is not Redis-version compatibility."""
    r = valkey.client()
    r.flushdb()
    yield valkey.url
    r.flushdb()


@pytest.fixture(scope="session")
def fast_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    """A Valkey without fsync on every write, for tests whose subject is policy over thousands of small writes
    (the autoscaler's simulated day), not durability."""
    with ValkeyServer(tmp_path_factory.mktemp("valkey-fast"), appendfsync="no") as server:
        yield server


@pytest.fixture
def fast_valkey_url(fast_valkey: ValkeyServer) -> Iterator[str]:
    r = fast_valkey.client()
    r.flushdb()
    yield fast_valkey.url
    r.flushdb()


@pytest.fixture
def own_valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A Valkey of the test's own (AOF, appendfsync always: nothing acknowledged is lost), for tests that
    SIGKILL, SIGSTOP or restart it."""
    with ValkeyServer(tmp_path / "valkey", appendfsync="always") as server:
        yield server


@pytest.fixture
def stepped_valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A Valkey of the test's own whose wall clock the test steps while it runs (`stepped_valkey.clock.set(s)`,
    libfaketime: bench/chaos/faketime.py), for the faults of the store's clock and of its UTC day."""
    clock = ClockFile(tmp_path / "valkey-clock")
    with ValkeyServer(tmp_path / "valkey-stepped", appendfsync="always", clock=clock) as server:
        yield server


@pytest.fixture(scope="module")
def s3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RcloneS3]:
    """One S3 server (rclone) per module, with the module's `BUCKET` made when it names one."""
    with RcloneS3(tmp_path_factory.mktemp("s3")) as server:
        if bucket := getattr(request.module, "BUCKET", None):
            server.make_bucket(bucket)
        yield server


@pytest.fixture
async def store(backend_url: str) -> AsyncIterator[QueueStore]:
    client = await connect(backend_url)
    yield QueueStore(client)
    await client.aclose()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from sync test code."""
    return asyncio.run(coro)


@pytest.fixture
def tmp_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private OFFLOAD_HOME so embedded-server tests never touch the developer's .offload/."""
    monkeypatch.setenv("OFFLOAD_HOME", str(tmp_path / ".offload"))
    monkeypatch.delenv("OFFLOAD_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    return tmp_path / ".offload"


# -- shared by the server and dashboard test modules (each defines its own `api` server fixture) -------------


@pytest.fixture
def admin(api: tuple[str, str]) -> Iterator[Any]:
    """An httpx client with the module's server's bootstrap admin key."""
    from support.server_helpers import client

    with client(api[0], api[1]) as c:
        yield c


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Debian Chromium per module (Playwright with executable_path; never `playwright install`)."""
    from support.dashboard_helpers import chromium

    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    from support.dashboard_helpers import new_page

    with new_page(browser) as p:
        yield p
