"""A dispatch worker's leases: the claims that take them, the heartbeat that keeps them, the cap window's roll.

A heartbeat never runs while a claim is in flight (one lock), so every lease the store has handed this process
by the time a heartbeat is sent is either in its runs or was never received; the heartbeat lists (job id, token)
pairs and hands the others back (`since`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from offload.connection import is_outage
from offload.models import ClaimedJob
from offload.queue.batching import Batcher
from offload.queue.store_clock import log_clock_step
from offload.worker.context import WorkerContext
from offload.worker.health import describe
from offload.worker.job_run import JobRun
from offload.worker.prefetch import Prefetch

log = logging.getLogger("offload.worker")
# The store answers each release of held jobs with the time until its next cap window (its UTC day, never this
# host's); it is asked again at least this often, so a step of its clock is followed within seconds (the server's
# maintenance releases every second too).
WINDOW_RECHECK_S = 10.0
# Start a claimed job's task: (job, when its claim was sent, the running loop).
Start = Callable[[ClaimedJob, float, asyncio.AbstractEventLoop], None]


class Leases:
    """Claims, heartbeats and the cap window's roll, on the control connection."""

    def __init__(self, ctx: WorkerContext, prefetch: Prefetch, start: Start) -> None:
        self.ctx, self.prefetch, self.start = ctx, prefetch, start
        self.lock = asyncio.Lock()  # claim and heartbeat, never both at once
        self.since: int | None = None  # the lease sequence number of the last heartbeat
        self.beat_at = 0.0  # when the last heartbeat that went through was sent (monotonic)
        self.next_window = 0.0  # when the store's next cap window begins (monotonic): the first loop releases
        self.beats: Batcher[None, None] = Batcher(self._beat_many, concurrency=1)
        # A synchronous API without a rate limit begins each job the moment it has it (see submit.py), so the
        # claim opens the intents itself: one script call per job less (claim.lua's `begin`; caps leave it to
        # begin). Not with durability: the intent must be replicated before the call, and begin.lua's WAIT is
        # resent through an outage like any write of a job, where a claim's would not be.
        self.begin_at_claim = (
            ctx.backend.synchronous
            and not ctx.limits.interval_ms
            and ctx.hooks is None
            and ctx.store.durability is None
            and not ctx.router.routed  # the backend is chosen (and recorded with the intent) by the begin
        )

    async def claim(self, n: int) -> list[ClaimedJob]:
        opts = self.ctx.options
        async with self.lock:
            sent = time.monotonic()
            jobs = await self.ctx.control.claim(
                opts.queue,
                self.ctx.worker_id,
                n,
                opts.lease_ms,
                job_cap=opts.daily_job_cap,
                spend_cap=opts.daily_spend_cap,
                estimate=opts.reservation,
                begin=self.begin_at_claim,
                mode=opts.claim_mode,
                after_s=opts.overflow_after,
            )
            self.prefetch.claimed(sent, time.monotonic())
            loop = asyncio.get_running_loop()
            for job in jobs:
                self.start(job, sent, loop)
        return jobs

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.options.lease_ms / 3000)
            try:
                await self.beats(None)
            except Exception as exc:  # an outage is waited out by the tasks; the next beat tries again
                if is_outage(exc):
                    self.ctx.health.failed(exc)
                else:
                    log.warning("heartbeat failed: %s", describe(exc))

    async def beat(self) -> None:
        """Extend every lease in one call; stop the tasks whose lease is gone; hand back leases we never got."""
        ctx = self.ctx
        async with self.lock:
            sent = time.monotonic()
            reply = await ctx.control.heartbeat(
                ctx.options.queue, ctx.worker_id, ctx.runs.leases(), ctx.options.lease_ms, since=self.since
            )
            self.since, self.beat_at = reply.seq, sent
            if reply.stepped_back_ms:  # held jobs of a window the store's clock left behind were released too
                log_clock_step(ctx.options.queue, reply.stepped_back_ms)
                self.next_window = 0.0
            for job_id in reply.lost:
                self._lost(job_id)
        if reply.released:
            log.warning(
                "handed back %d leases this worker never knew of (a claim whose reply was lost, or an "
                "earlier process with this worker id)",
                reply.released,
            )
        for job_id in reply.cancel_requested:
            if (run := ctx.runs.get(job_id)) is not None:
                _cancel_heard(run)

    def _lost(self, job_id: str) -> None:
        run = self.ctx.runs.get(job_id)
        if run is None or run.settling:
            return
        if run.calling():  # its answer is recorded for the new owner, then the task ends
            log.warning("lease of %s lost while its submit call is out", job_id)
        elif run.task is not None:
            log.warning("lease of %s lost; another worker owns it now", job_id)
            run.task.cancel()

    async def _beat_many(self, items: list[None]) -> list[None]:
        await self.beat()
        return [None] * len(items)

    def stale(self, run: JobRun) -> bool:
        """Whether the lease must be proven fresh before paying for a submission. A process starved of CPU (an
        overloaded host, a SIGSTOP) can miss beats; if its leases lapsed, another worker may already own this
        job, and submitting now would pay twice. The lease is known fresh from the claim that delivered it or
        from a later heartbeat (which listed it); else `renew` first, which cancels this task if it is gone. A
        check, not a coroutine: it runs once or twice per job, and is almost always False."""
        fresh = max(run.claimed_at, self.beat_at)
        return time.monotonic() - fresh > self.ctx.options.lease_ms / 3000

    async def renew(self) -> None:
        """A heartbeat now (joining one on its way), through any outage."""
        await self.ctx.health.call(lambda: self.beats(None))

    async def roll_window(self) -> None:
        """Jobs held in an earlier cap window go back to ready: when the window rolls over during the worker's
        life, and when a worker starts in a later window than the one they were held in (a restart after
        midnight). The window is the store's UTC day, whatever this host's clock says: the store answers which
        window it is in and when the next begins, and this host only measures that wait (monotonic). Every worker
        may do this: moving a held job is atomic. The next release is scheduled only once this one went through,
        so one interrupted by an outage is done again."""
        if time.monotonic() < self.next_window:
            return
        done = await self.ctx.control.release_held(self.ctx.options.queue)
        self.next_window = time.monotonic() + min(max(done.next_window_s, 0.05), WINDOW_RECHECK_S)
        if done.released:
            log.info("cap window %s (the job store's UTC day): released %d held jobs", done.window, done.released)


def _cancel_heard(run: JobRun) -> None:
    """A cancel of the job was requested: a task waiting for the rate limit or its webhook acts on it now."""
    run.cancel = True
    if run.cancel_wait is not None:
        run.cancel_wait.set()
    if run.hooked is not None:
        run.hooked.set()
