"""The dispatch worker: one asyncio process keeps up to `concurrency` remote jobs in flight.

It claims in batches and runs each job as a task (jobpath.py: submit, record the remote id, poll, store,
complete), with one `JobRun` per lease (job_run.py) holding what the worker knows of it. Nothing here sleeps on
behalf of another job: retries are scheduled in Redis, waits are per task. The parts share one `WorkerContext`
(context.py): the leases (claims, heartbeats, the cap window), the slots, the submit, the wait for a result, the
endings and the drain; `Worker` wires them and runs the claim loop.

`concurrency` is a number of slots, one per job at the provider (from its submit call to its result). A few
jobs more are claimed ahead and wait for a slot (on a synchronous API already begun: their submit intent
recorded), so a slot that frees is filled at once instead of after a claim's (and a begin's) round trips; the
output and the ack come after the slot is given back, so their round trips do not keep a remote job from
starting either. See docs/explanation/architecture.md, *Slots*.

What the loop guarantees about leases: a job claimed again while an older task of it still runs (the old lease
was reaped) starts only after the old task is stopped. And the loop never exits for the job store's sake:
claims, window rolls and the drain wait out an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from offload.backends.base import Backend
from offload.backends.batched import BatchBackend
from offload.backoff import compute_backoff
from offload.connection import is_outage
from offload.eventloop import first_of, within
from offload.models import ClaimedJob
from offload.queue.backend_limits import BackendLimits
from offload.queue.keyspace import hooks_channel, wake_channel
from offload.queue.memory import PolicyWatch
from offload.queue.store import QueueStore
from offload.worker import wakeups
from offload.worker.context import StoreOutput, WorkerContext
from offload.worker.drain import Drain
from offload.worker.endings import Endings
from offload.worker.health import StoreHealth
from offload.worker.jobpath import JobPath
from offload.worker.leases import Leases
from offload.worker.options import WorkerOptions
from offload.worker.packing import Packer
from offload.worker.polling import Polling
from offload.worker.prefetch import Prefetch
from offload.worker.routing import Router
from offload.worker.slots import Slots
from offload.worker.storage_gate import StorageGate
from offload.worker.submit import Submitter

log = logging.getLogger("offload.worker")
__all__ = ["StoreOutput", "Worker", "WorkerOptions", "default_worker_id"]
# An idle worker's claims back off from this to `idle_poll_max`.
IDLE_POLL_S = 0.02
INGEST_IDLE_S = 0.2  # an empty ingest list is read again after this


def default_worker_id() -> str:
    """`host:pid:random`. The random part makes every process a new worker to the store, also a container
    restarted with the same hostname and PID 1, which would otherwise inherit its predecessor's leases."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Worker:
    """Serves one queue. `run(stop)` returns after a graceful drain once `stop` is set."""

    def __init__(
        self,
        store: QueueStore,
        backend: Backend,
        store_output: StoreOutput,
        limits: BackendLimits,
        options: WorkerOptions,
        *,
        worker_id: str | None = None,
        control: QueueStore | None = None,
        router: Router | None = None,
        storage_gate: StorageGate | None = None,
    ) -> None:
        self.id = worker_id or default_worker_id()
        ctx = WorkerContext.build(
            store, control or store, backend, store_output, limits, options, self.id, router, storage_gate
        )
        self.ctx = ctx
        prefetch = Prefetch(options, time.monotonic())  # how many jobs to lease ahead of the slots
        self.slots = Slots(ctx, prefetch)
        self.leases = Leases(ctx, prefetch, self._start)
        self.endings = Endings(ctx)
        self.drain = Drain(ctx)
        self.submitter = Submitter(ctx, self.leases, self.endings)
        self.polling = Polling(ctx, self.endings)
        self.packers = {
            lane.name: Packer(ctx, lane, self.submitter, self.endings, self.slots.room)
            for lane in ctx.router.lanes
            if isinstance(lane.backend, BatchBackend)
        }
        self.path = JobPath(ctx, self.slots, self.submitter, self.polling, self.endings, self.drain, self.packers)
        self._ready = asyncio.Event()  # set when jobs became ready after a claim found none (wakeups.py)

    # -- what callers read ------------------------------------------------------------------------

    @property
    def store(self) -> QueueStore:
        return self.ctx.store

    @property
    def backend(self) -> Backend:
        return self.ctx.backend

    @property
    def limits(self) -> BackendLimits:
        return self.ctx.limits

    @property
    def options(self) -> WorkerOptions:
        return self.ctx.options

    @property
    def health(self) -> StoreHealth:
        return self.ctx.health

    @property
    def policy(self) -> PolicyWatch:
        return self.ctx.policy

    @property
    def tasks(self) -> dict[str, asyncio.Task[None]]:
        """The task of every job this worker runs, by job id."""
        return self.ctx.runs.tasks()

    @property
    def in_flight(self) -> int:
        return self.slots.in_flight

    @property
    def peak_in_flight(self) -> int:
        """The most remote jobs at once (slots taken), at most `concurrency`."""
        return self.slots.peak_in_flight

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, cut: asyncio.Event | None = None) -> None:
        """Serve until `stop`, then drain; `cut` (a second signal) ends the drain at once."""
        if cut is not None:
            self.drain.cut = cut
        helpers = self._helpers(stop)
        try:
            await self._serve(stop)
        finally:
            await self.drain.run(helpers)
            for packer in self.packers.values():
                await packer.aclose()

    def _helpers(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        """The heartbeat, the policy watch, the ingest (when configured) and the wake-ups' subscription."""
        opts = self.ctx.options
        helpers = [asyncio.create_task(self.leases.heartbeat_loop()), asyncio.create_task(self.ctx.policy.run())]
        if opts.ingest_list:
            helpers.append(asyncio.create_task(self._ingest_loop(stop)))
        channels: dict[str, Callable[[str | None], None]] = {wake_channel(opts.queue): self._ready_news}
        if any(lane.hooks for lane in self.ctx.router.lanes):
            channels[hooks_channel(opts.queue, self.id)] = wakeups.hook_messages(self._wake)
        helpers.append(asyncio.create_task(wakeups.listen(self.ctx.store.redis, channels)))
        return helpers

    async def _serve(self, stop: asyncio.Event) -> None:
        """Claim while there is room, until `stop`; an idle worker waits for room, news or its next poll."""
        policy, opts = self.ctx.policy, self.ctx.options
        idle_rounds = 0  # claims in a row that found fewer jobs than they asked for
        while not stop.is_set():
            if not policy.safe:
                await first_of(policy.wait_safe(), stop.wait())
                continue
            if not self.ctx.storage_gate.open:  # its outputs could not be stored: none is paid for
                await first_of(self.ctx.storage_gate.wait_open(), stop.wait())
                continue
            free = self.slots.to_claim()
            batch = min(free, opts.claim_batch)
            self._ready.clear()  # before the claim: news that comes while it is out is not missed
            try:
                claimed = await self._claim(batch)
            except Exception as exc:
                if not is_outage(exc):
                    raise
                await first_of(self.ctx.health.after(exc), stop.wait())
                continue
            if claimed and len(claimed) == batch:
                idle_rounds = 0
                continue
            pause = (
                compute_backoff(idle_rounds + 1, base=IDLE_POLL_S, cap=opts.idle_poll_max)
                if idle_rounds
                else IDLE_POLL_S
            )
            await self._idle(free, pause, stop)
            idle_rounds = 0 if claimed else idle_rounds + 1

    async def _claim(self, batch: int) -> list[ClaimedJob]:
        await self.leases.roll_window()
        return await self.leases.claim(batch) if batch > 0 else []

    async def _idle(self, free: int, pause: float, stop: asyncio.Event) -> None:
        """Room (a task ended) or, with room, jobs made ready (wakeups.py); the poll is the fallback for a lost
        message and for jobs that became due in the delayed and retry sets."""
        room = self.slots.room
        room.clear()
        wake = (room.wait(), self._ready.wait()) if free > 0 else (room.wait(),)
        with contextlib.suppress(TimeoutError):
            await within(first_of(*wake, stop.wait()), pause if free > 0 else None)

    def _start(self, job: ClaimedJob, sent: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run a claimed job as a task (on `loop`: the claim passes it, one lookup per claim instead of one per job
        inside `asyncio.create_task`)."""
        run, old = self.ctx.runs.start(job, sent)
        if old is not None and old.task is not None and not old.calling():
            # our old lease of it was reaped (we stalled) and the store gave it back to us; an old task whose
            # submit call is out is left to record the answer (attached), which the new task then polls
            log.warning("job %s: leased to this worker again; its earlier task is stopped first", job.id)
            old.task.cancel()
        after = old.task if old is not None else None
        run.task = (loop or asyncio.get_running_loop()).create_task(self.path.run_job(run, after))

    def _ready_news(self, _: str | None) -> None:
        """Jobs became ready (or the subscription was lost and may have missed it): claim now."""
        self._ready.set()

    def _wake(self, job_id: str | None, submission: int, body: str | None) -> None:
        """A webhook for a job of ours was kept by the server: its task reads it now (None: every job, once the
        subscription is in place; see wakeups.py), from `body` when the message carried it."""
        runs = self.ctx.runs
        if job_id is None:
            for each in runs.all():
                if each.hooked is not None:
                    each.hooked.set()
        elif (run := runs.get(job_id)) is not None:
            if body is not None and submission > 0:
                run.heard = (submission, body)
            run.hook_event().set()

    async def _ingest_loop(self, stop: asyncio.Event) -> None:
        opts = self.ctx.options
        assert opts.ingest_list is not None
        while not stop.is_set():
            try:
                ok, bad = await self.ctx.store.ingest(opts.ingest_list, opts.queue, max_attempts=opts.max_attempts)
            except Exception as exc:
                if is_outage(exc):
                    await self.ctx.health.after(exc)
                else:
                    log.warning("ingest from %s failed: %s", opts.ingest_list, exc)
                ok = bad = 0
            if ok + bad == 0:
                await asyncio.sleep(INGEST_IDLE_S)
