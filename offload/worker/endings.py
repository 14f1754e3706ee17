"""How a job's attempt ends in the store: its output written (fenced), retried, failed or dead, or cancelled.

The last writes of every path through a job (jobpath.py), kept apart from the path itself: each goes through
`StoreHealth.call`, so an outage makes the job wait where it is, and a lease lost meanwhile is someone else's job
now, never an error of this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from offload import tracing
from offload.backends.base import BackendError, NotFound
from offload.backoff import compute_backoff, retry_delay_ms
from offload.errors import StaleLease
from offload.queue.replies import Verdict
from offload.storage import ClockRefused, StorageError
from offload.worker.context import WorkerContext
from offload.worker.job_run import JobRun

log = logging.getLogger("offload.worker")
# Storing an output waits this long after its first failure, doubling up to STORE_PAUSE_MAX_S.
STORE_PAUSE_S = 0.5
STORE_PAUSE_MAX_S = 30.0


class Endings:
    """The store writes that end a job's attempt."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    async def store(self, run: JobRun, output: Any) -> str:
        """Store the output. Object storage (our own infrastructure, like Redis) failing for a while costs the
        job nothing: it keeps its lease and its finished remote result and tries again, up to `poll_timeout`;
        only then (or for a failure that cannot heal, like an expired provider file) is the attempt given up."""
        job = run.job
        deadline = time.monotonic() + self.ctx.options.poll_timeout
        failures = 0
        while True:
            try:
                return await self.ctx.store_output(job.output_key, output, str(run.submission), lambda: self.fence(run))
            except StorageError as exc:
                if isinstance(exc, ClockRefused):  # no new payment until the storage takes this host's clock
                    self.ctx.storage_gate.refused(exc)
                failures += 1
                pause = compute_backoff(failures, base=STORE_PAUSE_S, cap=STORE_PAUSE_MAX_S)
                if exc.permanent or time.monotonic() + pause > deadline:
                    raise
                log.warning("job %s: storing the output failed (%s), trying again in %.1fs", job.id, exc, pause)
                await asyncio.sleep(pause)

    async def fence(self, run: JobRun) -> None:
        """Right before the output is written: a worker whose lease was taken over must not overwrite what the
        job's new owner stores (perhaps from a newer remote run)."""
        job = run.job
        code = await self.ctx.health.call(lambda: self.ctx.writes.fences((job.id, job.token)))
        if code is not Verdict.OK:
            raise StaleLease(f"job {job.id}: lease lost before its output was written ({code})")

    async def cancel(self, run: JobRun, remote_id: str | None, *, unsent: bool = False) -> None:
        """The job ends cancelled, its remote job (if any) cancelled first. `unsent`: its submission was begun
        and never sent (the cap reservation is given back)."""
        job = run.job
        if remote_id:
            with contextlib.suppress(NotFound), tracing.call(run.trace, "cancel", remote_id=remote_id):
                if not await run.on.backend.cancel(remote_id):
                    log.warning(
                        "job %s: the backend cannot cancel remote job %s: it runs to its end", job.id, remote_id
                    )
        run.settling = True
        await self.ctx.health.call(lambda: self.ctx.store.ack_cancel(job.id, job.token, unsent=unsent))
        if run.trace is not None:
            run.trace.outcome("cancelled")

    async def timed_out(self, run: JobRun, remote_id: str, timeout: Exception) -> None:
        """`poll_timeout` passed with the remote job still running. A new run is submitted only once the provider
        took the cancel of this one: a backend that cannot cancel ends the job dead (or, with
        `resubmit_on_timeout`, pays for a second run, counted), and a cancel that failed keeps the remote job for
        the retry to poll again. Either way nothing is paid twice unseen."""
        waited = f"remote job {remote_id} still running after {self.ctx.options.poll_timeout:g}s"
        try:
            with tracing.call(run.trace, "cancel", remote_id=remote_id):
                stopped = await run.on.backend.cancel(remote_id)
        except BackendError as exc:
            reason = f"{waited}; its cancel failed ({exc}), so it is kept (a retry polls it), not submitted again"
            await self.retry(run, f"polltimeout: {reason}", keep_remote=True)
            return
        if stopped:
            await self.retry(run, f"polltimeout: {timeout}; cancelled at the provider", keep_remote=False)
        elif run.on.resubmit_on_timeout:
            reason = f"{waited}; this backend cannot cancel it: submitted again (resubmit_on_timeout, counted)"
            await self.fail(run, f"polltimeout: {reason}", retryable=True, duplicate=True)
        else:
            reason = f"{waited}; this backend cannot cancel it, so it is not submitted again"
            await self.fail(run, f"polltimeout: {reason}", retryable=False, keep_remote=True)

    async def retry(
        self,
        run: JobRun,
        error: str,
        *,
        keep_remote: bool,
        delay_ms: int | None = None,
        cost: float | None = None,
        answered: bool = False,
    ) -> None:
        await self.fail(
            run, error, retryable=True, keep_remote=keep_remote, delay_ms=delay_ms, cost=cost, answered=answered
        )

    async def fail(
        self,
        run: JobRun,
        error: str,
        *,
        retryable: bool,
        keep_remote: bool = False,
        delay_ms: int | None = None,
        answered: bool = False,
        cost: float | None = None,
        refund: bool = False,
        duplicate: bool = False,
        returned: bool = False,
    ) -> None:
        job = run.job
        delay = delay_ms if delay_ms is not None else retry_delay_ms(job.attempt)
        run.settling = True
        try:
            state = await self.ctx.health.call(
                lambda: self.ctx.store.fail(
                    job.id,
                    job.token,
                    error,
                    retryable=retryable,
                    keep_remote=keep_remote,
                    delay_ms=delay,
                    attempt=job.attempt,
                    answered=answered,
                    cost=cost,
                    refund=refund,
                    duplicate=duplicate,
                    returned=returned,
                )
            )
        except StaleLease:
            if run.trace is not None:
                run.trace.outcome("lease_lost", error)
            return
        if run.trace is not None:
            run.trace.outcome(state, error)  # the job's state now: queued or delayed again, dead, failed
        log.info("job %s: %s -> %s", job.id, error[:200], state)
