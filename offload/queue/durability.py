"""Durability: a write is acknowledged only once a failover cannot take it back.

Redis and Valkey replicate asynchronously: a primary answers a write before any replica has it, and a failover to
a replica that lags loses every write the replica had not received, acknowledged or not. With `durability` set
(offload.yaml, `OFFLOAD_DURABILITY_*`, `Client(durability=...)`), the writes someone acts on (an enqueue the
producer is told of, a submit intent before a paid call, a remote id, a completion, a provider's webhook, a
cancel) are each followed on the same connection by `WAIT replicas timeout_ms` (`WAITAOF 1 replicas timeout_ms`
with `fsync`: on the primary's disk and on the replicas' disks too). A write that falls short raises
`NotReplicated`: the producer retries (with its idempotency key), the dispatch worker waits and sends it again as
it does through an outage (the scripts are idempotent). See docs/explanation/architecture.md, *Replication*.

WAIT counts the replicas that have the connection's own last write. A write sent again after a reply it never
got (or after a WAIT that fell short) may change nothing the second time, and then a WAIT would measure an
older write of that connection, or none. So a mark is written right before each WAIT (sync_mark.lua, which may
run at `maxmemory`): the WAIT then covers everything the primary had applied up to that moment, whichever
connection wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from redis.asyncio.cluster import PipelineCommand, RedisCluster
from redis.exceptions import AskError, NoScriptError, ResponseError, TryAgainError

from offload.errors import ConfigError, StoreError
from offload.queue.scripts import SCRIPTS, Script
from offload.redis_client import RedisClient, RedisPipeline

#: The environment names of the `durability` fields (offload.config and the producer clients read them).
ENV = {
    "replicas": "OFFLOAD_DURABILITY_REPLICAS",
    "timeout_ms": "OFFLOAD_DURABILITY_TIMEOUT_MS",
    "fsync": "OFFLOAD_DURABILITY_FSYNC",
}
_RANGES = {"replicas": (0, 64), "timeout_ms": (1, 600_000)}


@dataclass(frozen=True)
class Durability:
    """How many replicas must have a write before it is acknowledged (`replicas`), how long one write waits for
    them (`timeout_ms`, never 0: WAIT 0 would wait for ever), and `fsync`: WAITAOF, the write on the primary's
    disk and on the replicas' disks, not only in their memory. A dataclass, not a pydantic model, so that
    `import offload` stays light for producers; offload.config validates it like its models."""

    replicas: int = 1
    timeout_ms: int = 1000
    fsync: bool = False
    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid"}

    def __post_init__(self) -> None:
        for name, (low, high) in _RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name}: must be a whole number from {low} to {high}, got {value!r}")
        if not isinstance(self.fsync, bool):
            raise ValueError(f"fsync: must be true or false, got {self.fsync!r}")
        if self.replicas == 0 and not self.fsync:
            raise ValueError("replicas 0 without fsync waits for nothing: set replicas to 1 or more, or fsync: true")

    def command(self) -> tuple[str | int, ...]:
        if self.fsync:
            return ("WAITAOF", 1, self.replicas, self.timeout_ms)
        return ("WAIT", self.replicas, self.timeout_ms)

    def check(self, reply: Any) -> None:
        """Raise `NotReplicated` unless the WAIT/WAITAOF `reply` counts enough copies."""
        if self.fsync:
            local, replicas = (int(n) for n in reply)
            if local >= 1 and replicas >= self.replicas:
                return
            got = f"fsynced on the primary: {'yes' if local else 'no'}, on {replicas} of {self.replicas} replicas"
        else:
            if int(reply) >= self.replicas:
                return
            got = f"on {int(reply)} of {self.replicas} replicas"
        raise NotReplicated(
            f"NOREPLICAS durability: the write was {got} within {self.timeout_ms} ms; a failover could lose it, "
            "so it is not acknowledged: send it again (an enqueue with the same idempotency key)"
        )


class NotReplicated(StoreError, ResponseError):
    """A write the primary applied but too few replicas (or disks) confirmed within `durability.timeout_ms`. It
    may survive or not: it is not acknowledged. Its message starts like the server's own NOREPLICAS refusal
    (`min-replicas-to-write`), so `offload.connection.is_outage` takes it for what it is: the store cannot
    keep writes safe right now; wait and send again."""


def refusal(exc: Exception) -> Exception:
    """What a WAIT/WAITAOF that the server refused means: a ConfigError naming the setting to change, or `exc`."""
    text = str(exc).lower()
    if "waitaof" in text and "unknown command" in text:
        return ConfigError("durability.fsync: this server has no WAITAOF (Redis or Valkey 7.2+); set fsync: false")
    if "waitaof" in text and "appendonly" in text:
        return ConfigError(
            "durability.fsync: the primary's appendonly is off, so no write reaches its disk at once; turn "
            "appendonly on or set fsync: false"
        )
    return exc


def from_env(env: Mapping[str, str]) -> dict[str, str]:
    """The `durability` fields the environment sets (none: an empty dict)."""
    return {field: env[name].strip() for field, name in ENV.items() if env.get(name, "").strip()}


async def run_script(
    script: Script, redis: RedisClient, keys: list[str], args: list[Any], durability: Durability | None
) -> Any:
    """`script(redis, keys, args)`, acknowledged only once replicated: the mark and the WAIT follow on the same
    connection (one pipeline), or on a cluster on a connection to the node that owns KEYS[1]. Without
    `durability`, the plain call."""
    if durability is None:
        return await script(redis, keys, args)
    if isinstance(redis, RedisCluster):  # a cluster pipeline refuses EVALSHA
        result = await script(redis, keys, args)
        await confirm(redis, keys[0], durability)
        return result
    for attempt in range(2):
        pipe = redis.pipeline(transaction=False)
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        mark(pipe, keys[0], durability)
        result, *confirmation = await pipe.execute(raise_on_error=False)
        if attempt == 0 and isinstance(result, NoScriptError):
            await script.load(redis)
            continue  # it did not run: the mark and the WAIT go again with it
        if isinstance(result, Exception):
            raise result
        await settle(redis, keys[0], confirmation, durability)
        return result
    raise AssertionError("unreachable")


def mark(pipe: RedisPipeline, prefix: str, durability: Durability) -> None:
    """Queue the mark and the WAIT after the writes they confirm; `settle` reads their two replies."""
    pipe.evalsha(SCRIPTS.sync_mark.sha, 1, prefix)
    pipe.execute_command(*durability.command())


async def settle(redis: RedisClient, prefix: str, replies: list[Any], durability: Durability) -> None:
    """Raise what the mark or the WAIT answered wrong, or `NotReplicated` when too few replicas confirmed. A mark
    the server did not know (NOSCRIPT: it restarted) is loaded and sent again with its WAIT."""
    if isinstance(replies[0], NoScriptError):
        await confirm(redis, prefix, durability)
    else:
        _check(replies, durability)


def _check(replies: list[Any], durability: Durability) -> None:
    for reply in replies:
        if isinstance(reply, AskError):  # (or MOVED) the queue's slot moved: resent, the script finds its node
            raise TryAgainError(f"TRYAGAIN the queue's slot moved before its WAIT ({reply})")
        if isinstance(reply, Exception):
            raise refusal(reply)
    durability.check(replies[1])


async def confirm(redis: RedisClient, prefix: str, durability: Durability) -> None:
    """The mark and the WAIT alone, after writes already made: on a cluster on one connection to the node that
    owns `prefix`'s slot (WAIT counts that node's replicas, and names no key the cluster client could route by)."""
    for attempt in range(2):
        if isinstance(redis, RedisCluster):
            node = redis.get_node_from_key(prefix)
            if node is None:
                raise TryAgainError(f"TRYAGAIN no node serves {prefix!r} yet")
            commands = [
                PipelineCommand(0, "EVALSHA", SCRIPTS.sync_mark.sha, 1, prefix),
                PipelineCommand(1, *durability.command()),
            ]
            await node.execute_pipeline(commands)
            replies = [command.result for command in commands]
        else:
            pipe = redis.pipeline(transaction=False)
            mark(pipe, prefix, durability)
            replies = await pipe.execute(raise_on_error=False)
        if attempt == 0 and isinstance(replies[0], NoScriptError):
            await SCRIPTS.sync_mark.load(redis)
            continue
        _check(replies, durability)
        return
