"""What the collaborators of a dispatch worker share: the store, the backend, the options, the limits, the runs,
the batched store writes and the drain's state. Built once per `Worker` (dispatch.py) and handed to each part:
the leases (leases.py), the slots (slots.py), the submit (submit.py), the wait for a result (polling.py), the
endings (endings.py), the job path that strings them together (jobpath.py) and the drain (drain.py).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from offload.backends.base import Backend, WebhookBackend
from offload.models import ClaimedJob
from offload.queue import keyspace, replies
from offload.queue.backend_limits import BackendLimits
from offload.queue.batching import Batcher
from offload.queue.memory import PolicyWatch, has_room
from offload.queue.store import CompleteItem, QueueStore
from offload.tracing import RECORD_FIELD
from offload.worker.health import StoreHealth
from offload.worker.job_run import Drained, Runs
from offload.worker.options import WorkerOptions
from offload.worker.routing import Lane, Router
from offload.worker.storage_gate import StorageGate

T = TypeVar("T")
Fence = Callable[[], Awaitable[None]]
# (output key, output, submission, fence) -> location. The submission number names the remote run, so files of
# two runs never share a key; `fence` is awaited right before the output itself is written.
StoreOutput = Callable[[str, Any, str, Fence], Awaitable[str]]


class StoreWrites:
    """The per-job writes of the hot path, coalesced: thousands of tasks, a few script calls."""

    __slots__ = ("begins", "checkpoints", "completes", "fences", "hook_bodies", "options", "store", "traceparents")

    def __init__(self, store: QueueStore, options: WorkerOptions) -> None:
        self.store, self.options = store, options
        q = options.queue
        self.checkpoints: Batcher[tuple[str, str, str, str, int], replies.Checkpointed] = Batcher(
            lambda items: store.checkpoint_many(q, items)
        )
        self.completes: Batcher[CompleteItem, replies.Verdict] = Batcher(lambda items: store.complete_many(q, items))
        self.begins: Batcher[tuple[str, str, str, str, str], replies.Begun] = Batcher(self._begin_many)
        self.fences: Batcher[tuple[str, str], replies.Verdict] = Batcher(lambda items: store.fence_many(q, items))
        self.hook_bodies: Batcher[tuple[str, int], str | None] = Batcher(store.hook_bodies)
        self.traceparents: Batcher[str, str | None] = Batcher(self._traceparents)  # read only while tracing is on

    async def _traceparents(self, ids: list[str]) -> list[str | None]:
        """The traceparent each job's record holds (offload/tracing.py), read apart from the claim: only a
        traced worker pays for the read, and the claim's reply stays as it is."""
        pipe = self.store.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(keyspace.job(self.options.queue, job_id), RECORD_FIELD)
        return list(await pipe.execute())

    async def _begin_many(self, items: list[tuple[str, str, str, str, str]]) -> list[replies.Begun]:
        """(id, token, webhook secret hash, backend, the router's reason) per job."""
        opts = self.options
        return await self.store.begin_many(
            opts.queue,
            [(i, t, opts.reservation, h, b, w) for i, t, h, b, w in items],
            job_cap=opts.daily_job_cap,
            spend_cap=opts.daily_spend_cap,
            backend=opts.backend_name,
        )


def single_lane(options: WorkerOptions, backend: Backend, hooks: WebhookBackend | None, limits: BackendLimits) -> Lane:
    """The one lane of a single-`backend` queue, from the worker's options (no health: nothing to route around)."""
    return Lane(
        name=options.backend_name,
        backend=backend,
        limits=limits,
        hooks=hooks,
        price_per_job=options.price_per_job,
        price_per_second=options.price_per_second,
        hook_base=options.hook_base,
        hook_grace_s=options.hook_grace_s,
        hook_poll_interval=options.hook_poll_interval,
        not_found_grace_s=options.not_found_grace_s,
        resubmit_on_timeout=options.resubmit_on_timeout,
        timeout=options.backend_timeout,
    )


@dataclass(eq=False)
class WorkerContext:
    """The worker's shared parts. `control`: the store on the claims' and heartbeats' own connection (job tasks
    can keep every connection of the main pool busy, and a heartbeat that waits for one past the lease loses
    every job)."""

    store: QueueStore
    control: QueueStore
    backend: Backend
    hooks: WebhookBackend | None  # the backend, when this worker's submissions carry webhook URLs
    store_output: StoreOutput
    limits: BackendLimits
    options: WorkerOptions
    worker_id: str
    health: StoreHealth
    policy: PolicyWatch  # a store that may evict stops the claims and submissions until it is fixed
    writes: StoreWrites
    router: Router  # the queue's backends as lanes; one for a single-`backend` queue (worker/routing.py)
    # this host's clock refused by the result storage stops the claims and submissions (worker/storage_gate.py)
    storage_gate: StorageGate
    runs: Runs = field(default_factory=Runs)
    draining: bool = False  # no submission starts once set (see drain.py)
    grace_over: bool = False  # the drain's grace has ended: a job whose answer was just recorded does not poll
    # waiting for a slot, the rate limit or the gate, or pausing before a resend: nothing sent, a drain cancels
    ahead: dict[asyncio.Task[Any], ClaimedJob] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        store: QueueStore,
        control: QueueStore,
        backend: Backend,
        store_output: StoreOutput,
        limits: BackendLimits,
        options: WorkerOptions,
        worker_id: str,
        router: Router | None = None,
        storage_gate: StorageGate | None = None,
    ) -> WorkerContext:
        """`router`: a routed queue's lanes; None builds the one lane of `backend` from `options`. `storage_gate`:
        the process's (one per process: its storage and clock are shared); None, one of its own without a probe."""
        health = StoreHealth(  # with durability, the probe waits for replicas too: an unconfirmed write is resent
            lambda: store.probe(options.queue),
            max_pause_s=min(2.0, options.lease_ms / 4000),
            room=functools.partial(has_room, store.redis),
            heal=functools.partial(store.reap, options.queue),  # trims first: the store's way back under its limit
        )
        hooks = backend if options.hook_base and isinstance(backend, WebhookBackend) else None
        if router is None:
            router = Router([single_lane(options, backend, hooks, limits)])
        return cls(
            store=store,
            control=control,
            backend=backend,
            hooks=hooks,
            store_output=store_output,
            limits=limits,
            options=options,
            worker_id=worker_id,
            health=health,
            policy=PolicyWatch(store.redis, what="claim or submission"),
            writes=StoreWrites(store, options),
            router=router,
            storage_gate=storage_gate or StorageGate(),
        )

    async def wait_ahead(self, job: ClaimedJob, aw: Awaitable[T]) -> T:
        """Wait for `aw` (a slot, the rate limit, the submit gate, a pause before a resend) as one of the jobs
        ahead of their call: a drain cancels the wait and hands the job back; once draining none starts
        (`Drained`). Only a wait is registered, and its task looked up then: the lookup costs on the hot path."""
        if self.draining:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise Drained(job.id)
        task = asyncio.current_task()
        assert task is not None
        self.ahead[task] = job
        try:
            return await aw
        finally:
            self.ahead.pop(task, None)
