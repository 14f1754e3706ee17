"""One autoscaler among several servers: a Redis lock with a TTL and a fencing token.

The lock value is `owner|token|expires_ms`. The token comes from a counter that only grows, so each new
leadership has a larger token than every earlier one. Before every provider call the leader re-reads the lock
and checks its token (`check`); every instance write re-checks it inside the same Lua script. A leader that
stalls past its TTL (a long GC pause, a frozen VM) therefore finds itself fenced out instead of racing its
successor. Expiry is judged by the injectable clock (so simulated-time tests can age a lock) and, as a
backstop for crashed holders, by a real Redis TTL too.
"""

from __future__ import annotations

import socket
import time
import uuid

from offload.autoscale import keyspace
from offload.autoscale.instances import Fenced
from offload.clock import Clock
from offload.queue.scripts import SCRIPTS
from offload.redis_client import RedisClient


class Leader:
    def __init__(
        self, redis: RedisClient, *, ttl: float = 30.0, clock: Clock = time.time, owner: str | None = None
    ) -> None:
        self.redis = redis
        self.ttl = ttl
        self.clock = clock
        self.owner = owner or f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"
        self.token = ""

    async def acquire(self) -> bool:
        """Take or renew the lock; True while this server is the leader (its token in `self.token`)."""
        tok = await SCRIPTS.leader_acquire(
            self.redis,
            [keyspace.LEADER, keyspace.FENCE],
            [self.owner, int(self.clock() * 1000), int(self.ttl * 1000), self.token],
        )
        self.token = str(tok) if tok else ""
        return bool(tok)

    async def check(self) -> None:
        """Raise Fenced unless this server still holds the lock with its token (right before a provider call)."""
        if not self.token:
            raise Fenced("not the autoscaler leader")
        cur = await self.redis.get(keyspace.LEADER)
        if not cur:
            raise Fenced("the autoscaler lock expired")
        owner, tok, exp = cur.split("|")
        if owner != self.owner or tok != self.token or float(exp) / 1000 < self.clock():
            self.token = ""
            raise Fenced("another server holds the autoscaler lock")

    async def release(self) -> None:
        await SCRIPTS.leader_release(self.redis, [keyspace.LEADER], [self.owner])
        self.token = ""

    @staticmethod
    async def current(redis: RedisClient) -> dict[str, str] | None:
        cur = await redis.get(keyspace.LEADER)
        if not cur:
            return None
        owner, tok, exp = cur.split("|")
        return {"owner": owner, "token": tok, "expires_ms": exp}
