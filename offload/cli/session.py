"""What a command needs before it can act: the settings, the Redis URL, a connection for the length of one call.

Every command reads the configuration the same way (`offload.config.config_file` decides which file) and reaches
Redis the same way: --url, else OFFLOAD_REDIS_URL / REDIS_URL, else the config's redis_url, else the embedded
Valkey. The config is only read when the environment does not already name the server, so a queue command in a
shell without the workers' secrets still works.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from offload.cli.errors import errors
from offload.config import Settings, load_settings
from offload.connection import configured_url, connect
from offload.queue.memory import require_noeviction
from offload.redis_client import RedisClient

T = TypeVar("T")


def settings(config: Path | None = None) -> Settings:
    """offload.yaml plus the environment; a problem ends the command with the offending field named."""
    with errors():
        return load_settings(config)
    raise AssertionError("unreachable")  # errors() either returns above or exits


def redis_url(url: str | None, config: Path | None = None) -> str | None:
    """None means the embedded Valkey (started on demand by `connect`)."""
    return url or configured_url() or settings(config).redis_url


def run_redis(
    url: str | None, fn: Callable[[RedisClient], Awaitable[T]], *, config: Path | None = None, makes_work: bool = False
) -> T:
    """Connect, run `fn(redis)`, close; failures become one error line. `makes_work`: the command adds or
    restarts jobs, so a store that may evict is refused first (queue/memory.py)."""
    target = redis_url(url, config)

    async def session() -> T:
        redis = await connect(target)
        try:
            if makes_work:
                await require_noeviction(redis)
            return await fn(redis)
        finally:
            await redis.aclose()

    with errors():
        return asyncio.run(session())
    raise AssertionError("unreachable")
