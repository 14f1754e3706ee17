"""The reading half of the job store: one job, a page of jobs, a queue's counts, histograms and events. Nothing
here changes a job.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from offload.errors import JobNotFound
from offload.models import Attempt, Job, QueueStats
from offload.queue import attempts, history, keyspace, listing, replies
from offload.queue.base_store import BaseStore
from offload.queue.dead_groups import DeadGroup, dead_groups
from offload.queue.keyspace import QUEUES_KEY, queue_of, validate_queue
from offload.queue.scripts import HIST_BUCKETS_S, SCRIPTS
from offload.queue.search import JobFilter, search

JOB_EVENTS_SCAN = 1_000  # the stream entries a job's page reads for its events (each names up to 100 jobs)


class ReadStore(BaseStore):
    """QueueStore's reads."""

    async def history(
        self, queues: str | Sequence[str], range_name: str = "hour"
    ) -> tuple[int, list[history.HistoryPoint]]:
        """(bucket length s, points) of one queue's history, or of several summed, over `range_name` (hour, day,
        week) up to the current bucket of the store's clock (offload/queue/history.py)."""
        names = [queues] if isinstance(queues, str) else list(queues)
        if self.clock_ms:
            now_s = self.clock_ms() / 1000
        else:
            seconds, _ = await self.redis.time()
            now_s = int(seconds)
        return await history.points(self.redis, names, range_name, now_s)

    async def get(self, job_id: str) -> Job:
        reply = await self._run(SCRIPTS.get, queue_of(job_id), job_id)
        if not reply:
            raise JobNotFound(f"job {job_id} not found")
        flat, deadline = reply
        return Job.from_hash(job_id, replies.pairs(flat), int(float(deadline)) if deadline else None)

    async def attempts(self, job_id: str) -> tuple[list[Attempt], int]:
        """A job's attempts, oldest first (the first and the last ones of a job retried many times), and how many
        it made (offload/queue/attempts.py). JobNotFound when the job's record is gone."""
        return attempts.decode(job_id, await self._run(SCRIPTS.story, queue_of(job_id), job_id))

    async def job_events(self, job_id: str, scan: int = JOB_EVENTS_SCAN) -> list[tuple[str, dict[str, str]]]:
        """The job's entries among the latest `scan` of its queue's capped event stream, oldest first (a job's
        page: its older events have scrolled off a busy queue's stream, its attempts have not)."""
        entries = await self.redis.xrevrange(keyspace.events(queue_of(job_id)), count=scan)
        return [(eid, fields) for eid, fields in reversed(entries) if job_id in fields.get("jobs", "").split()]

    async def list_jobs(
        self, queue: str, state: str | None, *, cursor: int = 0, limit: int = 50
    ) -> tuple[list[Job], int | None]:
        """Jobs in one state (waiting states oldest first, finished ones newest first), or with `state` None in
        every state, newest first (offload/queue/listing.py)."""
        ids, next_cursor = await listing.page_ids(self.redis, queue, state, cursor, limit)
        return await self._records(ids), next_cursor

    async def search(
        self, queue: str, where: JobFilter, cursor: str | None, limit: int
    ) -> tuple[list[Job], str | None]:
        """A page of the jobs `where` keeps, and the cursor to go on from (offload/queue/search.py)."""
        found, next_cursor = await search(self.redis, queue, where, cursor, limit)
        return await self._records([job_id for job_id, _ in found]), next_cursor

    async def dead_groups(self, queue: str) -> tuple[list[DeadGroup], int, bool]:
        """The dead letter grouped by error (offload/queue/dead_groups.py)."""
        return await dead_groups(self.redis, queue)

    async def _records(self, ids: list[str]) -> list[Job]:
        found = await asyncio.gather(*(self.get(job_id) for job_id in ids), return_exceptions=True)
        jobs = [j for j in found if isinstance(j, Job)]  # JobNotFound: expired since the index read
        for problem in found:
            if isinstance(problem, BaseException) and not isinstance(problem, JobNotFound):
                raise problem
        return jobs

    async def stats(self, queue: str) -> QueueStats:
        return replies.queue_stats(queue, await self._run(SCRIPTS.stats, validate_queue(queue)))

    async def histograms(self, queue: str) -> dict[str, tuple[list[int], int, int]]:
        """The latency histograms the scripts keep: name ("wait", "run") -> (count per bucket of
        HIST_BUCKETS_S plus +Inf, not cumulative; total count; sum in ms)."""
        raw = await self.redis.hgetall(keyspace.histograms(validate_queue(queue)))
        out: dict[str, tuple[list[int], int, int]] = {}
        for name in ("wait", "run"):
            buckets = [int(raw.get(f"{name}:{i}", 0)) for i in range(1, len(HIST_BUCKETS_S) + 2)]
            out[name] = (buckets, int(raw.get(f"{name}:count", 0)), int(raw.get(f"{name}:sum", 0)))
        return out

    async def possible_duplicates(self, queue: str) -> dict[str, int]:
        """Per backend: submissions made again whose earlier try had an unknown outcome (begin.lua)."""
        raw = await self.redis.hgetall(keyspace.duplicates(validate_queue(queue)))
        return {backend: int(n) for backend, n in raw.items()}

    async def queues(self) -> list[str]:
        return sorted(await self.redis.smembers(QUEUES_KEY))

    async def events(
        self, queue: str, last_id: str = "$", *, block_ms: int | None = None, count: int = 100
    ) -> list[tuple[str, dict[str, str]]]:
        """State changes after `last_id` from the queue's capped stream (for dashboards and --watch)."""
        key = keyspace.events(validate_queue(queue))
        reply = await self.redis.xread({key: last_id}, count=count, block=block_ms)
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [(eid, fields) for eid, fields in entries]
