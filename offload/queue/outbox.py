"""The completion-webhook outbox of each queue, as the store keeps it (lua/includes/outbox.lua writes to it in the
step that ends a job): claims of the webhooks due, the outcome of each try, the dead letter and its requeue, the
queue's own callback flag and its sealed signing secrets. Sending is the server's (offload/server/callbacks.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from offload.clock import ClockMs
from offload.queue import keyspace
from offload.queue.durability import Durability, run_script
from offload.queue.keyspace import prefix, validate_queue
from offload.queue.scripts import SCRIPTS, Script
from offload.redis_client import RedisClient

Outcome = Literal["ok", "retry", "dead"]
CALLBACK_TOTALS = ("delivered", "failed_try", "dead_lettered", "requeued")  # cb:stats' fields


@dataclass(frozen=True, slots=True)
class Claimed:
    """A webhook a sender now owns until its claim ends: the job it is about, the claim's token, tries made."""

    job_id: str
    token: str
    tries: int


@dataclass(frozen=True, slots=True)
class FailedDelivery:
    """A dead-lettered webhook: its job, the tries made, why the last one failed, when (epoch ms), and the job's own
    callback URL (None: the queue's; a URL may carry a token, so it is for the server's eyes only)."""

    job_id: str
    tries: int
    error: str
    failed_at: int
    job_url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "tries": self.tries, "error": self.error, "failed_at": self.failed_at}


@dataclass(frozen=True, slots=True)
class CallbackCounts:
    """A queue's webhooks now (owed: not yet delivered nor dead-lettered; failed: dead-lettered) and its totals
    since it began (`cb:stats`: delivered, failed_try, dead_lettered, requeued)."""

    owed: int
    failed: int
    totals: dict[str, int]


@dataclass(frozen=True, slots=True)
class SealedSecrets:
    """A queue's signing secrets as stored (vault tokens): the current one, and the previous one while its grace
    lasts (`previous_until`, epoch ms)."""

    current: str | None
    previous: str | None
    previous_until: int | None


class Outbox:
    def __init__(
        self, redis: RedisClient, clock_ms: ClockMs | None = None, durability: Durability | None = None
    ) -> None:
        self.redis = redis
        self.clock_ms = clock_ms
        self.durability = durability

    async def _run(self, script: Script, queue: str, *args: Any, durable: bool = False) -> Any:
        """`durable`: an operator's write, acknowledged only once replicated (when `durability` is set)."""
        now = str(self.clock_ms()) if self.clock_ms else ""
        keys, argv = [prefix(validate_queue(queue))], [now, *args]
        return await run_script(script, self.redis, keys, argv, self.durability if durable else None)

    async def claim(self, queue: str, limit: int, claim_ms: int) -> list[Claimed]:
        """Up to `limit` webhooks that are due, each owned by this caller for `claim_ms`."""
        rows = await self._run(SCRIPTS.callback_claim, queue, limit, claim_ms)
        return [Claimed(str(job_id), str(token), int(tries)) for job_id, token, tries in rows]

    async def settle(self, queue: str, claimed: Claimed, outcome: Outcome, *, at_ms: int = 0, error: str = "") -> bool:
        """Record a try's outcome; False when the claim had run out and another sender took the webhook."""
        reply = await self._run(SCRIPTS.callback_done, queue, claimed.job_id, claimed.token, outcome, at_ms, error)
        return str(reply) == "OK"

    async def failed(self, queue: str, limit: int = 100) -> list[FailedDelivery]:
        """The dead-lettered webhooks, newest first."""
        ids = await self.redis.zrevrange(keyspace.callback_failed(validate_queue(queue)), 0, limit - 1)
        if not ids:
            return []
        infos = await self.redis.hmget(keyspace.callback_info(queue), ids)
        pipe = self.redis.pipeline(transaction=False)  # one round trip for up to 1,000 records
        for job_id in ids:
            pipe.hget(keyspace.job(queue, str(job_id)), "callback")
        urls = await pipe.execute()
        out = []
        for job_id, raw, url in zip(ids, infos, urls, strict=True):
            info = orjson.loads(raw) if raw else {}
            tries, error, at = int(info.get("tries", 0)), str(info.get("error", "")), int(info.get("at", 0))
            out.append(FailedDelivery(str(job_id), tries, error, at, str(url) if url else None))
        return out

    async def requeue(self, queue: str, job_ids: Sequence[str] = (), limit: int = 1000) -> list[str]:
        """Dead-lettered webhooks (the given ones, else the oldest `limit`) due again now, with fresh tries. With
        `durability`, acknowledged once the replicas have it: a failover must not dead-letter them again unseen."""
        return [str(j) for j in await self._run(SCRIPTS.callback_requeue, queue, limit, *job_ids, durable=True)]

    async def failed_count(self, queue: str) -> int:
        return int(await self.redis.zcard(keyspace.callback_failed(validate_queue(queue))))

    async def owed(self, queue: str) -> int:
        """Webhooks not yet delivered nor dead-lettered."""
        return int(await self.redis.zcard(keyspace.callback_due(validate_queue(queue))))

    async def counts(self, queue: str) -> CallbackCounts:
        """Owed and dead-lettered now, and the totals the scripts keep (one read each: /metrics)."""
        validate_queue(queue)
        owed, failed, raw = await asyncio.gather(
            self.redis.zcard(keyspace.callback_due(queue)),
            self.redis.zcard(keyspace.callback_failed(queue)),
            self.redis.hgetall(keyspace.callback_stats(queue)),
        )
        totals = {name: int(raw.get(name, 0)) for name in CALLBACK_TOTALS}
        return CallbackCounts(int(owed), int(failed), totals)

    async def set_queue_callback(self, queue: str, on: bool) -> None:
        """Whether every job the queue ends owes a webhook (its offload.yaml `callback_url`)."""
        key = keyspace.callback_flag(validate_queue(queue))
        if on:
            await self.redis.set(key, "1")
        else:
            await self.redis.delete(key)

    async def sealed_secrets(self, queue: str) -> SealedSecrets:
        fields = await self.redis.hmget(
            keyspace.callback_secret(validate_queue(queue)), ["current", "previous", "previous_until"]
        )
        current, previous, until = (None if f is None else str(f) for f in fields)
        return SealedSecrets(current, previous, int(until) if until else None)

    async def seal_first(self, queue: str, sealed: str) -> bool:
        """Store the queue's first secret; False when another process stored one first (that one stays)."""
        return bool(await self.redis.hsetnx(keyspace.callback_secret(validate_queue(queue)), "current", sealed))

    async def rotate(self, queue: str, sealed: str, grace_ms: int) -> None:
        """The new secret current; the old one signs too for `grace_ms` more."""
        await self._run(SCRIPTS.callback_rotate, queue, sealed, grace_ms)
