"""What every part of QueueStore shares: the client, the clock, durability and the one way to run a script.

QueueStore (store.py) is put together from one class per concern (enqueue_store.py, admin_store.py,
read_store.py, hook_store.py); each builds on this one, and QueueStore's `__init__` sets the attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from offload.clock import ClockMs
from offload.queue.durability import Durability, confirm, run_script
from offload.queue.keyspace import prefix
from offload.queue.scripts import Script
from offload.redis_client import RedisClient

DEFAULT_LEASE_MS = 10_000
MAX_SILENCE_MS = 5_000


def silence_ms(lease_ms: int) -> int:
    """How long a queue may hear from no worker before that counts as an outage rather than as workers
    that died (see `stamp` in outages.lua): half a lease, so an outage is noticed before anyone's lease could
    have run out unheard, and never more than 5 s. Live workers speak every third of a lease (heartbeat) or
    more often (claims, the server's maintenance), so a silence that long does not happen without one."""
    return min(lease_ms // 2, MAX_SILENCE_MS)


class BaseStore:
    """The state QueueStore's parts share (set by QueueStore.__init__) and how they run a script."""

    redis: RedisClient
    clock_ms: ClockMs | None
    durability: Durability | None
    excuse_outages: bool
    max_payload: int
    lease_ms: int
    _known_queues: set[str]

    def _now(self) -> str:
        """The clock argument every script takes ('' = the server's TIME)."""
        return str(self.clock_ms()) if self.clock_ms else ""

    def _silence(self, lease_ms: int) -> int | str:
        return silence_ms(lease_ms) if self.excuse_outages else ""

    async def _confirm(self, queue: str) -> None:
        """With `durability`: raise NotReplicated unless the replicas have the writes made so far (plain commands
        someone acts on, outside a script)."""
        if self.durability is not None:
            await confirm(self.redis, prefix(queue), self.durability)

    async def _run(
        self, script: Script, queue: str, *args: Any, extra_keys: Sequence[str] = (), durable: bool = False
    ) -> Any:
        """`durable`: a write someone acts on, acknowledged only once replicated (when `durability` is set)."""
        keyset, argv = [prefix(queue), *extra_keys], [self._now(), *args]
        return await run_script(script, self.redis, keyset, argv, self.durability if durable else None)
