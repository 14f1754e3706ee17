"""One job's path through a dispatch worker, one method per step: resume or submit, record the remote id, wait for
the result, store it, complete.

Every store write on the way goes through `StoreHealth.call`, so a Redis outage makes the job wait where it
is instead of failing it (and charging it an attempt), and a write whose reply was lost is simply sent again:
the scripts are idempotent. A job whose last intent has no remote id (its worker died in between) is looked
up by its tag where the provider allows it, else submitted again under the same key, and counted. How each
failure ends the attempt is `_failed`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from typing import Any

import orjson

from offload import tracing
from offload.backends.base import Fatal, NotFound, RemoteResult, Throttled, Transient
from offload.connection import is_outage
from offload.errors import StaleLease
from offload.models import ClaimedJob
from offload.queue.replies import Verdict
from offload.queue.store import CompleteItem
from offload.storage import InvalidKey, StorageError, validate_key
from offload.storage.outputs import FileRefused
from offload.worker.budget import fits
from offload.worker.context import WorkerContext
from offload.worker.drain import Drain
from offload.worker.endings import Endings
from offload.worker.health import describe
from offload.worker.job_run import Drained, JobRun, Unrecorded
from offload.worker.lag import Sighting
from offload.worker.packing import Packer
from offload.worker.polling import Polling, PollTimeout
from offload.worker.slots import Slot, Slots
from offload.worker.submit import Submitter, detail

log = logging.getLogger("offload.worker")
THROTTLED_WAIT_S = 5.0  # a 429 without Retry-After: the backend cools down this long


def measured(result: RemoteResult, waited_s: float, submitted: bool) -> tuple[float, float | None]:
    """A finished run's (run time, queue delay) for its backend's means: as the provider reports them, else from
    how long the result took since the submit's answer (`waited_s`): the run time all of it, or what the run did
    not take the queue delay. A run this worker resumed (not `submitted`) was waited on for only part of its
    time: its queue delay is not measured unless reported."""
    run_s = result.duration_s or waited_s
    if result.queue_s is not None:
        return run_s, result.queue_s
    return run_s, max(waited_s - run_s, 0.0) if submitted and result.duration_s else None


def _key_problem(key: str) -> str | None:
    try:
        validate_key(key)
    except InvalidKey as exc:
        return str(exc)
    return None


class JobPath:
    """Runs one job's attempt (`run_job`, one task per lease) with the worker's collaborators."""

    def __init__(
        self,
        ctx: WorkerContext,
        slots: Slots,
        submitter: Submitter,
        polling: Polling,
        endings: Endings,
        drain: Drain,
        packers: dict[str, Packer] | None = None,
    ) -> None:
        self.ctx, self.slots, self.submitter, self.polling = ctx, slots, submitter, polling
        self.endings, self.drain = endings, drain
        self.packers = packers or {}  # the batch backends' packers, by lane name

    async def run_job(self, run: JobRun, after: asyncio.Task[None] | None = None) -> None:
        """The task of one lease: waits for an older task of the same job (`after`) to end, then runs it."""
        job = run.job  # (named: a lease's task is found by its `job`)
        try:
            if after is not None:
                await asyncio.wait([after])
            run.previous = None
            if tracing.active():
                await self._trace(run)
            await self._attempt(run)
        except StaleLease:
            log.info("job %s: lease taken over, leaving it to its new owner", job.id)
            if run.trace is not None:
                run.trace.outcome("lease_lost")
        except Drained:
            if run.trace is not None:
                run.trace.outcome("handed_back")
            if self.ctx.runs.newest(run):
                run.settling = True
                await self.drain.hand_back([job])
        except Exception as exc:
            await self._failed(run, exc)
        finally:
            self.ctx.runs.end(run, draining=self.ctx.draining)
            self.slots.room.set()
            if run.trace is not None:  # (an exception still in flight here: the task was cancelled)
                run.trace.end(run.lane.name if run.lane is not None else None, run.remote_id, sys.exc_info()[1])

    async def _trace(self, run: JobRun) -> None:
        """The attempt's span, under the enqueue span its record names. A record whose traceparent cannot be read
        (or parsed: whoever enqueued wrote it) runs all the same, in a fresh trace."""
        job = run.job
        try:
            parent = await self.ctx.health.call(lambda: self.ctx.writes.traceparents(job.id))
        except Exception as exc:
            log.debug("job %s: its traceparent could not be read (%s); a fresh trace", job.id, describe(exc))
            parent = None
        run.trace = tracing.start_attempt(self.ctx.options.queue, job.id, job.attempt, parent)

    async def _attempt(self, run: JobRun) -> None:
        job = run.job
        run.lane = self.ctx.router.resumed(job)  # its remote job's (or open intent's) backend, else the first
        try:
            job_input = job.input
        except orjson.JSONDecodeError as exc:
            await self.endings.fail(run, f"fatal: the job input is not valid JSON: {exc}", retryable=False)
            return
        run.remote_id = job.remote_id  # set before the cancel: a failed cancel call keeps it (the retry cancels)
        if job.cancel_requested:  # its remote job is cancelled first (cancel.lua)
            if run.remote_id is None and job.intent_open:  # a submission of unknown outcome: found by its tag
                run.remote_id = await self.submitter.adopt(run)
            await self.endings.cancel(run, run.remote_id)
            return
        if problem := _key_problem(job.output_key):  # before paying for a result that cannot be stored
            await self.endings.fail(run, f"output_key cannot be stored: {problem}", retryable=False)
            return
        # a fresh submission only: a remote job, or an intent that may have reached the provider, is paid already
        if run.remote_id is None and not job.intent_open and (over := self._over_budget(job)):
            await self.endings.fail(run, over, retryable=False, answered=job.begun)  # nothing was sent
            return
        run.submission = job.submission or 1
        result = await self._remote_work(run, job_input)
        if result is not None:
            await self.finish(run, result)

    def _over_budget(self, job: ClaimedJob) -> str | None:
        """Why the job's max_cost refuses it: its one backend's price, or on a routed queue every backend's (the
        route skips only those that may cost more, worker/job_limits.py)."""
        if self.ctx.router.routed:
            return self.ctx.router.over_budget(job)
        opts = self.ctx.options
        return fits(job, opts, poll_timeout=opts.poll_timeout)

    async def _remote_work(self, run: JobRun, job_input: Any) -> RemoteResult | None:
        """One of the `concurrency` slots while the job is at the provider: taken at its first remote step (a
        fresh submission takes it after its begin script, see submit.py), given back when the remote work ends;
        the store writes after it (output, ack) run outside the slot. None: the job has moved on (held,
        cancelled, failed, or a drain past its grace left it to the next owner)."""
        if (packer := await self._packer(run)) is not None:  # a batch backend: packed, no slot (worker/packing.py)
            return await packer.run(run, job_input)
        lag = self.polling.sighting(run)  # a resumed remote job: not seen yet, its grace from the store's submit time
        slot = run.slot = Slot(self.slots, run)
        try:
            started, result = await self._remote_job(run, job_input, lag)
            if not started:
                return None
            if result is None:
                result = await self._wait_result(run, slot, lag)
            return result
        finally:
            slot.give_back()

    async def _packer(self, run: JobRun) -> Packer | None:
        """The packer of the run's lane, if it is a batch backend. With batch lanes on a routed queue, a job free
        to route is routed now (not at its submit): a batch lane's jobs take the packer's path."""
        if not self.packers:
            return None
        job, router = run.job, self.ctx.router
        if router.routed and run.remote_id is None and not job.intent_open and router.pinned(job) is None:
            await self.submitter.route(run)
            run.prerouted = True
        return self.packers.get(run.on.name)

    async def _remote_job(self, run: JobRun, job_input: Any, lag: Sighting) -> tuple[bool, RemoteResult | None]:
        """The run's remote job, found or submitted: (whether it has one, the answer of a synchronous API)."""
        job, slot = run.job, run.slot
        assert slot is not None
        run.sent_at = time.monotonic()  # (a resumed remote job: its run time from here, a lower bound)
        if run.remote_id is None and job.intent_open and run.on.hooks and run.on.hook_grace_s > 0:
            await slot.take()
            await self._adopt(run, await self.polling.await_hook(run), lag)  # its webhook may name the remote job
        if run.remote_id is not None:
            return True, None
        if job.intent_open:
            await slot.take()  # the provider is asked for the job by its tag
            if await self._adopt(run, await self.submitter.adopt(run), lag):
                return True, None  # named by a listing: a status read may lag it still
        if self.submitter.gate is not None:
            # an asynchronous API: slot, then gate, then begin, as a job holding a slot may wait for the gate
            # again (after a 429), so one holding the gate must never wait for a slot
            await slot.take()
        started = await self.submitter.submit(run, job_input)
        if started is None:
            return False, None  # held, cancelled or failed: the job has moved on
        run.remote_id, run.submission = started.remote_id, started.submission
        run.submitted = True  # (its `sent_at` set right before the call: a synchronous API's run is inside it)
        run.unrecorded = run.answered = started.result is not None
        lag.submitted()
        return True, started.result

    async def _adopt(self, run: JobRun, found: str | None, lag: Sighting) -> bool:
        """A remote job found for a submission of unknown outcome (its webhook, or the provider's listing):
        recorded, and polled instead of paid for again."""
        if not found:
            return False
        run.remote_id = await self.submitter.record_known(run, found, run.submission)
        lag.submitted()
        return True

    async def _wait_result(self, run: JobRun, slot: Slot, lag: Sighting) -> RemoteResult | None:
        """The result of the recorded remote job (None: cancelled, or a drain past its grace: the next owner
        polls it)."""
        if self.ctx.grace_over:
            return None
        if not slot.take_now():
            await slot.take()
        assert run.remote_id is not None
        if run.on.hooks:
            return await self.polling.poll_hooked(run, run.remote_id, lag)
        return await self.polling.poll(run, run.remote_id, lag)

    async def finish(self, run: JobRun, result: RemoteResult) -> None:
        """Store the output and ack. A synchronous answer (`unrecorded`) is recorded by the ack."""
        job, lane = run.job, run.on
        unrecorded = run.remote_id if run.unrecorded else None
        if result.status != "succeeded":
            if unrecorded is not None:  # recorded, so that the next try is a new submission (a new key)
                await self.submitter.record(run, unrecorded, run.submission)
            error = f"remote job {result.status}: {result.error or 'no error given'}"
            await self.endings.retry(run, error, keep_remote=False, cost=lane.cost(result))
            return
        if lane.health is not None:
            with contextlib.suppress(Exception):  # the price model and expected finish: never fails the job
                await lane.answered(*measured(result, time.monotonic() - run.sent_at, run.submitted))
        with tracing.call(run.trace, "store", submission=run.submission) as span:
            location = await self.endings.store(run, result.output)
            span.set(tracing.LOCATION, location.split("?", 1)[0])  # (a location, never a signed URL's query)
        run.settling = True
        item: CompleteItem = (job.id, job.token, location, lane.cost(result))
        if unrecorded is not None:
            item = (*item, lane.name, unrecorded, run.submission)
        code = await self.ctx.health.call(lambda: self.ctx.writes.completes(item))
        if code is not Verdict.OK:
            raise StaleLease(f"job {job.id}: lease lost before it could be completed ({code})")
        if run.trace is not None:
            run.trace.outcome("succeeded")

    async def _failed(self, run: JobRun, exc: Exception) -> None:
        """How an attempt that raised ends: a provider's failure is retried or failed; the rest in `_broken`."""
        kept = run.remote_id is not None
        if isinstance(exc, Throttled):
            wait = exc.retry_after or THROTTLED_WAIT_S
            await self.ctx.health.call(functools.partial(run.on.limits.cool_down, wait))
            error = f"throttled: {exc}"
            answered = not run.unsettled  # a 429 to a resend says nothing of the first try (worker/routing.py)
            await self.endings.retry(run, error, keep_remote=kept, delay_ms=int(wait * 1000), answered=answered)
        elif isinstance(exc, NotFound):
            await self.endings.retry(run, f"remote result expired: {exc}", keep_remote=False)
        elif isinstance(exc, PollTimeout) and run.remote_id:
            await self.endings.timed_out(run, run.remote_id, exc)  # a new run only once this one is cancelled
        elif isinstance(exc, Transient | PollTimeout):
            error = f"{type(exc).__name__.lower()}: {exc}"
            await self.endings.retry(run, error, keep_remote=kept and not isinstance(exc, PollTimeout))
        elif isinstance(exc, Fatal):
            await self.endings.fail(run, f"fatal: {exc}{detail(exc)}", retryable=False)
        else:
            await self._broken(run, exc)

    async def _broken(self, run: JobRun, exc: Exception) -> None:
        """Storing failed, the store went away, or a bug."""
        job, answered = run.job, run.unrecorded
        if isinstance(exc, FileRefused):  # the egress rule refuses a file of this output: another run would be too
            await self.endings.fail(run, f"storing the output failed: {exc}", retryable=False, answered=answered)
        elif isinstance(exc, StorageError):  # the remote job finished: keep its id so the retry re-polls, not
            # re-pays, unless the failure cannot heal (e.g. a provider file already expired): then it runs again
            keep = run.remote_id is not None and not getattr(exc, "permanent", False)
            await self.endings.retry(run, f"storing the output failed: {exc}", keep_remote=keep, answered=answered)
        elif is_outage(exc):  # a store call outside the retried writes: the lease is handed back, uncounted
            log.warning("job %s: job store unreachable (%s); the job goes back to the queue", job.id, describe(exc))
        else:
            # A bug or garbage must dead-letter the job, never kill the worker. A recorded remote id is kept: the
            # retry resumes the paid-for remote job instead of submitting again.
            log.exception("job %s: unexpected error", job.id, exc_info=exc)
            cause = exc.__cause__ if isinstance(exc, Unrecorded) and exc.__cause__ is not None else exc
            await self.endings.fail(
                run,
                f"worker error: {type(cause).__name__}: {cause}",
                retryable=True,
                keep_remote=run.remote_id is not None or isinstance(exc, Unrecorded),
                answered=answered,
            )
