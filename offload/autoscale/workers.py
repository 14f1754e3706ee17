"""A read-only adapter over the server's registry of GPU workers (see offload/server/registry.py), plus the
queue's event stream, answering what the scaler needs per worker: which instance it runs on, whether it is
protected, how much it has in flight, when it last heart-beat and when it last touched a task.

The registry is owned by the server; reading its hashes here (rather than importing the server package) keeps
the autoscaler usable from the CLI and tests without FastAPI, and the format is small: a hash
`offload:rworker:<id>` per worker (queues, instance_id, protected, in_flight, last_heartbeat ms, ...) indexed
by the sorted set `offload:rworkers`. A record vanishes when heartbeats stop; the scaler then relies on the
time it last saw the worker.

"Touched a task" comes from the queue's event stream: every claim and every finish names its jobs, and a job
record keeps its lease token `<worker id>/<n>`, so the workers that started or finished anything since the
last look are known exactly, not sampled at the poll interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from offload.queue.keyspace import GPU_WORKER_ID_PREFIX, GPU_WORKERS, events, gpu_worker, job, workers
from offload.redis_client import RedisClient

TOUCH_STATES = {"active", "succeeded", "retrying", "dead", "cancelled", "queued", "held"}
MAX_EVENTS = 5000


@dataclass
class WorkerInfo:
    id: str
    queues: list[str]
    instance_id: str | None
    protected: bool
    in_flight: int
    last_heartbeat: float  # epoch seconds
    registered_at: float = 0.0
    draining: bool = False  # the autoscaler is retiring its machine: the server hands it no new jobs
    extra: dict[str, str] = field(default_factory=dict)


class WorkerSource(Protocol):
    async def workers(self) -> list[WorkerInfo]: ...

    async def touched(self, queue: str) -> set[str]: ...

    async def set_draining(self, worker_id: str, on: bool = True) -> None: ...

    async def dispatch_workers(self, queue: str, now: float, registered: set[str]) -> int: ...


class RedisWorkers:
    """Reads the registry and the queue events from Redis."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        self._last: dict[str, str] = {}

    async def workers(self) -> list[WorkerInfo]:
        ids = await self.redis.zrange(GPU_WORKERS, 0, -1)
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(gpu_worker(worker_id))
        out = []
        for worker_id, h in zip(ids, await pipe.execute(), strict=True):
            if not h:
                continue
            out.append(
                WorkerInfo(
                    id=worker_id,
                    queues=[q for q in h.get("queues", "").split(",") if q],
                    instance_id=h.get("instance_id") or None,
                    protected=h.get("protected") in ("1", "true", "True"),
                    in_flight=int(h.get("in_flight") or 0),
                    last_heartbeat=int(h.get("last_heartbeat") or 0) / 1000,
                    registered_at=int(h.get("registered_at") or 0) / 1000,
                    draining=h.get("draining") == "1",
                    extra=h,
                )
            )
        return out

    async def touched(self, queue: str) -> set[str]:
        """Workers that claimed or finished a job of `queue` since the previous call (the first call looks
        back one minute). Newest events first, so a flood cannot hide the latest activity."""
        key = events(queue)
        if (last := self._last.get(queue)) is None:  # stream ids are the store's ms, not this host's
            seconds, _ = await self.redis.time()
            last = f"{(int(seconds) - 60) * 1000}-0"
        entries = await self.redis.xrevrange(key, max="+", min="(" + last, count=MAX_EVENTS)
        if not entries:
            return set()
        self._last[queue] = entries[0][0]
        jobs = {j for _, f in entries if f.get("state") in TOUCH_STATES for j in f.get("jobs", "").split()}
        if not jobs:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        ordered = sorted(jobs)
        for job_id in ordered:
            pipe.hmget(job(queue, job_id), "owner", "token")
        found: set[str] = set()
        for owner, token in await pipe.execute():
            if owner:
                found.add(owner)
            elif token and "/" in token:
                found.add(token.rsplit("/", 1)[0])
        return found

    async def set_draining(self, worker_id: str, on: bool = True) -> None:
        """Mark the worker's registry record draining (the server then hands it no new jobs), or clear the mark
        when a drain is cancelled because load came back."""
        if not await self.redis.exists(gpu_worker(worker_id)):
            return
        if on:
            await self.redis.hset(gpu_worker(worker_id), "draining", 1)
        else:
            await self.redis.hdel(gpu_worker(worker_id), "draining")

    async def dispatch_workers(self, queue: str, now: float, registered: set[str]) -> int:
        """Workers alive in the job store for `queue` (lease deadline ahead) that are not GPU workers: dispatch
        workers, which call a remote API and never drain. A GPU worker whose registry record is gone (it died,
        its lease has not run out yet) is not one."""
        alive = await self.redis.zrangebyscore(workers(queue), int(now * 1000), "+inf")
        return sum(1 for w in alive if w not in registered and not w.startswith(GPU_WORKER_ID_PREFIX))
