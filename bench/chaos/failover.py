"""The `failover` fault: a replica the harness keeps, its replication link cut for a while, then a failover.

The replica follows the primary through a link proxy (a `FaultProxy` without faults of its own): black-holing
it cuts replication for real while both servers run on (the replica neither receives the stream nor acknowledges
it, so every write the primary accepts meanwhile is one a failover loses). The failover does what Sentinel or a
managed Redis does: the replica is promoted (`REPLICAOF NO ONE`), every proxy the clients and the harness reach
Valkey through is pointed at it (their connections reset), and the old primary is SIGKILLed and comes back as
the new primary's replica (a full resync drops what it alone had). The run's workers and producer then have
`durability` on (`ENV`), so nothing they were told is done may be lost.

Each failover is recorded with the time of the last event the promoted replica had of each queue (`kept`) and
the moment the clients were switched (`switched_at`): the events the harness read from the old primary between
the two never happened as far as the new primary knows, and the checker drops them (`bench/chaos/checker.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import redis

from bench.chaos.procs import HOST, Valkey
from bench.chaos.proxy import FaultProxy
from offload.queue.keyspace import events as events_key

log = logging.getLogger("chaos")
TIMEOUT_MS = 500  # how long a durable write waits for the replica before it is refused (and sent again)
ENV = {"OFFLOAD_DURABILITY_REPLICAS": "1", "OFFLOAD_DURABILITY_TIMEOUT_MS": str(TIMEOUT_MS)}
SYNC_S = 60.0


class Failover:
    """The primary and its replica; `fail_over` swaps them. `proxies` follow whichever is the primary."""

    def __init__(self, out: Path, primary: Valkey, proxies: list[FaultProxy], queues: list[str]) -> None:
        self.queues = queues
        self.primary = primary
        # the same steppable clock as the primary's (bench/chaos/faketime.py): a step of the store's clock, and the
        # end of run's step to the next midnight, hold whichever of the two is the primary then
        self.replica = Valkey(out / "valkey-replica", primary.appendfsync, primary.clock)
        self.proxies = proxies
        self.link: FaultProxy | None = None
        self.cut_at: float | None = None
        self.failovers = 0
        # the clients' switch to the promoted replica: how many so far and when the last was (a reply read after it
        # on a connection opened before it came from the old primary: the switch cut every connection)
        self.switches, self.switched_at = 0, 0.0
        # per queue, the last events-stream id the promoted replica had at the last failover: a reader of the
        # streams goes on from there (the new primary's ids may be below what it read from the old one: a step
        # back of the clock holds them at their last value)
        self.kept_ids: dict[str, str] = {}

    async def start(self) -> Failover:
        await asyncio.to_thread(self.replica.start)
        self.link = await FaultProxy((HOST, self.primary.port)).start()
        await self._follow(self.replica)
        return self

    async def _follow(self, node: Valkey) -> None:
        """`node` becomes the replica of the primary, through the link; returns once its first sync is done."""
        assert self.link is not None
        self.link.upstream = (HOST, self.primary.port)
        self.link.reset_all(record=False)
        with node.client() as c:  # (a full sync starts at once: every Valkey of the run starts so, see procs.py)
            c.execute_command("REPLICAOF", HOST, self.link.port)
        deadline = time.monotonic() + SYNC_S
        while await asyncio.to_thread(_link_status, node) != "up":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica on port {node.port} did not sync within {SYNC_S:g}s")
            await asyncio.sleep(0.1)

    def cut(self) -> None:
        assert self.link is not None
        self.link.blackhole(3600)
        self.cut_at = time.time()

    def heal(self) -> None:
        """The link works again (a cut that ended without a failover): the replica catches up."""
        if self.link is not None and self.link.blackholed:
            self.link.blackhole(0)
        self.cut_at = None

    async def fail_over(self) -> dict[str, Any]:
        """Promote the replica, point every proxy at it, crash the old primary and make it the new replica.
        Returns what the checker needs: when the cut began and the clients were switched, and per queue the
        time (ms) of the last event the new primary has."""
        old, new = self.primary, self.replica
        with redis.Redis(host=HOST, port=new.port, socket_timeout=5, decode_responses=True) as c:
            c.execute_command("REPLICAOF", "NO", "ONE")
            last = {q: _last_event_id(c, q) for q in self.queues}
        kept = {q: int(entry.split("-")[0]) for q, entry in last.items()}
        self.kept_ids = last
        for proxy in self.proxies:
            proxy.upstream = (HOST, new.port)
            proxy.reset_all()
        self.switched_at, self.switches = time.time(), self.switches + 1
        done = {"cut_at": self.cut_at or time.time(), "switched_at": self.switched_at, "kept": kept}
        await asyncio.to_thread(old.crash)
        self.primary, self.replica = new, old
        self.cut_at = None
        assert self.link is not None
        self.link.blackhole(0)
        await asyncio.to_thread(old.start)  # its AOF has writes the new primary lacks: the resync drops them
        await self._follow(old)
        self.failovers += 1
        return done

    async def close(self) -> None:
        """Close the proxies the failover made or followed (the run's own is closed twice: harmless)."""
        for proxy in [*self.proxies, self.link]:
            if proxy is not None:
                await proxy.close()
        for node in (self.replica, self.primary):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(node.stop)


def _last_event_id(client: redis.Redis, queue: str) -> str:
    last = client.xrevrange(events_key(queue), count=1)
    return str(last[0][0]) if last else "0-0"


def _link_status(node: Valkey) -> str:
    try:
        with node.client() as c:
            info = c.info("replication")
    except (redis.RedisError, OSError):
        return "down"
    return str(info.get("master_link_status", "down"))
