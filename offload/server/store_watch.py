"""The server's watch over the job store's memory and eviction policy (see offload/queue/memory.py).

At the server's start (app.py: the server starts paused on such a store, it does not refuse) and every
`OFFLOAD_STORE_CHECK_S` (5 s) it reads `INFO memory`: a policy other than noeviction stops the server's
part of new work (enqueues over the API and GPU workers' claims answer 503 naming the setting; the autoscaler
rents nothing, autoscale/rent.py) and raises the `eviction_policy` alert; used memory past the `alerts.
store_memory` share of maxmemory (default 0.9) raises `store_memory` (subject `high`), and a store refusing writes
(full, or an OOM reply any of this server's calls met since the last pass) raises it with subject `full`. Alerts
go out once per cooldown across all servers (alert_once.lua, which runs at the limit too). The gauges are read at
each scrape (metrics.py).
"""

from __future__ import annotations

import asyncio
import logging

from offload.autoscale.alert_settings import alert_settings
from offload.autoscale.alerts import Alerter
from offload.config import Settings
from offload.connection import is_outage
from offload.errors import UnsafeEvictionPolicy
from offload.queue.memory import PolicyWatch, StoreMemory
from offload.redis_client import RedisClient

log = logging.getLogger("offload.server")


class StoreWatch:
    def __init__(self, redis: RedisClient, settings: Settings, *, every_s: float | None = None) -> None:
        self.policy = PolicyWatch(redis, every_s=every_s, what="enqueue, GPU-worker claim or rental")
        self.alerter = Alerter(alert_settings(settings.alerts), redis)
        self.threshold = self.alerter.settings.store_memory
        self._oom_seen = False

    @property
    def safe(self) -> bool:
        return self.policy.safe

    def require_safe(self) -> None:
        """Raise (a 503 naming the setting, server/errors.py) while the store may evict."""
        if not self.policy.safe:
            raise UnsafeEvictionPolicy(self.policy.problem or "maxmemory-policy is not noeviction")

    def oom_seen(self) -> None:
        """One of this server's store calls was refused for memory: the next pass alerts even if INFO then
        shows room again (a store oscillating at its limit)."""
        self._oom_seen = True

    async def check(self) -> None:
        """One pass: read, gate, alert."""
        memory = await self.policy.check()
        if self.policy.problem:
            await self.alerter.alert("eviction_policy", "store", self.policy.problem)
        await self._memory_alerts(memory)

    async def _memory_alerts(self, memory: StoreMemory) -> None:
        ratio, seen = memory.ratio, self._oom_seen
        self._oom_seen = False
        if memory.full or seen:
            used = f"{ratio:.0%} of maxmemory" if ratio is not None else "at its limit"
            await self.alerter.alert(
                "store_memory",
                "full",
                f"the job store is full ({used}): enqueues are refused and workers claim and submit nothing until "
                "memory is freed or maxmemory raised; jobs already paid for finish",
                ratio=ratio,
            )
        elif ratio is not None and self.threshold is not None and ratio >= self.threshold:
            await self.alerter.alert(
                "store_memory",
                "high",
                f"the job store uses {ratio:.0%} of its maxmemory (alert at {self.threshold:.0%}): at 100% enqueues "
                "are refused and workers stop claiming",
                ratio=ratio,
            )

    async def run(self) -> None:
        """`check` every interval until cancelled; the store away keeps the last verdict."""
        while True:
            try:
                await self.check()
            except Exception as exc:  # (a Redis error's text may carry a URL: the type only)
                if not is_outage(exc):
                    log.warning("store watch: %s", type(exc).__name__)
            await asyncio.sleep(self.policy.every_s)

    async def aclose(self) -> None:
        await self.alerter.aclose()
