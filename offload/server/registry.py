"""The registry of GPU workers: one Redis hash per worker that expires when heartbeats stop.

It is what `GET /v1/workers` lists and what an autoscaler correlates with the machines it rents (through
OFFLOAD_INSTANCE_ID and the protected flag). It is bookkeeping only: leases live in the job store, which
returns a silent worker's jobs through its reaper whether or not this record still exists.
Dispatch workers do not register; `GET /v1/workers` shows them from the store's per-queue liveness sets.
Its times are the job store's (`clock`, synced by the server's maintenance): the autoscaler, on whichever server
leads, judges a heartbeat stamped here against the same clock, and the store's lease deadlines are in it too.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from offload.queue.keyspace import GPU_WORKER_ID_PREFIX, GPU_WORKERS, gpu_worker, owned, workers
from offload.queue.scripts import SCRIPTS
from offload.queue.store import QueueStore
from offload.queue.store_clock import StoreClock
from offload.server.schemas import RegisterRequest, WorkerView


class WorkerRegistry:
    def __init__(self, store: QueueStore, ttl_ms: int) -> None:
        self.store = store
        self.redis = store.redis
        self.ttl_ms = ttl_ms
        self.clock = StoreClock()

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    async def register(self, key_id: str, req: RegisterRequest) -> str:
        host = "".join(c if c.isalnum() or c in "-." else "-" for c in req.host)[:60] or "worker"
        worker_id = f"{GPU_WORKER_ID_PREFIX}{host}-{secrets.token_hex(4)}"
        now = self._now_ms()
        record = {
            "id": worker_id,
            "key_id": key_id,
            "host": req.host,
            "version": req.version,
            "queues": ",".join(req.queues),
            "pid": req.pid or "",
            "concurrency": req.concurrency,
            "instance_id": req.instance_id or "",
            "protected": int(req.protected),
            "gpus": orjson.dumps([g.model_dump(exclude_unset=True) for g in req.gpus]).decode(),
            "registered_at": now,
            "last_heartbeat": now,
            "in_flight": 0,
        }
        await self.redis.hset(gpu_worker(worker_id), mapping=record)
        await self.redis.pexpire(gpu_worker(worker_id), self.ttl_ms)
        await self.redis.zadd(GPU_WORKERS, {worker_id: now})
        return worker_id

    async def get(self, worker_id: str) -> dict[str, str] | None:
        record: dict[str, str] = await self.redis.hgetall(gpu_worker(worker_id))
        return record or None

    async def instance_of(self, worker_id: str) -> str:
        """The instance id the worker registered as ("" for none): fixed at registration, where it is checked."""
        found: str | None = await self.redis.hget(gpu_worker(worker_id), "instance_id")
        return found or ""

    async def touch(self, worker_id: str, in_flight: int, protected: bool | None) -> bool:
        """Stamp a heartbeat; False when the worker is no longer registered (it deregistered while this heartbeat
        was being handled, or its record expired): the record is not brought back."""
        now = self._now_ms()
        fields: dict[str, Any] = {"last_heartbeat": now, "in_flight": in_flight}
        if protected is not None:
            fields["protected"] = int(protected)
        pairs = [v for item in fields.items() for v in item]
        if not await SCRIPTS.worker_touch(self.redis, [gpu_worker(worker_id)], [self.ttl_ms, *pairs]):
            return False
        await self.redis.zadd(GPU_WORKERS, {worker_id: now})  # (a removal racing this is pruned by gpu_workers())
        return True

    async def remove(self, worker_id: str) -> None:
        await self.redis.delete(gpu_worker(worker_id))
        await self.redis.zrem(GPU_WORKERS, worker_id)

    async def prune(self, batch: int = 500) -> int:
        """Drop index entries whose record has expired (its worker stopped heartbeating a TTL ago), so the index
        holds live workers and not every registration ever made. Only entries not heartbeated for a TTL by the
        store's clock (the heartbeats' own) are looked at, and only those whose record is gone are removed: a clock
        off makes the look wider or later, never drops a live worker. Returns how many went."""
        stale = await self.redis.zrangebyscore(GPU_WORKERS, "-inf", self._now_ms() - self.ttl_ms, start=0, num=batch)
        if not stale:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in stale:
            pipe.hget(gpu_worker(worker_id), "last_heartbeat")
        gone = [w for w, seen in zip(stale, await pipe.execute(), strict=True) if seen is None]
        if gone:
            await self.redis.zrem(GPU_WORKERS, *gone)
        return len(gone)

    async def gpu_workers(self) -> list[WorkerView]:
        """Live GPU workers; index entries whose record expired are pruned on the way."""
        ids = await self.redis.zrange(GPU_WORKERS, 0, -1)
        views, gone = [], []
        for worker_id in ids:
            r = await self.get(worker_id)
            if r is None:
                gone.append(worker_id)
                continue
            views.append(
                WorkerView(
                    id=worker_id,
                    kind="remote",
                    host=r.get("host", ""),
                    version=r.get("version", ""),
                    queues=[q for q in r.get("queues", "").split(",") if q],
                    in_flight=int(r.get("in_flight") or 0),
                    last_heartbeat=int(r.get("last_heartbeat") or 0) or None,
                    instance_id=r.get("instance_id") or None,
                    protected=r.get("protected") == "1",
                    gpus=orjson.loads(r.get("gpus") or "[]"),
                    concurrency=int(r.get("concurrency") or 0) or None,
                    registered_at=int(r.get("registered_at") or 0) or None,
                )
            )
        if gone:
            await self.redis.zrem(GPU_WORKERS, *gone)
        return views

    async def dispatch(self, queues: list[str], skip: set[str]) -> list[WorkerView]:
        """Workers the store sees alive (lease deadline in the future) that did not register over HTTP."""
        now = self._now_ms()
        found: dict[str, WorkerView] = {}
        for queue in queues:
            alive = await self.redis.zrangebyscore(workers(queue), now, "+inf", withscores=True)
            for worker_id, deadline in alive:
                if worker_id in skip:
                    continue
                in_flight = int(await self.redis.zcard(owned(queue, worker_id)))
                view = found.get(worker_id)
                if view is None:
                    host = worker_id.split(":", 1)[0] if ":" in worker_id else ""  # host:pid:random
                    # a GPU worker whose registration expired still shows, as what it is
                    gpu = worker_id.startswith(GPU_WORKER_ID_PREFIX) and ":" not in worker_id
                    kind = "remote" if gpu else "dispatch"
                    found[worker_id] = WorkerView(
                        id=worker_id,
                        kind=kind,
                        host=host,
                        queues=[queue],
                        in_flight=in_flight,
                        lease_deadline=int(deadline),
                    )
                else:
                    view.queues.append(queue)
                    view.in_flight += in_flight
        return list(found.values())
