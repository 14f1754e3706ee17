"""The producing half of the job store: a batch of job specs checked, encoded and enqueued (enqueue.lua), and
the tutorial's plain list moved into a queue (ingest.lua).

Bulk enqueue sends chunks of ENQUEUE_CHUNK jobs, every chunk in one pipelined round trip, each chunk with a
nonce so a resent chunk is recognised instead of enqueued twice.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from offload.connection import is_oom
from offload.errors import ConfigError, InvalidJob
from offload.files import reference_keys
from offload.models import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETENTION_S, Enqueued
from offload.queue import replies
from offload.queue.base_store import BaseStore
from offload.queue.durability import confirm, mark, settle
from offload.queue.keyspace import QUEUES_KEY, new_job_id, prefix, queue_of, validate_queue
from offload.queue.memory import store_full
from offload.queue.scripts import SCRIPTS
from offload.queue.specs import JobSpec, check_options, encode_input, validate_spec
from offload.tracing import enqueue_spans

ENQUEUE_CHUNK = 500


def new_nonce() -> str:
    """A random request id: a repeat of the same call is recognised by it (enqueue.lua, claim.lua)."""
    return os.urandom(8).hex()


class EnqueueStore(BaseStore):
    """QueueStore's producing calls."""

    def validate(self, spec: JobSpec) -> None:
        """Raise the error enqueue would raise for this spec, without enqueuing (for up-front checks)."""
        validate_spec(spec, self.max_payload)

    def _payload(self, spec: JobSpec) -> bytes:
        return encode_input(spec, self.max_payload)

    def _job_args(
        self,
        queue: str,
        spec: JobSpec,
        metas: dict[tuple[Any, ...], int],
        meta_list: list[str],
        traceparent: str | None = None,
    ) -> tuple[Any, ...]:
        """Validate one spec and encode it as (id, input JSON, meta index[, its file keys as JSON or false[, its
        enqueue span's traceparent]]); equal options share one meta. The file keys, found by a byte search, let
        every read skip walking the input."""
        payload = self._payload(spec)
        job_id = spec.job_id or new_job_id(queue)
        if spec.job_id is not None and queue_of(job_id) != queue:
            raise InvalidJob(f"job id {job_id!r} does not belong to queue {queue!r}")
        options = (
            spec.priority,
            spec.delay,
            spec.run_at,
            spec.max_attempts,
            spec.retention,
            spec.idempotency_key,
            spec.output_key,
            spec.deadline,
            spec.deadline_in,
            spec.max_cost,
            spec.callback_url,
        )
        index = metas.get(options)
        if index is None:
            meta_list.append(self._meta(spec))
            index = metas[options] = len(meta_list)  # Lua lists count from 1
        files = reference_keys(payload)
        keys = orjson.dumps(files).decode() if files else False
        if traceparent is not None:
            return job_id, payload.decode(), index, keys, traceparent
        return (job_id, payload.decode(), index, keys) if keys else (job_id, payload.decode(), index)

    def _meta(self, spec: JobSpec) -> str:
        check_options(spec)
        run_at = ""
        if spec.delay:  # from the store's now (enqueue.lua), never this process's clock
            run_at = f"+{int(spec.delay * 1000)}"
        elif spec.run_at is not None:
            run_at = str(int(spec.run_at * 1000))
        deadline = ""
        if spec.deadline_in is not None:  # from the store's now, like a delay
            deadline = f"+{int(spec.deadline_in * 1000)}"
        elif spec.deadline is not None:
            deadline = str(int(spec.deadline * 1000))
        meta = "\t".join(
            (
                str(spec.priority),
                run_at,
                str(spec.max_attempts),
                str(spec.retention),
                spec.idempotency_key or "",
                spec.output_key or "",
                deadline,
                "" if spec.max_cost is None else repr(float(spec.max_cost)),
            )
        )
        return meta if spec.callback_url is None else f"{meta}\t{spec.callback_url}"

    async def enqueue_many(self, queue: str, specs: Sequence[JobSpec]) -> list[str]:
        """Enqueue in chunks of 500 jobs per script call, all chunks in one pipelined round trip. A store at its
        maxmemory refuses with `StoreFull` (each chunk's script is refused before it writes anything)."""
        return [done.id for done in await self.enqueue_results(queue, specs)]

    async def enqueue_results(self, queue: str, specs: Sequence[JobSpec]) -> list[Enqueued]:
        """`enqueue_many`, telling per job whether an idempotency key answered with a trimmed record."""
        try:
            return await self._enqueue_results(queue, specs)
        except RedisError as exc:
            if is_oom(exc):
                raise store_full(len(specs), []) from None
            raise

    async def _enqueue_results(self, queue: str, specs: Sequence[JobSpec]) -> list[Enqueued]:
        validate_queue(queue)
        with enqueue_spans(queue, len(specs)) as traced:  # (tracing off: None, and nothing of it is imported)
            parents = traced.traceparents if traced is not None else [None] * len(specs)
            metas: dict[tuple[Any, ...], int] = {}
            meta_list: list[str] = []
            jobs = [self._job_args(queue, s, metas, meta_list, tp) for s, tp in zip(specs, parents, strict=True)]
            check_ids = any(spec.job_id is not None for spec in specs)
            done = await self._send_jobs(queue, jobs, meta_list, check_ids)
            if traced is not None:
                traced.done([job[0] for job in jobs], [d.id for d in done])
        return done

    async def _send_jobs(
        self, queue: str, jobs: list[tuple[Any, ...]], meta_list: list[str], check_ids: bool
    ) -> list[Enqueued]:
        """The encoded jobs sent in chunks (enqueue.lua), with the durability wait when one is configured."""
        chunks = [jobs[i : i + ENQUEUE_CHUNK] for i in range(0, len(jobs), ENQUEUE_CHUNK)]
        metas_arg = orjson.dumps(meta_list)
        nonces = [new_nonce() for _ in chunks]  # one per chunk: a resent chunk is recognised (enqueue.lua)
        if queue not in self._known_queues:
            await self.redis.sadd(QUEUES_KEY, queue)
            self._known_queues.add(queue)
        keyset = [prefix(queue)]
        now = self._now()
        script = SCRIPTS.enqueue
        durability = self.durability
        results: list[Any]
        if isinstance(self.redis, RedisCluster):  # cluster pipelines refuse EVALSHA: run chunks concurrently
            results = list(
                await asyncio.gather(
                    *(
                        script(self.redis, keyset, [now, int(check_ids), metas_arg, orjson.dumps(c), nonce])
                        for c, nonce in zip(chunks, nonces, strict=True)
                    ),
                    return_exceptions=True,
                )
            )
            confirmation = None
        else:
            for attempt in range(2):
                pipe = self.redis.pipeline(transaction=False)
                for chunk, nonce in zip(chunks, nonces, strict=True):
                    pipe.evalsha(script.sha, 1, *keyset, now, int(check_ids), metas_arg, orjson.dumps(chunk), nonce)
                if durability is not None:  # one WAIT after every chunk, on the pipeline's one connection
                    mark(pipe, keyset[0], durability)
                results = await pipe.execute(raise_on_error=False)
                if attempt == 0 and any(isinstance(r, NoScriptError) for r in results):
                    await script.load(self.redis)
                    continue  # re-running is safe: chunks that ran are recognised by their nonce
                break
            confirmation = results[len(chunks) :]
            results = results[: len(chunks)]
        done: list[Enqueued] = []
        for r in results:
            if isinstance(r, BaseException):
                raise store_full(len(jobs), [d.id for d in done]) if is_oom(r) else r
            done.extend(replies.enqueued(r))
        if durability is not None:
            if confirmation is None:
                await confirm(self.redis, keyset[0], durability)
            else:
                await settle(self.redis, keyset[0], confirmation, durability)
        return done

    async def enqueue(self, queue: str, spec: JobSpec) -> str:
        return (await self.enqueue_many(queue, [spec]))[0]

    async def ingest(
        self,
        list_key: str,
        queue: str,
        *,
        limit: int = 1000,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retention: int = DEFAULT_RETENTION_S,
    ) -> tuple[int, int]:
        """Move tutorial-format jobs from a plain list into the durable queue. Returns (ingested, dead)."""
        validate_queue(queue)
        if queue not in self._known_queues:
            await self.redis.sadd(QUEUES_KEY, queue)
            self._known_queues.add(queue)
        try:
            ok, bad = await self._run(
                SCRIPTS.ingest, queue, limit, max_attempts, retention, queue, extra_keys=[list_key]
            )
        except (RedisClusterException, ResponseError) as exc:
            if "slot" not in str(exc).lower():
                raise
            raise ConfigError(
                f"on a cluster the list {list_key!r} must share queue {queue!r}'s hash slot: "
                f"name it like '{{{queue}}}:jobs'"
            ) from None
        return int(ok), int(bad)
