"""Where the job store lives and how to reach it, with retries that end in one clear error."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    InvalidResponse,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from offload.backoff import Backoff
from offload.env import env_float, env_str, process_env
from offload.errors import ConnectionFailed
from offload.local.embedded import ensure_embedded
from offload.redact import mask_url as mask_url  # re-exported: the one redaction path
from offload.redact import redact
from offload.redis_client import RedisClient

T = TypeVar("T")


class GatedPool(aioredis.ConnectionPool):
    """A bounded pool whose waiters queue on a semaphore.

    redis-py's BlockingConnectionPool makes every waiter take the pool's lock in turn before it may wait, and a
    release queues for that same lock: with thousands of job tasks waiting, each hand-over costs an event-loop
    pass and releases starve (docs/explanation/performance.md, *Job-store connections*). A semaphore hands a slot
    straight to the next waiter."""

    def __init__(self, *, timeout: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._gate = asyncio.Semaphore(self.max_connections)
        self._gate_timeout = timeout
        self._gated: set[int] = set()

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self._gate_timeout):
                await self._gate.acquire()
        except TimeoutError:
            raise RedisConnectionError("No connection available.") from None
        try:
            connection = await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except BaseException:
            self._gate.release()
            raise
        self._gated.add(id(connection))
        return connection

    async def release(self, connection: Any) -> None:
        try:
            await super().release(connection)
        finally:
            if id(connection) in self._gated:
                self._gated.discard(id(connection))
                self._gate.release()


def restore_lost_cancels() -> None:
    """Deliver the cancels Python 3.11 loses in redis-py's command writes (applied once, at import).

    Python 3.11's `asyncio.wait_for` returns the result when a cancel lands as what it waits for finishes
    (CPython gh-86296, fixed in 3.12), and redis-py writes every command through it (its socket timeout). A task
    cancelled in those two event-loop steps ran on as if never cancelled: a drain's cut job kept going, and a
    server's stop waited forever on a loop it had cancelled. The write is wrapped: a cancel asked for during it
    and not delivered is raised after it, on a closed connection (the command's reply is never read)."""
    if sys.version_info >= (3, 12) or getattr(AbstractConnection.send_packed_command, "restores_cancels", False):
        return
    write = AbstractConnection.send_packed_command

    async def send_packed_command(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        task = asyncio.current_task()
        asked = task.cancelling() if task is not None else 0
        await write(self, command, check_health)
        # a cancel still to be delivered (`_must_cancel`) reaches the task at its next await: not lost
        if task is not None and task.cancelling() > asked and not getattr(task, "_must_cancel", False):
            await self.disconnect(nowait=True)
            raise asyncio.CancelledError

    send_packed_command.restores_cancels = True  # type: ignore[attr-defined]
    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]


restore_lost_cancels()


def _password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


# Redis/Valkey answers that mean "not reachable or not serving right now" (down, restarting, loading its AOF,
# failing over, a cluster re-sharding, full at its maxmemory), as opposed to a bad command or a script error. One
# list, so every caller that must ride out an outage (the dispatch worker above all) agrees on what one is.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
    ReadOnlyError,
    SlotNotCoveredError,
    OutOfMemoryError,
    OSError,
)
_OUTAGE_REPLIES = ("LOADING", "MISCONF", "MASTERDOWN", "NOREPLICAS", "CLUSTERDOWN", "TRYAGAIN", "READONLY")
# The server's text for a write refused at maxmemory (noeviction): as its own reply (redis-py's OutOfMemoryError)
# and inside a script error's text, which older servers wrap in "ERR Error running script ...".
_OOM_TEXT = "command not allowed when used memory > 'maxmemory'"
# uvloop's answer to a write on a connection the server has reset (asyncio's loop raises ConnectionResetError
# there): redis-py lets it through as it is, after dropping the connection. Taken for a worker error, one Valkey
# crash would fail attempts and stop a worker; it is an outage like the others.
_CLOSED_TRANSPORT = "the handler is closed"


def is_outage(exc: BaseException) -> bool:
    """True for the job store being unreachable or not serving (worth waiting for), False for anything else. A
    write refused at maxmemory is one too (`is_oom`): it is our infrastructure's, never the job's."""
    if isinstance(exc, OUTAGE_ERRORS):
        return True
    if isinstance(exc, RuntimeError):
        return _CLOSED_TRANSPORT in str(exc)
    return is_oom(exc) or (isinstance(exc, ResponseError) and str(exc).startswith(_OUTAGE_REPLIES))


