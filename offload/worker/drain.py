"""A dispatch worker's drain (SIGTERM): no submission starts once it begins; the jobs that have not sent their call
go back unsent (their intents closed); every submit call already out is awaited and its answer checkpointed
before the leases are handed back, for up to the backend's timeout, even past the grace. Only a second signal
(`cut`), or a call hung past that bound, cuts one off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from offload.eventloop import first_of
from offload.models import ClaimedJob
from offload.queue.batching import Batcher
from offload.worker.context import WorkerContext

log = logging.getLogger("offload.worker")
# How long a cancelled task may take to end before a drain leaves it behind.
CANCEL_S = 5.0
# How long a drain waits, past the backend's timeout, for the answers of the calls that were out to be checkpointed
# (a store write, which waits out a short outage).
RECORD_S = 10.0


class Drain:
    """Drains the worker's runs and hands its leases back."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cut = asyncio.Event()  # a second signal: the drain ends at once (see run_workers)
        self.handbacks: Batcher[ClaimedJob, None] = Batcher(self._release_unsent)

    async def run(self, helpers: list[asyncio.Task[None]]) -> None:
        """Stop claiming and start no submission; hand the jobs that have not sent their call back at once (their
        intents closed: the next owner sends the same submission, not a possible duplicate); let the rest finish
        for the grace period. Then cut the polls (their remote ids are recorded: the next worker resumes them),
        but await every submit call still out, and a synchronous answer being stored, until the backend's timeout
        (from the drain's start: no call starts after it) plus RECORD_S, so that its answer is checkpointed
        instead of paid for again. Last, hand every lease back with its remote id. A second signal (`cut`) ends
        every wait at once: a call it cuts leaves its intent open, and the next worker adopts or resends it,
        counted as a possible duplicate."""
        ctx = self.ctx
        ctx.draining = True
        began = time.monotonic()
        await self._hand_back_ahead()
        await self._until_ended(list(ctx.runs.tasks().values()), began + ctx.options.grace_s - time.monotonic())
        ctx.grace_over = True
        await self._await_calls(began)
        tasks = list(ctx.runs.tasks().values())
        for task in tasks:
            task.cancel()
        await self._ended(tasks, "job tasks")
        for h in helpers:
            h.cancel()
        await self._ended(helpers, "helpers")
        await self._release_all()

    async def _hand_back_ahead(self) -> None:
        """The jobs waiting ahead of their call are stopped and handed back at once."""
        ctx = self.ctx
        ahead = dict(ctx.ahead)
        for task in ahead:
            task.cancel()
        log.info(
            "draining: no new submissions; %d waiting jobs handed back unsent, %d submit calls out awaited (up to "
            "%gs), the rest finish for up to %gs; a second SIGTERM or SIGINT cuts",
            len(ahead),
            sum(1 for run in ctx.runs.all() if run.calling()),
            self._call_bound(),
            ctx.options.grace_s,
        )
        if ahead:
            await self._ended(list(ahead), "waiting jobs")
            await self.hand_back([job for job in ahead.values() if job.id not in ctx.runs])

    def _call_bound(self) -> float:
        """How long after the signal a submit call out is awaited: the (longest) backend timeout, and recording."""
        opts = self.ctx.options
        return (opts.backend_timeout_max or opts.backend_timeout) + RECORD_S

    async def _await_calls(self, began: float) -> None:
        """Past the grace: every task is cut but those with a submit call out or an answer to store."""
        ctx = self.ctx
        out = [run.task for run in ctx.runs.all() if run.task is not None and run.awaited_by_drain()]
        for task in ctx.runs.tasks().values():
            if task not in out:
                task.cancel()
        await self._until_ended(out, began + self._call_bound() - time.monotonic())
        left = sum(1 for run in ctx.runs.all() if run.task and not run.task.done() and run.awaited_by_drain())
        if left or self.cut.is_set():
            log.warning(
                "drain cut (%s) with %d submit calls out: their intents stay open, the next worker adopts or "
                "resends them, counted as possible duplicates",
                "a second signal" if self.cut.is_set() else "no answer within the backend's timeout",
                left,
            )

    async def _release_all(self) -> None:
        """The drain's end: every task and helper has ended; flush the metrics and hand every lease back."""
        ctx = self.ctx
        with contextlib.suppress(TimeoutError):  # metrics only: never hold a drain past a moment for them
            async with asyncio.timeout(2.0):
                for lane in ctx.router.lanes:
                    await lane.limits.flush()
        try:
            async with asyncio.timeout(max(5.0, ctx.options.lease_ms / 1000)):
                unsent = list(ctx.runs.left_unsent.items())  # every task has ended: these never sent their call
                released = await ctx.health.call(
                    lambda: ctx.control.release_leases(ctx.options.queue, ctx.worker_id, unsent=unsent)
                )
            log.info("drained: released %d leases (remote ids kept)", released)
        except TimeoutError:
            log.warning("drained without the job store: the leases run out instead (and count as expired)")
        await ctx.health.aclose()

    async def _ended(self, tasks: list[asyncio.Task[None]], what: str) -> None:
        """Cancelled tasks end; one that does not within `CANCEL_S` is left behind, so a drain stays bounded (its
        lease goes back with the last release or runs out, as if the worker had been killed)."""
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=CANCEL_S)
        if stuck:
            log.warning("drain: %d %s did not end within %gs of their cancel; left behind", len(stuck), what, CANCEL_S)

    async def _until_ended(self, tasks: list[asyncio.Task[None]], timeout: float) -> None:
        """Until every task of `tasks` has ended, `timeout` has passed, or the drain is cut."""
        pending = [t for t in tasks if not t.done()]
        if not pending or timeout <= 0 or self.cut.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await first_of(asyncio.wait(pending), self.cut.wait())

    async def hand_back(self, jobs: list[ClaimedJob]) -> None:
        """Draining: jobs that never sent their call go back to the queue now (uncounted, remote ids kept),
        closing the intents their leases opened, instead of at the drain's end; the jobs of one moment in one
        release. Bounded; whatever does not go through is handed back by the drain's last release."""
        if not jobs:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(5.0, self.ctx.options.lease_ms / 1000)):
                await first_of(
                    self.ctx.health.call(lambda: asyncio.gather(*(self.handbacks(job) for job in jobs))),
                    self.cut.wait(),
                )

    async def _release_unsent(self, jobs: list[ClaimedJob]) -> list[None]:
        runs = self.ctx.runs
        unsent = [(job.id, token) for job in jobs if (token := runs.unsent_token(job.id)) is not None]
        ids = [job.id for job in jobs]
        await self.ctx.control.release_leases(self.ctx.options.queue, self.ctx.worker_id, ids, unsent=unsent)
        for job_id, _ in unsent:  # closed: the last release need not send them again
            runs.close_unsent(job_id)
        return [None] * len(jobs)
