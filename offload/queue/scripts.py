"""Loads the Lua scripts once and runs them by SHA, reloading after a server restart (NOSCRIPT)."""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

EVENTS_MAX = 10_000
#: Upper bounds (seconds) of the wait (ready -> claimed) and run (claimed -> succeeded) histograms the scripts keep.
HIST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
NAMES = (
    "enqueue",
    "claim",
    "heartbeat",
    "checkpoint",
    "complete",
    "fail",
    "hold",
    "move",
    "cancel",
    "ack_cancel",
    "release_leases",
    "reap",
    "purge",
    "stats",
    "get",
    "ingest",
    "reserve",
    "release_window",
    "forgive",
    "begin",
    "fence",
    "hook",
)


def _source(name: str) -> str:
    lua = resources.files("offload.queue") / "lua"
    buckets = ", ".join(str(int(b * 1000)) for b in HIST_BUCKETS_S)
    prelude = (lua / "common.lua").read_text().replace("__EVENTS_MAX__", str(EVENTS_MAX))
    prelude = prelude.replace("__HIST_BUCKETS__", buckets)
    return prelude + "\n" + (lua / f"{name}.lua").read_text()


class Script:
    """One server-side atomic operation. Works with both Redis and RedisCluster clients (routed by KEYS[1])."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str | None = None) -> None:
        self.name = name
        self.source = source if source is not None else _source(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(self, redis: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await redis.eval(self.source, len(keys), *keys, *args)


class Scripts:
    """All scripts, parsed once per process."""

    def __init__(self) -> None:
        for name in NAMES:
            setattr(self, name, Script(name))

    def __getattr__(self, name: str) -> Script:  # for mypy: attributes are set dynamically above
        raise AttributeError(name)


SCRIPTS = Scripts()
