"""The job store: one async method per atomic transition, each a single Lua script on the server.

The store knows nothing about HTTP, providers or storage. It takes an already-connected redis-py
asyncio client (standalone or cluster) and an optional clock, so tests can drive time without sleeping.
QueueStore is put together from one class per concern: the workers' transitions here, enqueue and ingest
(enqueue_store.py), operating and maintenance (admin_store.py), reads (read_store.py) and webhooks
(hook_store.py), all on base_store.py's shared state and script runner.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson

from offload.backoff import retry_delay_ms
from offload.clock import ClockMs
from offload.errors import InvalidJob, InvalidTransition, JobNotFound, StaleLease
from offload.models import CapacityKind, ClaimedJob, ClaimMode, HeartbeatReply
from offload.queue import replies
from offload.queue.admin_store import AdminStore
from offload.queue.base_store import DEFAULT_LEASE_MS
from offload.queue.durability import Durability, NotReplicated
from offload.queue.enqueue_store import EnqueueStore, new_nonce
from offload.queue.hook_store import HookStore
from offload.queue.keyspace import queue_of, validate_queue
from offload.queue.read_store import ReadStore
from offload.queue.scripts import SCRIPTS
from offload.queue.specs import max_payload_limit
from offload.redis_client import RedisClient

__all__ = ["DEFAULT_LEASE_MS", "CompleteItem", "LeaseRef", "QueueStore"]

log = logging.getLogger("offload.queue")
LeaseRef = str | tuple[str, str]  # a job id, or (job id, lease token)


#: (id, token, result location, cost) or, for a run never checkpointed, (..., backend, remote id, submission).
CompleteItem = tuple[str, str, str, float | None] | tuple[str, str, str, float | None, str, str, int]


def _price(price: float | None) -> str:
    """A machine's price per hour as the scripts take it: '' when unknown (no price, or none above $0)."""
    return repr(float(price)) if price is not None and price > 0 else ""


def _expect(code: Any, job_id: str) -> None:
    if code == "NOTFOUND":
        raise JobNotFound(f"job {job_id} not found")
    if code == "STALE":
        raise StaleLease(f"job {job_id}: lease token is stale (another worker owns it or it finished)")


