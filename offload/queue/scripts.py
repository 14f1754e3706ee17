"""The one loader of offload's Lua scripts: every server-side atomic step is a file in offload/queue/lua/, read
once per process and run by SHA, reloaded after a server restart (NOSCRIPT).

A script file starts with a header naming its KEYS, ARGV and reply (`-- KEYS:`, `-- ARGV:`, `-- Returns:`), as
BullMQ's src/commands do. Code several scripts share lives in lua/includes/, one theme each (records, events,
metrics, history, ready, terminal, leases, caps, outages, clock, cooldown, leader), and is put in by a line
`--- @include "<name>"` (each include at most once per script, includes may include others). A file includes what
it uses itself, and nothing else. The autoscaler's, the HTTP server's and the backend limiter's scripts live here
too, so there is one way to load and run a script. tests/jobstore/test_lua_scripts.py checks every file has the
header and is a `Scripts` attribute, every attribute is used, and every file's includes are the ones it uses.

A script that must run when Redis/Valkey is at its `maxmemory` opens with the shebang `#!lua flags=allow-oom`
(Redis 7+, Valkey): without it the server refuses a script's first write that adds data (SET, HSET, ZADD, XADD,
HINCRBY...) at the limit, so a checkpoint could not record a paid remote job and nothing could free memory. Those
are the small, bounded scripts that end or keep a job's lease (checkpoint, complete, fail, hold, ack_cancel,
heartbeat, release_leases), maintenance (reap, which trims first) and the alert mark; the scripts that add work
(enqueue, claim, begin, ...) are refused at the limit and their callers wait or refuse cleanly. The shebang is the
first line of the file, never in an include; the header follows it.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

from offload.redis_client import RedisClient

EVENTS_MAX = 10_000
#: Upper bounds (seconds) of the wait (ready -> claimed) and run (claimed -> succeeded) histograms the scripts keep.
HIST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
#: How long the history keeps its minute, hour and day points by default (seconds; offload.yaml's `history:`).
HISTORY_KEEP_S = (2 * 86400, 15 * 86400, 400 * 86400)
INCLUDE = re.compile(r'^--- @include "([a-z_]+)"[ \t]*$', re.MULTILINE)
LUA = resources.files("offload.queue") / "lua"


def _expand(text: str, seen: set[str]) -> str:
    def include(match: re.Match[str]) -> str:
        name = match[1]
        if name in seen:
            return ""
        seen.add(name)
        text = (LUA / "includes" / f"{name}.lua").read_text()
        if text.startswith("#!"):
            raise ValueError(f"include {name!r} has a shebang: script flags belong on a script's first line")
        return _expand(text, seen).rstrip("\n")

    return INCLUDE.sub(include, text)


def source(name: str) -> str:
    """The script `name` as sent to Redis: includes put in, constants filled in."""
    text = _expand((LUA / f"{name}.lua").read_text(), set())
    buckets = ", ".join(str(int(b * 1000)) for b in HIST_BUCKETS_S)
    keep = ", ".join(str(s * 1000) for s in HISTORY_KEEP_S)
    text = text.replace("__EVENTS_MAX__", str(EVENTS_MAX)).replace("__HIST_BUCKETS__", buckets)
    return text.replace("__HISTORY_KEEP_MS__", keep)


class Script:
    """One server-side atomic operation. Works with both Redis and RedisCluster clients (routed by KEYS[1])."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = source(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def load(self, redis: RedisClient) -> None:
        """Send the source, for callers that pipeline EVALSHA themselves and got NOSCRIPT back."""
        await redis.script_load(self.source)

    async def __call__(self, redis: RedisClient, keys: list[str], args: list[Any]) -> Any:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await redis.eval(self.source, len(keys), *keys, *args)


class Scripts:
    """Every script, parsed once per process: one typed attribute per file of offload/queue/lua, so a misspelt
    script name is a mypy error (and an AttributeError), not a script that silently does not exist."""

    # the job queue (offload/queue/store.py)
    enqueue: Script
    claim: Script
    heartbeat: Script
    checkpoint: Script
    complete: Script
    fail: Script
    hold: Script
    move: Script
    cancel: Script
    ack_cancel: Script
    release_leases: Script
    reap: Script
    purge: Script
    stats: Script
    get: Script
    created: Script  # the listing of every state (offload/queue/listing.py)
    search: Script  # the job search and the dead letter's error groups (offload/queue/search.py)
    story: Script  # a job's attempts (offload/queue/attempts.py)
    ingest: Script
    reserve: Script
    release_window: Script
    usage: Script
    forgive: Script
    begin: Script
    fence: Script
    overdue: Script  # GPU-worker runs past their queue's timeout (offload/server/routes_workers.py)
    hook: Script  # a verified provider webhook (offload/server/routes_hooks.py)
    worker_touch: Script  # a remote worker's heartbeat on its registry record (offload/server/registry.py)
    # a backend's shared rate limit (offload/queue/backend_limits.py)
    rate_acquire: Script
    cool_down: Script
    health: Script  # a routed backend's health: cool-downs, the half-open probe (offload/queue/backend_health.py)
    # completion webhooks: the outbox and the signing secrets (offload/queue/outbox.py)
    callback_claim: Script
    callback_done: Script
    callback_requeue: Script
    callback_rotate: Script
    # the HTTP server's brute-force guard (offload/server/auth.py)
    auth_fail: Script
    # the autoscaler (offload/autoscale/)
    leader_acquire: Script
    leader_release: Script
    instance_write: Script
    provider_swap: Script
    alert_once: Script
    history_sample: Script  # the gauges' sample and the history's settings (offload/queue/history.py)
    # the mark before a durable write's WAIT (offload/queue/durability.py)
    sync_mark: Script

    def __init__(self) -> None:
        for name in NAMES:
            setattr(self, name, Script(name))


NAMES: tuple[str, ...] = tuple(Scripts.__annotations__)
SCRIPTS = Scripts()
