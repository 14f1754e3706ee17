"""The operator's and the maintenance pass's calls on a queue: held and dead jobs back to ready, purge, pause and
resume, and the maintenance step (reap.lua). Each moves a bounded number of jobs per script call, so a backlog
of any size never blocks Redis for long.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload.queue import keyspace, listing
from offload.queue.base_store import BaseStore
from offload.queue.keyspace import QUEUES_KEY, STATE_SETS, validate_queue
from offload.queue.scripts import SCRIPTS
from offload.queue.store_clock import HeldRelease, log_clock_step

RELEASE_CHUNK = 500


class AdminStore(BaseStore):
    """QueueStore's operating and maintenance calls."""

    async def release(self, queue: str, job_ids: Sequence[str] = (), limit: int = 1000) -> list[str]:
        """Held jobs back to ready (all of them up to limit, or the given ids). With `durability`, acknowledged
        once the replicas have it, as every operator's write here: a failover must not hold them again, bring
        dead or purged jobs back, unnoticed by the operator who was told it was done."""
        return list(await self._run(SCRIPTS.move, validate_queue(queue), "held", limit, *job_ids, durable=True))

    async def release_held(
        self, queue: str, *, chunk: int = RELEASE_CHUNK, max_chunks: int | None = None
    ) -> HeldRelease:
        """Release the jobs held in a cap window earlier than the store's current one (its UTC day), `chunk` at
        a time until none is due (or `max_chunks` were moved), so a backlog of any size never blocks Redis for
        long. The reply says how many went back, which window the store is in and when its next one begins."""
        total, chunks = 0, 0
        while True:
            n, window, left_ms = await self._run(SCRIPTS.release_window, validate_queue(queue), chunk)
            total, chunks = total + int(n), chunks + 1
            if int(n) < chunk or (max_chunks is not None and chunks >= max_chunks):
                return HeldRelease(total, str(window), int(left_ms) / 1000)

    async def requeue_dead(self, queue: str, job_ids: Sequence[str] = (), limit: int = 1000) -> list[str]:
        """Dead jobs back to ready with a fresh attempt budget."""
        return list(await self._run(SCRIPTS.move, validate_queue(queue), "dead", limit, *job_ids, durable=True))

    async def purge(self, queue: str, state: str) -> int:
        listing.check_purgeable(state)
        total = 0
        while n := int(await self._run(SCRIPTS.purge, validate_queue(queue), STATE_SETS[state], 1000, durable=True)):
            total += n
        return total

    async def purge_ids(self, queue: str, state: str, job_ids: Sequence[str]) -> int:
        """Delete the given jobs of one purgeable state (those no longer in it are kept), 1000 per script call."""
        listing.check_purgeable(state)
        total = 0
        for i in range(0, len(job_ids), 1000):
            chunk = job_ids[i : i + 1000]
            moved = await self._run(
                SCRIPTS.purge, validate_queue(queue), STATE_SETS[state], len(chunk), *chunk, durable=True
            )
            total += int(moved)
        return total

    async def pause(self, queue: str) -> None:
        """Stop claims on a queue (it may not have had jobs yet: it is listed from now on). With `durability`,
        acknowledged once the replicas have it: a failover must not set the queue running again."""
        await self.redis.set(keyspace.paused(validate_queue(queue)), "1")
        await self.redis.sadd(QUEUES_KEY, queue)
        await self._confirm(queue)

    async def resume(self, queue: str) -> None:
        """Let claims take jobs again; idle workers hear of it at once (`keyspace.wake_channel`), not at their next
        poll. With `durability`, acknowledged once the replicas have it: a failover to a replica that lacked it
        would leave the queue paused, its jobs waiting for a resume nobody knows to send again."""
        await self.redis.delete(keyspace.paused(validate_queue(queue)))
        await self._confirm(queue)
        await self.redis.publish(keyspace.wake_channel(queue), "")

    async def reap(self, queue: str, limit: int = 1000) -> tuple[int, int, int]:
        """Maintenance step: (promoted, reaped, trimmed). Safe to run from any number of processes. A step back
        of the store's clock this call found (and moved the queue's times back by: `shift_back` in outages.lua) is
        logged here."""
        promoted, reaped, trimmed, stepped = await self._run(
            SCRIPTS.reap, validate_queue(queue), limit, self._silence(self.lease_ms)
        )
        if int(stepped):
            log_clock_step(queue, int(stepped))
        return int(promoted), int(reaped), int(trimmed)
