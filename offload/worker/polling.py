"""Waiting for a remote job's result: polling the provider, or, with webhooks on, the final webhook the server kept.

With webhooks on (`WorkerOptions.hook_base`), a job's result comes from the final webhook the server kept in the
job record (hook.lua), read when the worker's subscription wakes the job (wakeups.py) and once up front; the
provider is polled only every `hook_poll_interval`, so a webhook that never comes cannot strand the job. And a
job whose last submission's outcome is unknown waits `hook_grace_s` for that submission's webhook before paying
for it again. Without webhooks the provider is polled, the pause doubling from `first_poll` to `poll_interval`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

import orjson

from offload import tracing
from offload.backends.base import NotFound, RemoteResult, Throttled, Transient, WebhookBackend
from offload.backoff import compute_backoff
from offload.errors import StaleLease, WorkerError
from offload.eventloop import within
from offload.worker.context import WorkerContext
from offload.worker.endings import Endings
from offload.worker.job_run import JobRun
from offload.worker.lag import Sighting

log = logging.getLogger("offload.worker")
TRANSIENT_POLLS = 10  # transient poll failures in a row that fail the attempt


class PollTimeout(WorkerError):
    """The remote job did not finish within `poll_timeout`."""


class Polling:
    """The wait for a remote job's result (and, before a resend, for a lost submission's webhook)."""

    def __init__(self, ctx: WorkerContext, endings: Endings) -> None:
        self.ctx, self.endings = ctx, endings

    def sighting(self, run: JobRun) -> Sighting:
        """A remote job's sighting (worker/lag.py), with the grace bounded by `poll_timeout`."""
        return Sighting(min(run.on.not_found_grace_s, self.ctx.options.poll_timeout))

    async def await_hook(self, run: JobRun) -> str | None:
        """The run's submission may have reached the provider (its worker died inside the submit call): wait up
        to the grace for its webhook, which records its remote id (hook.lua), instead of paying again.
        Replicate's `start` usually recorded it before this job was even re-claimed (then the claim carries the
        id and nothing waits here); this wait is for a late `start` (woken by hook.lua's PUBLISH) or, on
        providers that call only on completion, for that."""
        job, submission = run.job, run.submission
        heard = run.hook_event()
        deadline = time.monotonic() + run.on.hook_grace_s
        while True:
            heard.clear()
            remote_id, current = await self.ctx.health.call(lambda: self.ctx.store.current_remote(job.id))
            if current != submission:
                raise StaleLease(f"job {job.id}: submission {submission} is no longer current ({current})")
            if remote_id is not None:
                log.info("job %s: submission %d adopted from its webhook; not submitted again", job.id, submission)
                return remote_id
            left = deadline - time.monotonic()
            if left <= 0 or run.cancel:
                return None
            with contextlib.suppress(TimeoutError):
                await within(heard.wait(), left)

    def lagging(self, run: JobRun, exc: NotFound, lag: Sighting) -> bool:
        """Whether `exc`, a 404 for the job's remote job, is the provider's status lagging its submit (poll on)
        rather than expiry. A NotFound that is no 404 (a result the provider said it removed) is expiry."""
        if exc.status != 404:
            return False
        lagging = lag.lagging()
        if lagging:
            log.debug("job %s: its remote job is not found yet; taken for a status that lags the submit", run.job.id)
        return lagging

    async def poll(self, run: JobRun, remote_id: str, lag: Sighting) -> RemoteResult | None:
        """The provider polled until the result is terminal (None: the job was cancelled meanwhile)."""
        opts, lane = self.ctx.options, run.on
        deadline = time.monotonic() + opts.poll_timeout
        interval = opts.first_poll
        polls = transient = 0
        while True:
            if run.cancel:
                await self.endings.cancel(run, remote_id)
                return None
            wait = interval
            try:
                with tracing.call(run.trace, "poll", backend=lane.name, remote_id=remote_id):
                    result = await lane.backend.poll(remote_id)
                transient = 0
                lag.seen = True
                if result.terminal:
                    return result
            except NotFound as exc:
                if not self.lagging(run, exc, lag):
                    raise
            except Throttled as exc:
                lane.limits.note("throttled")
                wait = exc.retry_after or interval
                await self.ctx.health.call(functools.partial(lane.limits.cool_down, wait))
                await self.ctx.health.call(functools.partial(lane.failed, exc))
            except Transient as exc:
                transient += 1
                await self.ctx.health.call(functools.partial(lane.failed, exc))
                if self._too_many(run, transient):
                    raise
            if time.monotonic() > deadline:  # also when every poll is throttled: the timeout bounds the job
                raise PollTimeout(f"remote job {remote_id} not done after {opts.poll_timeout:g}s")
            await asyncio.sleep(wait)
            polls += 1  # doubling: few wasted polls on long GPU jobs
            interval = compute_backoff(polls + 1, base=opts.first_poll, cap=opts.poll_interval)

    def _too_many(self, run: JobRun, in_a_row: int) -> bool:
        """A transient poll failure, noted: whether too many came in a row (the attempt then fails)."""
        run.on.limits.note("errors")
        return in_a_row >= TRANSIENT_POLLS

    async def poll_hooked(self, run: JobRun, remote_id: str, lag: Sighting) -> RemoteResult | None:
        """With webhooks on: the result comes from the webhook the server kept, taken from the wake-up or read at
        once when woken, and read once up front (it may have come before this task, or before this worker
        claimed the job); the provider is polled only every `hook_poll_interval`, so a webhook that never comes
        cannot strand the job, and at once when the kept body lacks the result (fal's `payload_error`)."""
        opts = self.ctx.options
        heard = run.hook_event()
        deadline = time.monotonic() + opts.poll_timeout
        fallback = _Fallback(time.monotonic() + run.on.hook_poll_interval)
        while True:
            if run.cancel:
                await self.endings.cancel(run, remote_id)
                return None
            heard.clear()
            result = await self._kept_result(run, fallback)
            if result is None and time.monotonic() >= fallback.next_poll:
                result = await self._fallback_poll(run, remote_id, lag, fallback)
            if result is not None:
                return result
            now = time.monotonic()
            if now > deadline:
                raise PollTimeout(f"remote job {remote_id} not done after {opts.poll_timeout:g}s")
            with contextlib.suppress(TimeoutError):
                await within(heard.wait(), max(0.0, min(fallback.next_poll, deadline) - now))

    async def _kept_result(self, run: JobRun, fallback: _Fallback) -> RemoteResult | None:
        """The result of the final webhook the server kept, if one is kept (a body without it: poll now)."""
        hooks = run.on.hooks
        assert hooks is not None
        job_id, submission = run.job.id, run.submission
        carried, run.heard = run.heard, None
        if carried is not None and carried[0] == submission:
            body: str | None = carried[1]  # the wake-up brought it: no read (wakeups.py)
        else:  # batched: a burst wakes many
            body = await self.ctx.health.call(lambda: self.ctx.writes.hook_bodies((job_id, submission)))
        if body is None:
            return None
        kept = _kept(hooks, body)
        if kept is None:
            fallback.next_poll = min(fallback.next_poll, time.monotonic())
        elif run.trace is not None:  # the final webhook the server kept carries the result
            run.trace.mark("webhook", backend=run.on.name, remote_id=run.remote_id, submission=submission)
        return kept

    async def _fallback_poll(
        self, run: JobRun, remote_id: str, lag: Sighting, fallback: _Fallback
    ) -> RemoteResult | None:
        """The provider polled once, as a webhook may never come: the result if it is terminal."""
        opts, lane = self.ctx.options, run.on
        fallback.next_poll = time.monotonic() + lane.hook_poll_interval
        soon = min(opts.poll_interval, lane.hook_poll_interval)
        try:
            with tracing.call(run.trace, "poll", backend=lane.name, remote_id=remote_id):
                result = await lane.backend.poll(remote_id)
            fallback.transient = 0
            lag.seen = True
            if result.terminal:
                return result
        except NotFound as exc:
            if not self.lagging(run, exc, lag):
                raise
            fallback.next_poll = time.monotonic() + soon
        except Throttled as exc:
            lane.limits.note("throttled")
            await self.ctx.health.call(functools.partial(lane.limits.cool_down, exc.retry_after or 5.0))
            await self.ctx.health.call(functools.partial(lane.failed, exc))
        except Transient as exc:
            fallback.transient += 1
            await self.ctx.health.call(functools.partial(lane.failed, exc))
            if self._too_many(run, fallback.transient):
                raise
            fallback.next_poll = time.monotonic() + soon
        return None


class _Fallback:
    """When a hooked wait polls the provider next, and its transient failures in a row."""

    __slots__ = ("next_poll", "transient")

    def __init__(self, next_poll: float) -> None:
        self.next_poll, self.transient = next_poll, 0


def _kept(hooks: WebhookBackend, body: str) -> RemoteResult | None:
    """The result a kept final webhook body carries, or None (unreadable, or without the result)."""
    try:
        result = hooks.hook_result(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None
    return result if result is not None and result.terminal else None
