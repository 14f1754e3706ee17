"""The webhook half of the job store: what the server's hook route and a webhook-woken worker read and write.

Split from store.py, which QueueStore's other transitions fill: a verified delivery's script (hook.lua, see its
header for the verdicts), the secret digests begin.lua kept for a submission, the kept final body, and the
current submission's remote id. Each has a `_many` form, one pipelined round trip for a burst of deliveries or
of woken jobs, because a burst of single calls through the pool cost more than the scripts and reads did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from offload.queue import keyspace
from offload.queue.base_store import BaseStore
from offload.queue.durability import mark, run_script, settle
from offload.queue.keyspace import prefix, queue_of
from offload.queue.scripts import SCRIPTS


@dataclass(frozen=True, slots=True)
class HookItem:
    """One verified webhook for hook.lua: submission `submission` of a job, its remote id ('' unknown)."""

    job_id: str
    submission: int
    remote_id: str
    terminal: bool
    body: bytes

    @property
    def flag(self) -> str:
        return "1" if self.terminal else "0"


class HookStore(BaseStore):
    """QueueStore's webhook calls."""

    async def hook(self, job_id: str, submission: int, remote_id: str, *, terminal: bool, body: bytes) -> str:
        """A verified provider webhook for submission `submission` of a job (see hook.lua for the verdicts)."""
        return (await self.hook_many([HookItem(job_id, submission, remote_id, terminal, body)]))[0]

    async def hook_many(self, items: Sequence[HookItem]) -> list[str]:
        """`hook` for many verified webhooks (of any queues) in one pipelined round trip, each its own atomic
        script run: a burst of deliveries, each a script call through the pool, cost the server more than the
        scripts did. A script that Redis did not know (NOSCRIPT: it did not run) is sent again by its source.
        With `durability`, the batch is answered only once replicated (one WAIT after it)."""
        keyset = [[prefix(queue_of(i.job_id))] for i in items]
        args: list[list[Any]] = [[self._now(), i.job_id, i.submission, i.remote_id, i.flag, i.body] for i in items]
        script = SCRIPTS.hook
        results: list[Any]
        durability = self.durability

        async def one(k: list[str], a: list[Any]) -> Any:
            return await run_script(script, self.redis, k, a, durability)

        if isinstance(self.redis, RedisCluster):  # cluster pipelines refuse EVALSHA
            results = list(await asyncio.gather(*(one(k, a) for k, a in zip(keyset, args, strict=True))))
        else:
            pipe = self.redis.pipeline(transaction=False)
            for k, a in zip(keyset, args, strict=True):
                pipe.evalsha(script.sha, 1, *k, *a)
            if durability is not None and keyset:  # one WAIT after the batch, on the pipeline's one connection
                mark(pipe, keyset[0][0], durability)
            results = await pipe.execute(raise_on_error=False)
            confirmation, results = results[len(keyset) :], results[: len(keyset)]
            for n, r in enumerate(results):
                if isinstance(r, NoScriptError):  # it did not run: safe to run now
                    results[n] = await one(keyset[n], args[n])
            if durability is not None and keyset:
                await settle(self.redis, keyset[0][0], confirmation, durability)
        for r in results:
            if isinstance(r, Exception):
                raise r
        return [str(r) for r in results]

    async def hook_digests(self, job_id: str, submission: int) -> list[str]:
        """The webhook secret hashes begin.lua kept for this submission (none: no webhook was asked for)."""
        return (await self.hook_digests_many([(job_id, submission)]))[0]

    async def hook_digests_many(self, items: Sequence[tuple[str, int]]) -> list[list[str]]:
        """`hook_digests` for many (job id, submission) in one pipelined round trip (the server's burst path)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, submission in items:
            pipe.hget(keyspace.job(queue_of(job_id), job_id), f"hook:{submission}")
        return [str(raw).split() if raw else [] for raw in await pipe.execute()]

    async def hook_body(self, job_id: str, submission: int) -> str | None:
        """The final webhook body of this submission, once one arrived."""
        return (await self.hook_bodies([(job_id, submission)]))[0]

    async def hook_bodies(self, items: Sequence[tuple[str, int]]) -> list[str | None]:
        """`hook_body` for many (job id, submission) in one pipelined round trip: a burst of webhooks wakes
        hundreds of jobs at once, and one HMGET each through the shared pool cost more than the reads."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, _ in items:
            pipe.hmget(keyspace.job(queue_of(job_id), job_id), ["hook_n", "hook_body"])
        replies = await pipe.execute()
        return [
            str(body) if body is not None and n == str(submission) else None
            for (_, submission), (n, body) in zip(items, replies, strict=True)
        ]

    async def current_remote(self, job_id: str) -> tuple[str | None, int]:
        """(remote id of the current submission or None, the current submission number)."""
        rid, rn, sn = await self.redis.hmget(keyspace.job(queue_of(job_id), job_id), ["remote_id", "remote_n", "sub_n"])
        n = int(sn or 0)
        return (str(rid) if rid and rn == sn else None), n
