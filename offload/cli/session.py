"""What a command needs before it can act: the settings, the Redis URL, a connection for the length of one call.

Every command reads the configuration the same way (`offload.config.config_file` decides which file) and reaches
Redis the same way as the Python client (`offload.config.store_url`). A command has a person waiting: an unreachable
store is retried briefly (`CALLER_RETRY_S`) and then named in one error line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from offload.caps import CapLimits
from offload.cli.errors import errors
from offload.config import Settings, load_settings, store_url
from offload.connection import CALLER_RETRY_S, connect, connect_timeout
from offload.errors import ConfigError
from offload.queue.memory import require_noeviction
from offload.redis_client import RedisClient

T = TypeVar("T")


def settings(config: Path | None = None) -> Settings:
    """offload.yaml plus the environment; a problem ends the command with the offending field named."""
    with errors():
        return load_settings(config)
    raise AssertionError("unreachable")  # errors() either returns above or exits


def configured_caps(config: Path | None = None) -> dict[str, CapLimits]:
    """The daily caps of the configured queues, for showing which are capped. Best effort: a config this shell
    cannot read (the workers' secrets unset) shows no caps rather than failing a command that only reads."""
    try:
        loaded = load_settings(config)
    except ConfigError:
        return {}
    return {name: limits for name in loaded.queues if (limits := loaded.cap_limits(name)) is not None}


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
