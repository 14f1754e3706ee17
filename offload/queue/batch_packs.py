"""Which pack a job went out in to a provider batch API, kept in the store before the batch is created.

A worker killed inside a batch create (or whose answer was lost) leaves jobs with an open intent and no remote id.
Their pack record says which pack they were in and when it was created, so the next owner looks for that pack's
batch in the provider's listing (adopted) before any resubmit (offload.worker.packing). A job without a pack record
never reached a create: nothing to adopt.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson

from offload.queue.batching import Batcher
from offload.queue.keyspace import job, packs
from offload.redis_client import RedisClient


@dataclass(frozen=True, slots=True)
class PackRecord:
    """A pack as its jobs' records say: its id (the batch's tag), the backend, how many jobs it held, and when
    its create was sent (epoch seconds, this host's clock: a listing's window is widened by the skew allowance)."""

    pack: str
    backend: str
    count: int
    at: float
    line: int = 0  # this job's line in the pack (its remote id is `<batch id>#<line>`)


class PackRecords:
    """The pack records of one queue's jobs, and the job fields the packer reads (a deadline, a cancel): each
    coalesced into one pipelined call for a burst of jobs, as thousands of them join packs and end together."""

    def __init__(self, redis: RedisClient, queue: str) -> None:
        self.redis, self.key, self.queue = redis, packs(queue), queue
        self._reads: Batcher[tuple[str, str], str | None] = Batcher(self._hgets)
        self._forgets: Batcher[str, None] = Batcher(self._hdel)

    def job_field(self, job_id: str, name: str) -> asyncio.Future[str | None]:
        """One field of a job's record (None: unset)."""
        return self._reads((job_id, name))

    async def _hgets(self, items: list[tuple[str, str]]) -> list[str | None]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id, name in items:
            pipe.hget(job(self.queue, job_id), name)
        replies: list[str | None] = await pipe.execute()
        return replies

    async def _hdel(self, job_ids: list[str]) -> list[None]:
        await self.redis.hdel(self.key, *job_ids)
        return [None] * len(job_ids)

    async def record(self, job_ids: list[str], rec: PackRecord) -> None:
        """Before the create: each job's pack, and its line in the pack (its index)."""
        base = {"pack": rec.pack, "backend": rec.backend, "count": rec.count, "at": rec.at}
        mapping = {job_id: orjson.dumps({**base, "line": i}).decode() for i, job_id in enumerate(job_ids)}
        await self.redis.hset(self.key, mapping=mapping)

    async def lookup(self, job_id: str) -> PackRecord | None:
        raw = await self.redis.hget(self.key, job_id)
        if raw is None:
            return None
        d = orjson.loads(raw)
        return PackRecord(str(d["pack"]), str(d["backend"]), int(d["count"]), float(d["at"]), int(d.get("line", 0)))

    def forget(self, job_id: str) -> asyncio.Future[None]:
        """A job's line has ended: its record is no longer needed."""
        return self._forgets(job_id)
