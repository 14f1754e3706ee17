"""The fault harness's operator (the `cancel` fault): cancels a job now and then, straight through Valkey (not the
fault proxy: the operator is not under test, and its answer must be known)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from redis.exceptions import RedisError

from bench.chaos.producer import QUEUE
from offload.errors import InvalidTransition, JobNotFound, StoreError
from offload.eventloop import within
from offload.queue.store import QueueStore


class Operator:
    """Cancels jobs of `QUEUE` through `ops`, reading the queue's sets through `direct`."""

    def __init__(self, ops: QueueStore, direct: Any, rng: random.Random, lease_ms: int) -> None:
        self.ops, self.direct, self.rng, self.lease_ms = ops, direct, rng, lease_ms
        self.resuming: asyncio.Task[None] | None = None  # a resume under way, outliving the loop's cancel

    async def cancel_one(self, timeline: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The operator's cancel: of a job that waits with a remote job that may still run (a killed or stopped
        worker's, handed back) when there is one, else of a running job, now and then of a plain waiting one. Every
        other time a worker was killed or stopped within the last lease, the operator first pauses the queue for a
        moment, so that a job that worker's lease hands back is still waiting when it looks (claims take them within
        milliseconds otherwise). Straight to Valkey, not through the proxy: the operator is not under test, and its
        answer must be known."""
        lease_s = self.lease_ms / 1000
        recent = [e for e in timeline[-20:] if e["kind"] in ("kill", "stop") and time.time() - e["t"] < lease_s]
        try:
            if recent and self.rng.random() < 0.5:
                try:  # (a pause refused, not acknowledged, may still have run: resumed all the same)
                    await self.ops.pause(QUEUE)
                    deadline = time.monotonic() + lease_s + 2
                    while time.monotonic() < deadline:  # a poll of the store: it has nothing to wait on
                        if found := await self._waiting_with_remote():
                            return await self._cancel(self.rng.choice(found), "waiting_with_remote")
                        await asyncio.sleep(0.2)
                finally:
                    # shielded: the fault phase's end cancels this loop, and a resume cut short leaves the queue
                    # paused for the rest of the run (`settle` waits for it)
                    self.resuming = asyncio.ensure_future(self._resume())
                    await asyncio.shield(self.resuming)
            if remote := await self._waiting_with_remote():
                return await self._cancel(self.rng.choice(remote), "waiting_with_remote")
            running = await self.direct.zrange(f"offload:{{{QUEUE}}}:active", 0, 199)
            waiting = await self.direct.zrange(f"offload:{{{QUEUE}}}:ready", 0, 199)
            if running and (self.rng.random() < 0.8 or not waiting):
                return await self._cancel(self.rng.choice(running), "running")
            return await self._cancel(self.rng.choice(waiting), "waiting") if waiting else None
        except (RedisError, OSError, TimeoutError):  # Valkey away (a fault of this run): the operator tries later
            return None

    async def settle(self) -> None:
        """Wait for a resume under way: the run's checks must not find the queue paused by the harness."""
        if self.resuming is not None:
            await self.resuming

    async def _resume(self) -> None:
        """Resume until the store takes it: a resume refused (an outage, a replica cut with `durability`) and given
        up would leave the queue paused for the rest of the run, its jobs stuck for the harness's doing."""
        deadline = time.monotonic() + 120
        while True:
            try:
                await self.ops.resume(QUEUE)
                return
            except (RedisError, OSError, TimeoutError, StoreError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def _waiting_with_remote(self) -> list[str]:
        """Jobs in the ready or retry set with a remote id or a submission of unknown outcome, not yet cancelled."""
        key = f"offload:{{{QUEUE}}}:"
        waiting = [j for s in ("ready", "retry") for j in await self.direct.zrange(key + s, 0, 199)]
        if not waiting:
            return []
        pipe = self.direct.pipeline(transaction=False)
        for job_id in waiting:
            pipe.hmget(key + "job:" + job_id, "remote_id", "sub_open", "cancel")
        flags = await pipe.execute()
        return [j for j, (rid, open_, c) in zip(waiting, flags, strict=True) if (rid or open_ == "1") and not c]

    async def _cancel(self, job_id: str, was: str) -> dict[str, Any] | None:
        try:
            answer = await within(self.ops.cancel(job_id), 10)
        except (InvalidTransition, JobNotFound):  # it finished meanwhile
            return None
        return {"job": job_id, "answer": answer, "was": was}