def is_oom(exc: BaseException) -> bool:
    """The store is at its maxmemory and refused a write that would add data (noeviction). Unlike the other
    outages the store still answers, and the writes that free memory or finish jobs still run (their scripts
    carry `allow-oom`), so a caller waits for room for this write only, not for the store as a whole."""
    if isinstance(exc, OutOfMemoryError):
        return True
    return isinstance(exc, ResponseError) and (str(exc).startswith("OOM ") or _OOM_TEXT in str(exc))


# How long a connect keeps trying before it fails in one line (OFFLOAD_REDIS_CONNECT_TIMEOUT overrides both): a
# worker or server may start beside its store and wait for it; a command or a producer has a person waiting.
SERVICE_RETRY_S = 10.0
CALLER_RETRY_S = 3.0
# The waits between those tries: short at first (a store starting beside us is up in a moment), then every 2 s.
CONNECT_RETRY_BASE_S = 0.1
CONNECT_RETRY_CAP_S = 2.0


def connect_timeout(default: float = SERVICE_RETRY_S) -> float:
    """Seconds a connect retries: OFFLOAD_REDIS_CONNECT_TIMEOUT, else `default`."""
    return env_float("OFFLOAD_REDIS_CONNECT_TIMEOUT", default, minimum=0)


def configured_url(env: Mapping[str, str] | None = None) -> str | None:
    """OFFLOAD_REDIS_URL, else the tutorial's REDIS_URL, else None (meaning: the config's, else the embedded)."""
    env = process_env() if env is None else env
    return env.get("OFFLOAD_REDIS_URL") or env.get("REDIS_URL") or None


def resolve_url(url: str | None = None) -> str:
    return url or configured_url() or ensure_embedded()


def _split_cluster_flag(url: str) -> tuple[str, bool]:
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    flag = query.pop("cluster", ["0"])[0].lower() in ("1", "true", "yes")
    flag = flag or env_str("OFFLOAD_REDIS_CLUSTER", "").lower() in ("1", "true", "yes")
    return urlunsplit(parts._replace(query=urlencode(query, doseq=True))), flag


async def connect(url: str | None = None, *, retry_for: float | None = None, max_connections: int = 64) -> RedisClient:
    """Connect and PING, retrying with exponential backoff for `retry_for` seconds (default `connect_timeout()`),
    so a worker started before its Redis waits instead of crashing."""
    target = resolve_url(url)
    plain, cluster = _split_cluster_flag(target)
    if retry_for is None:
        retry_for = connect_timeout()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for
    waits = Backoff(CONNECT_RETRY_BASE_S, CONNECT_RETRY_CAP_S)
    while True:
        client: aioredis.Redis | RedisCluster | None = None
        try:
            if cluster:
                client = RedisCluster.from_url(plain, decode_responses=True)
                await client.initialize()
            else:
                # A bounded pool: thousands of concurrent jobs wait for one of 64 connections instead of
                # failing with "too many connections" (redis-py's default pool raises past 100).
                pool = GatedPool.from_url(plain, decode_responses=True, max_connections=max_connections, timeout=60)
                client = aioredis.Redis(connection_pool=pool)
            await client.ping()
            return cast(RedisClient, client)  # decode_responses=True: the replies are str, as RedisClient says
        except InvalidResponse:  # something answered, in another protocol (an HTTP server): waiting will not help
            if client is not None:
                await client.aclose()
            raise ConnectionFailed(
                f"{mask_url(target)} answered, but not as Redis/Valkey: check the URL's host and port"
            ) from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if client is not None:
                await client.aclose()
            reason = redact(str(exc).replace(target, mask_url(target)), [_password(target)]) or type(exc).__name__
            if isinstance(exc, AuthenticationError):  # a wrong password stays wrong: no point waiting it out
                raise ConnectionFailed(
                    f"Redis/Valkey at {mask_url(target)} refused the credentials: {reason}"
                ) from None
            if loop.time() >= deadline:
                raise ConnectionFailed(
                    f"cannot reach Redis/Valkey at {mask_url(target)} after {retry_for:g}s: {reason}"
                ) from None
            await asyncio.sleep(min(waits.next(), max(deadline - loop.time(), 0.0)))


async def at_start(fn: Callable[[], Awaitable[T]], *, retry_for: float | None = None) -> T:
    """`fn()`, a start-up read of the store made right after `connect` (its eviction policy, its replicas), sent
    again through an outage for as long as `connect` would wait: a store that fails over, restarts or resets our
    connections just as a process starts is waited for like one that is not up yet, never a crash."""
    if retry_for is None:
        retry_for = connect_timeout()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for
    waits = Backoff(CONNECT_RETRY_BASE_S, CONNECT_RETRY_CAP_S)
    while True:
        try:
            return await fn()
        except Exception as exc:
            if not is_outage(exc) or loop.time() >= deadline:
                raise
            await asyncio.sleep(min(waits.next(), max(deadline - loop.time(), 0.0)))
