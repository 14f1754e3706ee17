"""What a command needs before it can act: the settings, the Redis URL, a connection for the length of one call.

Every command reads the configuration the same way (`offload.config.config_file` decides which file) and reaches
Redis the same way as the Python client (`offload.config.store_url`). A command has a person waiting: an unreachable
store is retried briefly (`CALLER_RETRY_S`) and then named in one error line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from offload.caps import CapLimits
from offload.cli.errors import errors
from offload.config import Settings, load_settings, store_url
from offload.connection import CALLER_RETRY_S, connect, connect_timeout
from offload.errors import OffloadError, QueueNotFound
from offload.queue.durability import Durability
from offload.queue.keyspace import queue_of, validate_queue
from offload.queue.memory import require_noeviction
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient
from offload.suggest import closest, did_you_mean

T = TypeVar("T")


def settings(config: Path | None = None) -> Settings:
    """offload.yaml plus the environment; a problem ends the command with the offending field named."""
    with errors():
        return load_settings(config)
    raise AssertionError("unreachable")  # errors() either returns above or exits


def readable_settings(config: Path | None = None) -> Settings | None:
    """The settings, or None when this shell cannot read them (the workers' secrets unset, say): for what the
    config only adds to (caps shown, queue names known), which must not fail a command; its own commands report
    the problem."""
    try:
        return load_settings(config)
    except OffloadError:
        return None


def configured_caps(config: Path | None = None) -> dict[str, CapLimits]:
    """The daily caps of the configured queues, for showing which are capped (none when the config is unreadable)."""
    loaded = readable_settings(config)
    if loaded is None:
        return {}
    return {name: limits for name in loaded.queues if (limits := loaded.cap_limits(name)) is not None}


def configured_durability(config: Path | None = None) -> Durability | None:
    """offload.yaml's (or OFFLOAD_DURABILITY_*'s) `durability`: what someone acts on waits for the replicas, as
    everywhere (none when the config is unreadable)."""
    loaded = readable_settings(config)
    return loaded.durability if loaded is not None else None


def redis_url(url: str | None, config: Path | None = None) -> str | None:
    """None means the embedded Valkey (started on demand by `connect`)."""
    with errors():
        return store_url(url, config)
    raise AssertionError("unreachable")  # errors() either returns above or exits


def run_redis(
    url: str | None,
    fn: Callable[[RedisClient], Awaitable[T]],
    *,
    config: Path | None = None,
    makes_work: bool = False,
    retry_for: float | None = None,
) -> T:
    """Connect, run `fn(redis)`, close; failures become one error line. `makes_work`: the command adds or
    restarts jobs, so a store that may evict is refused first (queue/memory.py). `retry_for`: how long an
    unreachable store is retried (default: a command's short `CALLER_RETRY_S`)."""
    target = redis_url(url, config)

    async def session() -> T:
        redis = await connect(target, retry_for=connect_timeout(CALLER_RETRY_S) if retry_for is None else retry_for)
        try:
            if makes_work:
                await require_noeviction(redis)
            return await fn(redis)
        finally:
            await redis.aclose()

    with errors():
        return asyncio.run(session())
    raise AssertionError("unreachable")


def run_store(
    url: str | None,
    fn: Callable[[QueueStore], Awaitable[T]],
    *,
    queues: Sequence[str] = (),
    known: Sequence[str] = (),
    jobs: Sequence[str] = (),
    config: Path | None = None,
    makes_work: bool = False,
) -> T:
    """`run_redis` with a QueueStore. Names are validated first (a typo should not wait out a connect timeout);
    a queue in `known` must exist (a command reading or changing its jobs), one in `queues` need not (enqueue,
    pause: they create it)."""
    with errors():
        for queue in (*queues, *known):
            validate_queue(queue)
        for job_id in jobs:
            queue_of(job_id)

    durability = configured_durability(config)

    async def go(redis: RedisClient) -> T:
        store = QueueStore(redis, durability=durability)
        for queue in known:
            await require_queue(store, queue, config)
        return await fn(store)

    return run_redis(url, go, config=config, makes_work=makes_work)


async def require_queue(store: QueueStore, queue: str, config: Path | None) -> None:
    """A queue exists once anything was enqueued to it or it was paused (the store's list), or offload.yaml declares
    it; else QueueNotFound, naming the closest existing queue."""
    listed = await store.queues()
    if queue in listed:
        return
    loaded = readable_settings(config)  # the config is only a second source of names here
    declared = list(loaded.queues) if loaded is not None else []
    if queue not in declared:
        raise QueueNotFound(f"unknown queue {queue!r}{did_you_mean(closest(queue, {*listed, *declared}))}")