class QueueStore(EnqueueStore, AdminStore, ReadStore, HookStore):
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
        self._known_queues = set()

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
        await self._confirm(queue)

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
        mode: ClaimMode = "",
        after_s: float = 0.0,
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
            request_id or new_nonce(),
            "" if job_cap is None else job_cap,
            "" if spend_cap is None else spend_cap,
            repr(float(estimate)),
            self._silence(lease),
            "1" if begin else "",
            mode,
            round(after_s * 1000),
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
        items: Sequence[tuple[str, str, float] | tuple[str, str, float, str] | tuple[str, str, float, str, str, str]],
        *,
        job_cap: int | None = None,
        spend_cap: float | None = None,
        backend: str = "",
    ) -> list[replies.Begun]:
        """Right before the provider call, per (id, token, estimated cost): lease and cancel check, cap
        reservation in the store's cap window (held when over) and the submit intent, with the hash of the
        submission's webhook secret when the item carries one (id, token, cost, hash). Per item OK:<n>,
        OK:<n>:DUP (a possible duplicate: an earlier try of that submission has an unknown outcome), CAP:jobs,
        CAP:spend, CANCEL, STALE or NOTFOUND (see begin.lua), decoded. A routed queue's items carry the backend
        chosen and the router's reason too (..., backend, why): recorded with the intent; MOVED:<backend> when an
        earlier lease's open intent went to another."""
        codes = await self._run(
            SCRIPTS.begin,
            queue,
            "" if job_cap is None else job_cap,
            "" if spend_cap is None else spend_cap,
            backend,
            orjson.dumps(
                [
                    (i[0], i[1], repr(float(i[2])), *i[3:]) if len(i) > 3 else (*i[:2], repr(float(i[2])), "")
                    for i in items
                ]
            ),
            durable=True,
        )
        return [replies.begun(code) for code in codes]

    async def overdue(
        self, queue: str, worker_id: str, job_ids: Sequence[str], max_ms: int
    ) -> list[tuple[str, str, int]]:
        """(id, token, attempt) of the worker's leases among `job_ids` that have run longer than `max_ms`."""
        flat = await self._run(SCRIPTS.overdue, queue, worker_id, max_ms, *job_ids)
        return [(flat[i], flat[i + 1], int(flat[i + 2])) for i in range(0, len(flat), 3)]

    async def fence_many(self, queue: str, items: Sequence[tuple[str, str]]) -> list[replies.Verdict]:
        """OK / STALE / NOTFOUND per (id, token): whether each token still holds its lease (changes nothing)."""
        return [replies.lease_verdict(code) for code in await self._run(SCRIPTS.fence, queue, orjson.dumps(items))]

    async def checkpoint(self, job_id: str, token: str, backend: str, remote_id: str) -> bool:
        """Record the remote job; returns True when a cancel was requested meanwhile."""
        (code,) = await self.checkpoint_many(queue_of(job_id), [(job_id, token, backend, remote_id)])
        _expect(code.verdict, job_id)
        return code.cancel

    async def checkpoint_many(
        self, queue: str, items: Sequence[tuple[str, str, str, str] | tuple[str, str, str, str, int]]
    ) -> list[replies.Checkpointed]:
        """Record many (id, token, backend, remote id[, submission number]); OK, OK:CANCEL, DUP:<first id>,
        ATTACHED, STALE:DUP, STALE or NOTFOUND per item, decoded. The submission's intent is closed."""
        codes = await self._run(SCRIPTS.checkpoint, queue, orjson.dumps(items), durable=True)
        return [replies.checkpointed(code) for code in codes]

    async def complete_many(self, queue: str, items: Sequence[CompleteItem]) -> list[replies.Verdict]:
        """Ack many (id, token, result location, cost[, backend, remote id, submission number]) of a dispatch
        worker (kind serverless); returns OK / STALE / NOTFOUND per item. The remote part records a run that was
        never checkpointed (a synchronous API answers the submit with the result) and closes its submit intent, in
        the same step as the ack."""
        return await self._complete(queue, items, "serverless", None)

    async def _complete(
        self, queue: str, items: Sequence[CompleteItem], kind: CapacityKind, price: float | None
    ) -> list[replies.Verdict]:
        """`kind`: the capacity that ran them; a fleet job's cost is its run time x `price` (USD per hour of its
        machine; None: unknown, no cost recorded)."""
        batch = orjson.dumps(
            [(*item[:3], "" if item[3] is None else repr(float(item[3])), *item[4:]) for item in items]
        )
        codes = await self._run(SCRIPTS.complete, queue, batch, kind, _price(price), durable=True)
        return [replies.lease_verdict(code) for code in codes]

    async def complete(
        self,
        job_id: str,
        token: str,
        result: str,
        cost: float | None = None,
        *,
        kind: CapacityKind = "serverless",
        price: float | None = None,
    ) -> None:
        """One ack; `kind` and `price` as for `_complete` (a GPU worker's job: fleet, at its machine's price)."""
        (code,) = await self._complete(queue_of(job_id), [(job_id, token, result, cost)], kind, price)
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
        returned: bool = False,
        kind: CapacityKind = "serverless",
        price: float | None = None,
    ) -> str:
        """Returns "retrying" or "dead". `answered`: the provider answered the submit (its intent is closed);
        `cost`: what the failed run cost (settles its reservation); `refund`: the provider refused the
        submission, so it is not counted against the caps; `duplicate`: the run given up may still be running
        (and paid for) when the next one starts: counted as a possible duplicate; `returned` (with `retryable`):
        the job never ran (a batch line expired or cancelled): its attempt is given back, not counted. `kind`
        and `price` as for `_complete`: a run that cost something adds to the queue's spend of its kind."""
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
            int(returned),
            kind,
            _price(price),
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
        return [replies.cap_reached(code) for code in codes]

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

    async def ack_cancel(self, job_id: str, token: str, *, unsent: bool = False) -> None:
        """The job ends cancelled. `unsent`: its submission was begun and its call never sent, so the intent
        closes and the cap reservation is refunded (as a drain's `release_leases(unsent=...)` does)."""
        args = (job_id, token, "1") if unsent else (job_id, token)
        _expect(await self._run(SCRIPTS.ack_cancel, queue_of(job_id), *args), job_id)

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

    async def cancel(self, job_id: str) -> str:
        """Returns "cancelled" (it was waiting) or "requested" (its worker will cancel the remote job)."""
        code = await self._run(SCRIPTS.cancel, queue_of(job_id), job_id, durable=True)
        _expect(code, job_id)
        if (state := replies.already(code)) is not None:
            raise InvalidTransition(f"job {job_id} is already {state}")
        return str(code)
