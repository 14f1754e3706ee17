"""The job store: one async method per atomic transition, each a single Lua script on the server.

The store knows nothing about HTTP, providers or storage. It takes an already-connected redis-py
asyncio client (standalone or cluster) and an optional clock, so tests can drive time without sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from offload.backoff import retry_delay_ms
from offload.clock import ClockMs
from offload.connection import is_oom
from offload.errors import (
    ConfigError,
    InvalidJob,
    InvalidTransition,
    JobNotFound,
    StaleLease,
)
from offload.files import reference_keys
from offload.models import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_RETENTION_S,
    ClaimedJob,
    Enqueued,
    HeartbeatReply,
    Job,
    QueueStats,
)
from offload.queue import keyspace as keys
from offload.queue import listing, replies
from offload.queue.durability import Durability, NotReplicated, confirm, mark, run_script, settle
from offload.queue.hook_store import HookStore
from offload.queue.keyspace import QUEUES_KEY, STATE_SETS, new_job_id, prefix, queue_of, validate_queue
from offload.queue.memory import store_full
from offload.queue.scripts import HIST_BUCKETS_S, SCRIPTS, Script
from offload.queue.specs import (
    JobSpec,
    check_options,
    encode_input,
    max_payload_limit,
    validate_spec,
)
from offload.queue.store_clock import HeldRelease, log_clock_step
from offload.redis_client import RedisClient

log = logging.getLogger("offload.queue")
DEFAULT_LEASE_MS = 10_000
MAX_SILENCE_MS = 5_000
ENQUEUE_CHUNK = 500
RELEASE_CHUNK = 500
LeaseRef = str | tuple[str, str]  # a job id, or (job id, lease token)


#: (id, token, result location, cost) or, for a run never checkpointed, (..., backend, remote id, submission n).
CompleteItem = tuple[str, str, str, float | None] | tuple[str, str, str, float | None, str, str, int]


def silence_ms(lease_ms: int) -> int:
    """How long a queue may hear from no worker before that counts as an outage rather than as workers
    that died (see `stamp` in common.lua): half a lease, so an outage is noticed before anyone's lease could
    have run out unheard, and never more than 5 s. Live workers speak every third of a lease (heartbeat) or
    more often (claims, the server's maintenance), so a silence that long does not happen without one."""
    return min(lease_ms // 2, MAX_SILENCE_MS)


def _nonce() -> str:
    return os.urandom(8).hex()


def _expect(code: Any, job_id: str) -> None:
    if code == "NOTFOUND":
        raise JobNotFound(f"job {job_id} not found")
    if code == "STALE":
        raise StaleLease(f"job {job_id}: lease token is stale (another worker owns it or it finished)")


class QueueStore(HookStore):
    """Async access to the queues of one Redis/Valkey deployment."""

    def __init__(
        self,
        redis: RedisClient,
        *,
        clock_ms: ClockMs | None = None,
        max_payload: int | None = None,
        lease_ms: int = DEFAULT_LEASE_MS,
        excuse_outages: bool = True,
        durability: Durability | None = None,
    ) -> None:
        """`excuse_outages=False`: a silence of the whole queue is never taken for an outage (for tests that
        move a virtual clock past leases without modelling the calls live workers would make meanwhile).
        `durability`: the writes someone acts on wait for replicas (offload/queue/durability.py)."""
        self.redis = redis
        self.durability = durability
        self.clock_ms = clock_ms
        self.excuse_outages = excuse_outages
        self.max_payload = max_payload_limit(max_payload)
        self.lease_ms = lease_ms
        self._known_queues: set[str] = set()

    def _silence(self, lease_ms: int) -> int | str:
        return silence_ms(lease_ms) if self.excuse_outages else ""

    async def _run(
        self, script: Script, queue: str, *args: Any, extra_keys: Sequence[str] = (), durable: bool = False
    ) -> Any:
        """`durable`: a write someone acts on, acknowledged only once replicated (when `durability` is set)."""
        keyset, argv = [prefix(queue), *extra_keys], [self._now(), *args]
        if durable and self.durability is not None:
            return await run_script(script, self.redis, keyset, argv, self.durability)
        return await script(self.redis, keyset, argv)

    async def check_durability(self, queues: Sequence[str]) -> None:
        """At a process's start: a `durability` the server cannot honour fails now, naming the setting; one
        its replicas do not meet now is only logged (they may be syncing: the writes that need them wait)."""
        if self.durability is None:
            return
        for queue in queues or ["offload"]:
            try:
                await self.probe(queue)
            except NotReplicated as exc:
                shortfall = str(exc).removeprefix("NOREPLICAS ").split(";")[0]
                log.warning("queue %s, at start: %s; the writes that need the replicas wait for them", queue, shortfall)

    async def probe(self, queue: str) -> None:
        """Whether the store answers and, with `durability`, keeps writes safe (the worker's outage probe)."""
        await self.redis.ping()
        if self.durability is not None:
            await confirm(self.redis, prefix(queue), self.durability)

    # -- producing -------------------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Raise the error enqueue would raise for this spec, without enqueuing (for up-front checks)."""
        validate_spec(spec, self.max_payload)

    def _payload(self, spec: JobSpec) -> bytes:
        return encode_input(spec, self.max_payload)

    def _job_args(
        self, queue: str, spec: JobSpec, metas: dict[tuple[Any, ...], int], meta_list: list[str]
    ) -> tuple[str, str, int] | tuple[str, str, int, str]:
        """Validate one spec and encode it as (id, input JSON, meta index[, its file keys as JSON]); equal options
        share one meta. The file keys, found by a byte search, let every read skip walking the input."""
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
        )
        index = metas.get(options)
        if index is None:
            meta_list.append(self._meta(spec))
            index = metas[options] = len(meta_list)  # Lua lists count from 1
        if files := reference_keys(payload):
            return job_id, payload.decode(), index, orjson.dumps(files).decode()
        return job_id, payload.decode(), index

    def _meta(self, spec: JobSpec) -> str:
        check_options(spec)
        run_at = ""
        if spec.delay:  # from the store's now (enqueue.lua), never this process's clock
            run_at = f"+{int(spec.delay * 1000)}"
        elif spec.run_at is not None:
            run_at = str(int(spec.run_at * 1000))
        return "\t".join(
            (
                str(spec.priority),
                run_at,
                str(spec.max_attempts),
                str(spec.retention),
                spec.idempotency_key or "",
                spec.output_key or "",
            )
        )

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
        metas: dict[tuple[Any, ...], int] = {}
        meta_list: list[str] = []
        check_ids = any(spec.job_id is not None for spec in specs)
        chunks = [
            [self._job_args(queue, spec, metas, meta_list) for spec in specs[i : i + ENQUEUE_CHUNK]]
            for i in range(0, len(specs), ENQUEUE_CHUNK)
        ]
        metas_arg = orjson.dumps(meta_list)
        nonces = [_nonce() for _ in chunks]  # one per chunk: a resent chunk is recognised (enqueue.lua)
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
                raise store_full(len(specs), [d.id for d in done]) if is_oom(r) else r
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

    # -- working ---------------------------------------------------------------------------------

    async def claim(
        self,
        queue: str,
        worker_id: str,
        n: int,
        lease_ms: int | None = None,
        *,
        job_cap: int | None = None,
        spend_cap: float | None = None,
        estimate: float = 0.0,
        request_id: str | None = None,
        begin: bool = False,
    ) -> list[ClaimedJob]:
        """Lease up to `n` jobs. With caps, nothing fresh is taken while a cap is reached in the store's cap
        window (its UTC day: only jobs that resume a remote job). `request_id` (default: a new one per call)
        makes a repeat of this very call answer the same jobs. `begin`: also open the submit intent of each fresh
        job (no remote id, no open intent, no cancel, no cap in the window), as `begin_many` would; those come back
        `begun`, the others are begun the usual way."""
        lease = lease_ms or self.lease_ms
        flat = await self._run(
            SCRIPTS.claim,
            queue,
            worker_id,
            n,
            lease,
            request_id or _nonce(),
            "" if job_cap is None else job_cap,
            "" if spend_cap is None else spend_cap,
            repr(float(estimate)),
            self._silence(lease),
            "1" if begin else "",
        )
        return replies.claimed(flat)

    async def heartbeat(
        self,
        queue: str,
        worker_id: str,
        leases: Sequence[LeaseRef] = (),
        lease_ms: int | None = None,
        *,
        since: int | None = None,
        grace_ms: int | None = None,
    ) -> HeartbeatReply:
        """Extend the worker's leases. `leases`: job ids, or (job id, token) pairs (a lease is then lost also
        when the job was claimed again under another token). Jobs the worker owns but does not list are
        handed back when their lease is no newer than `since` (the `seq` of an earlier reply) or older
        than `grace_ms`."""
        lease = lease_ms or self.lease_ms
        args: list[Any] = [
            worker_id,
            lease,
            self._silence(lease),
            "" if since is None else since,
            "" if grace_ms is None else grace_ms,
        ]
        for ref in leases:
            args.extend((ref, "") if isinstance(ref, str) else ref)
        lost, cancels, seq, released, stepped = await self._run(SCRIPTS.heartbeat, queue, *args)
        return HeartbeatReply(
            lost=list(lost),
            cancel_requested=list(cancels),
            seq=int(seq),
            released=int(released),
            stepped_back_ms=int(stepped),
        )

    async def begin_many(
        self,
        queue: str,
        items: Sequence[tuple[str, str, float] | tuple[str, str, float, str]],
        *,
        job_cap: int | None = None,
        spend_cap: float | None = None,
        backend: str = "",
    ) -> list[str]:
        """Right before the provider call, per (id, token, estimated cost): lease and cancel check, cap
        reservation in the store's cap window (held when over) and the submit intent, with the hash of the
        submission's webhook secret when the item carries one (id, token, cost, hash). Per item OK:<n>,
        OK:<n>:DUP (a possible duplicate: an earlier try of that submission has an unknown outcome), CAP:jobs,
        CAP:spend, CANCEL, STALE or NOTFOUND (see begin.lua)."""
        return list(
            await self._run(
                SCRIPTS.begin,
                queue,
                "" if job_cap is None else job_cap,
                "" if spend_cap is None else spend_cap,
                backend,
                orjson.dumps([(i[0], i[1], repr(float(i[2])), i[3] if len(i) > 3 else "") for i in items]),
                durable=True,
            )
        )

    async def overdue(
        self, queue: str, worker_id: str, job_ids: Sequence[str], max_ms: int
    ) -> list[tuple[str, str, int]]:
        """(id, token, attempt) of the worker's leases among `job_ids` that have run longer than `max_ms`."""
        flat = await self._run(SCRIPTS.overdue, queue, worker_id, max_ms, *job_ids)
        return [(flat[i], flat[i + 1], int(flat[i + 2])) for i in range(0, len(flat), 3)]

    async def fence_many(self, queue: str, items: Sequence[tuple[str, str]]) -> list[str]:
        """OK / STALE / NOTFOUND per (id, token): whether each token still holds its lease (changes nothing)."""
        return list(await self._run(SCRIPTS.fence, queue, orjson.dumps(items)))

    async def checkpoint(self, job_id: str, token: str, backend: str, remote_id: str) -> bool:
        """Record the remote job; returns True when a cancel was requested meanwhile."""
        (code,) = await self.checkpoint_many(queue_of(job_id), [(job_id, token, backend, remote_id)])
        _expect(code, job_id)
        return bool(code == "OK:CANCEL")

    async def checkpoint_many(
        self, queue: str, items: Sequence[tuple[str, str, str, str] | tuple[str, str, str, str, int]]
    ) -> list[str]:
        """Record many (id, token, backend, remote id[, submission number]); OK, OK:CANCEL, STALE or NOTFOUND
        per item. The submission's intent is closed."""
        return list(await self._run(SCRIPTS.checkpoint, queue, orjson.dumps(items), durable=True))

    async def complete_many(self, queue: str, items: Sequence[CompleteItem]) -> list[str]:
        """Ack many (id, token, result location, cost[, backend, remote id, submission number]); returns OK /
        STALE / NOTFOUND per item. The remote part records a run that was never checkpointed (a synchronous
        API answers the submit with the result) and closes its submit intent, in the same step as the ack."""
        batch = orjson.dumps(
            [(*item[:3], "" if item[3] is None else repr(float(item[3])), *item[4:]) for item in items]
        )
        return list(await self._run(SCRIPTS.complete, queue, batch, durable=True))

    async def complete(self, job_id: str, token: str, result: str, cost: float | None = None) -> None:
        (code,) = await self.complete_many(queue_of(job_id), [(job_id, token, result, cost)])
        _expect(code, job_id)

    async def fail(
        self,
        job_id: str,
        token: str,
        error: str,
        *,
        retryable: bool = True,
        delay_ms: int | None = None,
        keep_remote: bool = False,
        attempt: int = 1,
        answered: bool = False,
        cost: float | None = None,
        refund: bool = False,
        duplicate: bool = False,
    ) -> str:
        """Returns "retrying" or "dead". `answered`: the provider answered the submit (its intent is closed);
        `cost`: what the failed run cost (settles its reservation); `refund`: the provider refused the
        submission, so it is not counted against the caps; `duplicate`: the run given up may still be running
        (and paid for) when the next one starts: counted as a possible duplicate."""
        delay = retry_delay_ms(attempt) if delay_ms is None else delay_ms
        code = await self._run(
            SCRIPTS.fail,
            queue_of(job_id),
            job_id,
            token,
            error[:4000],
            int(retryable),
            delay,
            int(keep_remote),
            int(answered),
            "" if cost is None else repr(float(cost)),
            int(refund),
            int(duplicate),
        )
        _expect(code, job_id)
        return str(code)

    async def reserve(
        self, job_id: str, *, job_cap: int | None, spend_cap: float | None, cost: float = 0.0
    ) -> str | None:
        """Count one submission against the queue's caps in the store's cap window (its UTC day); None if
        allowed, else which cap is reached ("jobs" or "spend"). Idempotent per job and window."""
        (verdict,) = await self.reserve_many(queue_of(job_id), [(job_id, cost)], job_cap=job_cap, spend_cap=spend_cap)
        return verdict

    async def reserve_many(
        self,
        queue: str,
        items: Sequence[tuple[str, float]],
        *,
        job_cap: int | None,
        spend_cap: float | None,
    ) -> list[str | None]:
        """`reserve` for many (id, estimated cost), decided in order in one atomic step."""
        codes = await self._run(
            SCRIPTS.reserve,
            queue,
            "" if job_cap is None else job_cap,
            "" if spend_cap is None else spend_cap,
            orjson.dumps([(i, repr(float(c))) for i, c in items]),
        )
        return [None if code == "OK" else str(code).split(":", 1)[1] for code in codes]

    async def usage(self, queue: str) -> tuple[str, int, float]:
        """(window, jobs counted, spend) of the queue's current cap window (the store's UTC day, digits), for
        status views and metrics."""
        window, jobs, spend = await self._run(SCRIPTS.usage, validate_queue(queue))
        return str(window), int(jobs), float(spend)

    async def hold(self, job_id: str, token: str, reason: str, window: str = "") -> None:
        """Held until a cap window later than `window` (digits, e.g. "20261130"; "" = released by any)."""
        if window and not window.isdigit():
            raise InvalidJob(f"cap window must be digits like 20261130, got {window!r}")
        _expect(await self._run(SCRIPTS.hold, queue_of(job_id), job_id, token, reason, window), job_id)

    async def ack_cancel(self, job_id: str, token: str) -> None:
        _expect(await self._run(SCRIPTS.ack_cancel, queue_of(job_id), job_id, token), job_id)

    async def release_leases(
        self,
        queue: str,
        worker_id: str,
        job_ids: Sequence[str] = (),
        *,
        forget_idle: bool = False,
        unsent: Sequence[tuple[str, str]] = (),
    ) -> int:
        """Hand leases back uncounted (all, or the given ids). All, or with `forget_idle` the last ones the
        worker holds, also forget the worker (it is no longer listed as alive). `unsent`: (id, token) of jobs
        whose submit intent that lease opened but whose call was never sent: the intent is closed, so the next
        owner sends that submission again as the same run, not as a possible duplicate."""
        mode = "idle" if forget_idle else "ids" if job_ids else "all"
        closing = orjson.dumps(unsent) if unsent else ""
        return int(await self._run(SCRIPTS.release_leases, queue, worker_id, mode, closing, *job_ids))

    async def forgive(self, queue: str, worker_id: str) -> tuple[int, int, int]:
        """The worker's machine was pre-empted (the provider took it away): its jobs come back without using up
        an attempt, including any the reaper already took back counting a lease expiry. (released, refunded,
        revived from dead)."""
        released, refunded, revived = await self._run(SCRIPTS.forgive, queue, worker_id)
        return int(released), int(refunded), int(revived)

    # -- operating -------------------------------------------------------------------------------

    async def cancel(self, job_id: str) -> str:
        """Returns "cancelled" (it was waiting) or "requested" (its worker will cancel the remote job)."""
        code = await self._run(SCRIPTS.cancel, queue_of(job_id), job_id, durable=True)
        _expect(code, job_id)
        if str(code).startswith("ALREADY:"):
            raise InvalidTransition(f"job {job_id} is already {code.split(':', 1)[1]}")
        return str(code)

    async def release(self, queue: str, job_ids: Sequence[str] = (), limit: int = 1000) -> list[str]:
        """Held jobs back to ready (all of them up to limit, or the given ids)."""
        return list(await self._run(SCRIPTS.move, validate_queue(queue), "held", limit, *job_ids))

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
        return list(await self._run(SCRIPTS.move, validate_queue(queue), "dead", limit, *job_ids))

    async def purge(self, queue: str, state: str) -> int:
        listing.check_purgeable(state)
        total = 0
        while n := int(await self._run(SCRIPTS.purge, validate_queue(queue), STATE_SETS[state], 1000)):
            total += n
        return total

    async def pause(self, queue: str) -> None:
        """Stop claims on a queue (it may not have had jobs yet: it is listed from now on)."""
        await self.redis.set(keys.paused(validate_queue(queue)), "1")
        await self.redis.sadd(QUEUES_KEY, queue)

    async def resume(self, queue: str) -> None:
        """Let claims take jobs again; idle workers hear of it at once (`keys.wake_channel`), not at their next
        poll."""
        await self.redis.delete(keys.paused(validate_queue(queue)))
        await self.redis.publish(keys.wake_channel(queue), "")

    async def reap(self, queue: str, limit: int = 1000) -> tuple[int, int, int]:
        """Maintenance step: (promoted, reaped, trimmed). Safe to run from any number of processes. A step back
        of the store's clock this call found (and moved the queue's times back by: `shift_back` in common.lua) is
        logged here."""
        promoted, reaped, trimmed, stepped = await self._run(
            SCRIPTS.reap, validate_queue(queue), limit, self._silence(self.lease_ms)
        )
        if int(stepped):
            log_clock_step(queue, int(stepped))
        return int(promoted), int(reaped), int(trimmed)

    # -- reading ---------------------------------------------------------------------------------

    async def get(self, job_id: str) -> Job:
        reply = await self._run(SCRIPTS.get, queue_of(job_id), job_id)
        if not reply:
            raise JobNotFound(f"job {job_id} not found")
        flat, deadline = reply
        return Job.from_hash(job_id, replies.pairs(flat), int(float(deadline)) if deadline else None)

    async def submitted_age_ms(self, job_id: str) -> int | None:
        """How long ago, by the store's clock, the job's current submission was recorded: the later of its remote
        id's checkpoint and its intent (a checkpoint older than the intent is an earlier run's); None when the
        record has neither. Read only for a 404 on a resumed remote job (worker/lag.py)."""
        stamps = await self.redis.hmget(keys.job(queue_of(job_id), job_id), ["submitted_at", "intent_at"])
        known = [int(float(s)) for s in stamps if s]
        if not known:
            return None
        if self.clock_ms is not None:
            now = self.clock_ms()
        else:
            seconds, micros = await self.redis.time()
            now = seconds * 1000 + micros // 1000
        return now - max(known)

    async def list_jobs(
        self, queue: str, state: str | None, *, cursor: int = 0, limit: int = 50
    ) -> tuple[list[Job], int | None]:
        """Jobs in one state (waiting states oldest first, finished ones newest first), or with `state` None in
        every state, newest first (offload/queue/listing.py)."""
        ids, next_cursor = await listing.page_ids(self.redis, queue, state, cursor, limit)
        found = await asyncio.gather(*(self.get(job_id) for job_id in ids), return_exceptions=True)
        jobs = [j for j in found if isinstance(j, Job)]  # JobNotFound: expired since the index read
        for problem in found:
            if isinstance(problem, BaseException) and not isinstance(problem, JobNotFound):
                raise problem
        return jobs, next_cursor

    async def stats(self, queue: str) -> QueueStats:
        return replies.queue_stats(queue, await self._run(SCRIPTS.stats, validate_queue(queue)))

    async def histograms(self, queue: str) -> dict[str, tuple[list[int], int, int]]:
        """The latency histograms the scripts keep: name ("wait", "run") -> (count per bucket of
        HIST_BUCKETS_S plus +Inf, not cumulative; total count; sum in ms)."""
        raw = await self.redis.hgetall(keys.histograms(validate_queue(queue)))
        out: dict[str, tuple[list[int], int, int]] = {}
        for name in ("wait", "run"):
            buckets = [int(raw.get(f"{name}:{i}", 0)) for i in range(1, len(HIST_BUCKETS_S) + 2)]
            out[name] = (buckets, int(raw.get(f"{name}:count", 0)), int(raw.get(f"{name}:sum", 0)))
        return out

    async def possible_duplicates(self, queue: str) -> dict[str, int]:
        """Per backend: submissions made again whose earlier try had an unknown outcome (begin.lua)."""
        raw = await self.redis.hgetall(keys.duplicates(validate_queue(queue)))
        return {backend: int(n) for backend, n in raw.items()}

    async def queues(self) -> list[str]:
        return sorted(await self.redis.smembers(QUEUES_KEY))

    async def events(
        self, queue: str, last_id: str = "$", *, block_ms: int | None = None, count: int = 100
    ) -> list[tuple[str, dict[str, str]]]:
        """State changes after `last_id` from the queue's capped stream (for dashboards and --watch)."""
        key = keys.events(validate_queue(queue))
        reply = await self.redis.xread({key: last_id}, count=count, block=block_ms)
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [(eid, fields) for eid, fields in entries]
