"""The job store's memory: how full Redis/Valkey is, and whether it may evict what offload wrote.

Two rules, read from `INFO memory` (which managed services answer where they disable CONFIG):

- `maxmemory-policy` must be `noeviction`. Under any other policy the server deletes keys to make room: an
  evicted lease, cap counter, idempotency key or job record is a job paid twice or lost. A producer or a command
  that adds jobs refuses to start on such a store (`require_noeviction`, one line naming the policy and what to
  set), and a long-running process re-reads it (`PolicyWatch`) and starts no new paid work while it is wrong. A
  dispatch worker and the server start paused instead of refusing: restarted by systemd, Kubernetes or a deploy
  while the store is being reconfigured, they must wait like running ones, not crash-loop (the server would take
  the webhooks of paid jobs, the dashboard and the alert down with it).
- At `maxmemory` (noeviction) the server refuses writes that add data (an OOM reply). That is an outage of the
  store for the processes that keep jobs moving (they wait, see `offload.connection.is_oom`), a clean refusal for a
  producer (`StoreFull`), and what the `offload_store_memory_*` gauges and the `store_memory` alert warn of.

On a cluster every primary is read; the store is as full as its fullest primary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster

from offload.connection import is_outage
from offload.env import env_float
from offload.errors import StoreFull, UnsafeEvictionPolicy
from offload.redis_client import RedisClient

log = logging.getLogger("offload.store")
SAFE_POLICY = "noeviction"
CHECK_EVERY_S = 5.0  # how often a long-running process re-reads the policy (OFFLOAD_STORE_CHECK_S)
LOUD_EVERY_S = 60.0  # while the policy is wrong, the error line again this often
HOW_TO_SET = (
    "set it with `CONFIG SET maxmemory-policy noeviction` and in redis.conf/valkey.conf, or in the managed "
    "service's parameter group or settings (docs/how-to/memory.md)"
)


@dataclass(frozen=True)
class NodeMemory:
    """One server's `INFO memory`: `node` is its address on a cluster, '' for a single server."""

    node: str
    used: int
    maxmemory: int
    not_counted: int  # replication and AOF buffers: the server leaves them out of its maxmemory check
    policy: str | None  # None: the server does not say (INFO without maxmemory_policy)

    @property
    def counted(self) -> int:
        """The memory the server holds against maxmemory."""
        return max(self.used - self.not_counted, 0)

    @property
    def ratio(self) -> float | None:
        """counted / maxmemory; None without a limit."""
        return self.counted / self.maxmemory if self.maxmemory else None

    @property
    def full(self) -> bool:
        """Writes that add data are refused now (OOM)."""
        return bool(self.maxmemory) and self.counted > self.maxmemory


@dataclass(frozen=True)
class StoreMemory:
    nodes: tuple[NodeMemory, ...]

    @property
    def ratio(self) -> float | None:
        """The fullest primary's share of its maxmemory; None when no primary has a limit."""
        ratios = [r for r in (n.ratio for n in self.nodes) if r is not None]
        return max(ratios) if ratios else None

    @property
    def full(self) -> bool:
        return any(n.full for n in self.nodes)

    @property
    def problem(self) -> str | None:
        """The one line an operator needs when a primary may evict, else None."""
        for n in self.nodes:
            if n.policy is not None and n.policy != SAFE_POLICY:
                where = f" on {n.node}" if n.node else ""
                return (
                    f"maxmemory-policy is {n.policy}{where}: offload needs {SAFE_POLICY} (an evicted lease, cap "
                    f"counter, idempotency key or job record is a job paid twice or lost); {HOW_TO_SET}"
                )
        return None


def _node(name: str, info: dict[str, Any]) -> NodeMemory:
    return NodeMemory(
        node=name,
        used=int(info.get("used_memory", 0)),
        maxmemory=int(info.get("maxmemory", 0)),
        not_counted=int(info.get("mem_not_counted_for_evict", 0)),
        policy=str(info["maxmemory_policy"]) if "maxmemory_policy" in info else None,
    )


async def read_memory(redis: RedisClient) -> StoreMemory:
    """`INFO memory` of the server, or of every primary of a cluster."""
    if isinstance(redis, RedisCluster):
        per_node = await redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
        if per_node and all(isinstance(v, dict) for v in per_node.values()):
            return StoreMemory(tuple(_node(str(k), v) for k, v in sorted(per_node.items())))
        return StoreMemory((_node("", per_node),))  # one primary: redis-py answers its dict as it is
    info = await cast(Any, redis).info("memory")
    return StoreMemory((_node("", info),))


async def has_room(redis: RedisClient) -> bool:
    """No primary refuses writes for memory now."""
    return not (await read_memory(redis)).full


async def require_noeviction(redis: RedisClient) -> StoreMemory:
    """At the start of what adds jobs (a producer's first call, a command that enqueues or releases jobs): refuse a
    store that may evict, with the one line. (A worker and the server start paused instead: `PolicyWatch`.)"""
    memory = await read_memory(redis)
    if problem := memory.problem:
        raise UnsafeEvictionPolicy(problem)
    warn_unreported(memory)
    return memory


def warn_unreported(memory: StoreMemory) -> None:
    """A service that hides its policy: said at start, not refused (there is no way to tell)."""
    if any(n.policy is None for n in memory.nodes):
        log.warning(
            "the job store does not report its maxmemory-policy: offload cannot check that it is %s; make "
            "sure the service never evicts (docs/how-to/memory.md)",
            SAFE_POLICY,
        )


def store_full(total: int, enqueued: list[str]) -> StoreFull:
    """The one message for an enqueue the store refused at maxmemory."""
    part = f"{len(enqueued)} of {total} jobs were enqueued, the rest were not" if enqueued else "nothing was enqueued"
    return StoreFull(
        f"the job store is full (Redis/Valkey used memory is over its maxmemory): {part}; retry once memory is "
        "freed (finished jobs' records are trimmed as their retention ends) or maxmemory is raised",
        enqueued,
    )


def check_interval() -> float:
    return float(env_float("OFFLOAD_STORE_CHECK_S", CHECK_EVERY_S, minimum=0.05))


class PolicyWatch:
    """A long-running process's view of the store's eviction policy, re-read every `every_s`. While a primary may
    evict, `safe` is False and the process starts no new paid work (claims, submissions, rentals, enqueues over
    the API) until the policy is noeviction again; work already paid for goes on (polls, checkpoints, acks), as
    stopping it would throw away what was paid. Said loudly: an error line at the change and every minute after,
    and `problem` for the server's alert and gauge. An outage keeps the last verdict."""

    def __init__(self, redis: RedisClient, *, every_s: float | None = None, what: str = "new work") -> None:
        self.redis = redis
        self.every_s = every_s if every_s is not None else check_interval()
        self.what = what
        self.problem: str | None = None
        self.memory: StoreMemory | None = None
        self._safe = asyncio.Event()
        self._safe.set()
        self._said = 0.0
        self._read_at = time.monotonic()  # (made right after the start's check)
        self._reading: asyncio.Future[StoreMemory] | None = None

    @property
    def safe(self) -> bool:
        return self._safe.is_set()

    @property
    def current(self) -> bool:
        """Safe, as read within two intervals: a process frozen longer (SIGSTOP, a starved host) reads again."""
        return self._safe.is_set() and time.monotonic() - self._read_at <= 2 * self.every_s

    async def wait_safe(self) -> None:
        await self._safe.wait()

    async def confirm(self) -> None:
        """Right before new paid work: read again if the last read is old (one read, shared by every caller), then
        wait while the store may evict."""
        if time.monotonic() - self._read_at > 2 * self.every_s:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self.check())
            try:
                await asyncio.shield(self._reading)
            except Exception as exc:  # the store away: the last verdict stands (the write after this waits anyway)
                if not is_outage(exc):
                    raise
        await self._safe.wait()

    async def check(self) -> StoreMemory:
        return self.apply(await read_memory(self.redis))

    def apply(self, memory: StoreMemory) -> StoreMemory:
        """Take a reading of the store's memory (the start's, or `check`'s): pause or resume, said in one line."""
        self._read_at = time.monotonic()
        self.memory = memory
        problem, was = memory.problem, self.problem
        self.problem = problem
        now = time.monotonic()
        if problem is not None and (was is None or now - self._said >= LOUD_EVERY_S):
            self._said = now
            log.error("%s; no %s starts until it is fixed", problem, self.what)
        if problem is None:
            if was is not None:
                log.warning("maxmemory-policy is %s again: %s resumes", SAFE_POLICY, self.what)
            self._safe.set()
        else:
            self._safe.clear()
        return memory

    async def run(self) -> None:
        """Check every `every_s` until cancelled."""
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.check()
            except Exception as exc:  # the store away: the last verdict stands until it answers
                if not is_outage(exc):
                    log.warning("reading the job store's memory settings failed: %s", type(exc).__name__)
