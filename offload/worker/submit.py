"""Submitting a job that has no remote job, one method per step: rate limit, gate, intent, slot, call, record.

The submit is framed as tightly as the design allows: the submit intent (with the cancel check, the lease check
and the cap reservation) is recorded in one script right before the request, the request carries
`Idempotency-Key: <job id>.<submission number>`, and the remote id is recorded the moment the answer is in.

For a synchronous API (no submit gate) the begin script runs before the job takes its slot (see
docs/explanation/architecture.md, *Slots*): its round trip is spent while the slot is still busy with another
job, not inside this one's. Between the begin and the call the job is unsent (a drain closes its intent: nothing
was sent) and, once it has its slot, the cancels heard of since the begin are checked right before the call. A
job the claim has begun (`job.begun`: a synchronous API without a rate limit or caps, see claim.lua) starts with
its intent open and skips the begin of its first try.

Once the worker drains, no call is sent: a job at the rate limit, the gate or its slot, or pausing before a
resend, raises `Drained` (the drain cancels those waits), and so does one whose begin or slot came after the
drain began, checked right before the call, with nothing awaited in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from offload import tracing
from offload.backends.base import BackendError, Fatal, RemoteResult, Submission, Throttled
from offload.backoff import compute_backoff
from offload.errors import StaleLease
from offload.queue.keyspace import hook_digest
from offload.queue.replies import Begun, Verdict
from offload.worker.context import WorkerContext
from offload.worker.endings import Endings
from offload.worker.health import describe
from offload.worker.job_run import Drained, JobRun, Unrecorded
from offload.worker.leases import Leases

log = logging.getLogger("offload.worker")
# A resend after a 429 without Retry-After, or after a 409, waits 1 s, doubling up to this.
RESEND_PAUSE_MAX_S = 30.0


@dataclass(frozen=True, slots=True)
class Started:
    """A remote job: its id, the result when a synchronous API answered with it, and its submission number."""

    remote_id: str
    result: RemoteResult | None
    submission: int


@dataclass(frozen=True, slots=True)
class _Again:
    """The call is sent again: answered 429 (`throttled`), or 409 (None: the key is still being served); or, with
    `moved`, begun again at the backend an earlier lease's open intent went to (begin.lua's MOVED)."""

    throttled: Throttled | None
    moved: bool = False


@dataclass(frozen=True, slots=True)
class _Hook:
    """A claim's webhook secret (a resend keeps its URL) and its hash, as begin.lua records it."""

    secret: str
    digest: str


class Submitter:
    """Submits jobs, records their remote ids (`record`, `record_known`), adopts lost submissions (`adopt`)."""

    def __init__(self, ctx: WorkerContext, leases: Leases, endings: Endings) -> None:
        self.ctx, self.leases, self.endings = ctx, leases, endings
        # Each submission between its intent and its recorded remote id is one a kill would leave unknown: a
        # bounded number of them at a time bounds what one kill can cost (not for synchronous APIs, whose
        # submit is the whole job).
        self.gate = None if ctx.backend.synchronous else asyncio.Semaphore(ctx.options.submit_concurrency)

    async def adopt(self, run: JobRun) -> str | None:
        """A job whose last submit intent has no remote id may have been submitted by a worker that died (or
        lost its lease) inside the submit call; backends that tag submissions can find it, so we poll it
        instead of paying again. Called for such a job only (`job.intent_open`)."""
        with contextlib.suppress(BackendError), tracing.call(run.trace, "find", backend=run.on.name) as span:
            found = await run.on.backend.find(run.job.id)
            span.set(tracing.REMOTE_ID, found)
            return found
        return None

    async def submit(self, run: JobRun, job_input: Any) -> Started | None:
        """Submit a job that has no remote job, or None when it went elsewhere (held over a cap, cancelled,
        failed)."""
        retries = self.ctx.options.submit_retries_on_429
        hooks: dict[str, _Hook] = {}  # one secret per claim and backend: a resend keeps its URL
        inputs: dict[str, Any] = {}  # the job input as each backend takes it
        pinned = self.ctx.router.pinned(run.job) is not None  # an earlier submission settles there, nowhere else
        attempt = 0
        while attempt <= retries:
            begun = run.job.begun and attempt == 0
            prerouted = run.prerouted and attempt == 0  # (routed already: see JobPath._packer)
            if not pinned and self.ctx.router.routed and not prerouted:  # (one backend: its lane set at the claim)
                await self.route(run)
            lane = run.on
            if lane.name not in inputs:
                try:
                    inputs[lane.name] = lane.job_input(job_input)
                except Exception as exc:  # the queue's mapping refuses this job's input: the job's fault, not the
                    # worker's, and the same at every try; nothing was sent (an intent the claim opened is closed)
                    error = f"fatal: the input mapping of backend {lane.name} failed: {type(exc).__name__}: {exc}"
                    await self.endings.fail(run, error, retryable=False, answered=begun or run.unsent is not None)
                    return None
            if lane.hooks is not None and lane.name not in hooks:
                secret = secrets.token_urlsafe(24)
                hooks[lane.name] = _Hook(secret, hook_digest(lane.name, secret))
            await self._before_gate(run, begun)
            outcome = await self._gated(run, inputs[lane.name], hooks.get(lane.name), attempt)
            if not isinstance(outcome, _Again):
                return outcome
            if outcome.moved:  # begun again where the open intent went (not a try: nothing was sent)
                pinned = True
                continue
            pinned = pinned or outcome.throttled is None  # a 409: that backend still serves the key
            await self._pause(run, attempt, outcome)
            attempt += 1
        raise AssertionError("unreachable")

    @staticmethod
    def _closable(run: JobRun) -> str | None:
        """The token a drain may close this run's unsent intent with: none for a resend of a submission of unknown
        outcome on a routed queue, whose first try may run at that backend (closed, the job could go to another)."""
        return None if run.unsettled else run.job.token

    async def route(self, run: JobRun) -> None:
        """The backend of the next submission (worker/routing.py); a wait for one to reopen is one a drain ends."""
        router, job = self.ctx.router, run.job
        choice = await router.choose(job, lambda s: self.ctx.wait_ahead(job, asyncio.sleep(s)))
        # a move past a cooling backend, or a probe, is news; the route's everyday choice is not
        log.log(
            logging.INFO if choice.reason in ("fallback", "probe") else logging.DEBUG, "job %s: %s", job.id, choice.why
        )
        choice.lane.limits.note(f"route:{choice.reason}")
        run.lane, run.why = choice.lane, choice.why

    async def _before_gate(self, run: JobRun, begun: bool) -> None:
        """Before each try (the first, and every resend after a 429 or a 409): not once draining; the lease
        proven fresh; the rate limit waited for."""
        if self.ctx.draining:
            raise Drained(run.job.id)
        if not self.ctx.storage_gate.open:  # this host's clock refused by the storage: its output could not be kept
            await self.ctx.wait_ahead(run.job, self.ctx.storage_gate.wait_open())
        if not begun and self.leases.stale(run):
            await self.leases.renew()
        if not run.on.limits.free_now():  # (checked here too: a call less per job on the common path)
            # may wait long: the intent (with the cancel check) comes after; a drain ends the wait
            await self.ctx.wait_ahead(run.job, self._acquire(run))

    async def _gated(self, run: JobRun, job_input: Any, hook: _Hook | None, attempt: int) -> Started | _Again | None:
        """One try inside the submit gate. The gate by hand, not `async with`: a synchronous API has none, and
        the context manager cost it two coroutines per job. Only a wait for it is one a drain can end."""
        gate = self.gate
        if gate is not None:
            await (self.ctx.wait_ahead(run.job, gate.acquire()) if gate.locked() else gate.acquire())
        try:
            return await self._begin_and_send(run, job_input, hook, attempt)
        finally:
            if gate is not None:
                gate.release()

    async def _begin_and_send(
        self, run: JobRun, job_input: Any, hook: _Hook | None, attempt: int
    ) -> Started | _Again | None:
        job = run.job
        if not self.ctx.policy.current:  # the store may evict: no new payment until it is fixed (queue/memory.py)
            await self.ctx.wait_ahead(job, self.ctx.policy.confirm())  # a drain hands the job back
        if job.begun and attempt == 0:  # the claim opened this intent: no verdict to read
            submission, duplicate = job.submission, False
        else:
            digest = hook.digest if hook is not None else ""
            item = (job.id, job.token, digest, run.on.name, run.why)
            verdict = await self.ctx.health.call(lambda: self.ctx.writes.begins(item))
            if verdict.verdict is not Verdict.OK:
                return await self._not_begun(run, verdict)
            submission, duplicate = verdict.submission, verdict.duplicate
        run.unsettled = run.unsettled or (duplicate and self.ctx.router.routed)
        run.unsent = self._closable(run)
        if not await self._ready_to_send(run):
            return None
        if duplicate:
            log.warning(
                "job %s: submission %d may have reached the provider already (its outcome is unknown: a worker "
                "lost inside the call, or no answer that says); sending it again with the same Idempotency-Key",
                job.id,
                submission,
            )
        return await self._send(run, job_input, hook, submission, attempt)

    async def _ready_to_send(self, run: JobRun) -> bool:
        """The intent is open: take the slot and check, right before the call, what may have changed while the
        begin or the slot waited. False: cancelled meanwhile (not sent)."""
        slot = run.slot
        assert slot is not None
        if not slot.take_now():
            await slot.take()
        if run.cancel:  # heard of since the begin (a heartbeat): not sent
            closable, run.unsent = run.unsent is not None, None
            await self.endings.cancel(run, None, unsent=closable)
            return False
        if not self.ctx.policy.current:  # again: the begin or the slot may have waited meanwhile
            await self.ctx.wait_ahead(run.job, self.ctx.policy.confirm())
        if self.leases.stale(run):  # only if this process stalled since its last proof of life
            await self.leases.renew()
        if self.ctx.draining:  # since the begin or the slot: not sent, its intent closed by the release
            raise Drained(run.job.id)
        return True

    async def _send(
        self, run: JobRun, job_input: Any, hook: _Hook | None, submission: int, attempt: int
    ) -> Started | _Again | None:
        """The call itself; its answer recorded while the run still counts as calling (a lost lease now must
        not throw the answer away, see `record`)."""
        job, retries, lane = run.job, self.ctx.options.submit_retries_on_429, run.on
        run.unsent = None
        run.submitting = True
        run.sent_at = time.monotonic()  # the run time and queue delay a routed queue measures count from here
        try:
            key, sent = f"{job.id}.{submission}", job_input  # (mapped for this lane by `submit`)
            with tracing.call(run.trace, "submit", backend=lane.name, submission=submission) as span:
                if hook is not None and lane.hooks is not None:
                    url = f"{lane.hook_base}/{quote(job.id, safe='')}/{submission}/{hook.secret}"
                    answer = await lane.hooks.submit(sent, tag=job.id, idempotency_key=key, webhook=url)
                else:
                    answer = await lane.backend.submit(sent, tag=job.id, idempotency_key=key)
                span.set(tracing.REMOTE_ID, answer.remote_id)
        except Throttled as exc:
            lane.limits.note("throttled")
            await self.ctx.health.call(functools.partial(lane.failed, exc))
            if attempt == retries:
                raise
            run.unsent = self._closable(run)  # answered 429, nothing accepted: unsent until sent again
            return _Again(exc)
        except BackendError as exc:
            if exc.status == 409 and attempt < retries:
                # 409 to a request carrying an Idempotency-Key: the provider is still serving an earlier request
                # under the same key (this submission, sent by a worker lost inside the call). Nothing failed:
                # wait inside this attempt and send again under the same key.
                return _Again(None)
            return await self._submit_error(run, exc, submission)
        else:
            return await self._accepted(run, answer, submission)
        finally:
            run.submitting = False

    async def _accepted(self, run: JobRun, answer: Submission, submission: int) -> Started:
        """A remote job is recorded before it is polled. A synchronous answer carries the result: its submission
        is recorded by the ack itself (one write, not two), or closed by the failure that follows; a worker lost
        in between leaves the intent open, and the next attempt submits again under the same key, counted as a
        possible duplicate (there is nothing to resume)."""
        remote = answer.remote_id
        if answer.result is None:
            remote = await self.record_known(run, answer.remote_id, submission)
        run.on.limits.note("submitted")  # after the checkpoint: the window before it stays small
        if run.on.health is not None:  # a half-open backend's probe answered: it closes
            await self.ctx.health.call(run.on.answered)
        if not self.ctx.runs.newest(run):
            raise StaleLease(f"job {run.job.id}: leased to this worker again while submitting")
        return Started(remote, answer.result if remote == answer.remote_id else None, submission)

    async def _pause(self, run: JobRun, attempt: int, again: _Again) -> None:
        """Before a resend. A 409: only this job waits (the backend is not throttled, no cool-down for the
        others), and a drain ends the wait with the intent left open (that earlier request may yet be accepted).
        A 429: the backend cools down for everyone."""
        doubled = compute_backoff(attempt + 1, base=1.0, cap=RESEND_PAUSE_MAX_S)
        if again.throttled is None:
            log.info("job %s: submission still being served by the provider (409); again in %gs", run.job.id, doubled)
            await self.ctx.wait_ahead(run.job, asyncio.sleep(doubled))
            return
        pause = again.throttled.retry_after or doubled
        await self.ctx.health.call(functools.partial(run.on.limits.cool_down, pause))
        if run.on.health is not None:
            run.on.health.forget()  # the router sees the 429's cool-down at once

    async def _not_begun(self, run: JobRun, verdict: Begun) -> Started | _Again | None:
        """A begin that opened no intent: the remote job a stale worker's answer attached (polled, not submitted
        again), or None when the job went elsewhere (cancelled, or held over a cap); a lost lease raises
        `StaleLease`."""
        job = run.job
        if verdict.verdict is Verdict.CANCEL:
            await self.endings.cancel(run, None)
            return None
        if verdict.verdict is Verdict.MOVED:
            return await self._moved(run, verdict.detail)
        if verdict.verdict is Verdict.CAP:
            log.info("job %s: daily %s cap reached: held until the cap window rolls over", job.id, verdict.detail)
            return None
        if verdict.verdict is Verdict.REMOTE:  # a stale worker's answer was attached to the job: poll it
            log.info(
                "job %s: submission %s already has remote job %s; polling it",
                job.id,
                verdict.submission,
                verdict.detail,
            )
            return Started(verdict.detail, None, verdict.submission)
        raise StaleLease(f"job {job.id}: lease lost before its submission ({verdict})")

    async def _moved(self, run: JobRun, backend: str) -> _Again | None:
        """An earlier lease's submission of unknown outcome went to `backend`: it is settled there (adopted, or
        sent again under its key), never sent elsewhere. A backend this queue no longer routes to cannot settle
        it: the attempt fails with the intent left open (retried, dead once the attempts are used up)."""
        lane = self.ctx.router.by_name.get(backend)
        if lane is None:
            error = f"submission of unknown outcome at backend {backend!r}, which this queue no longer routes to"
            await self.endings.fail(run, error, retryable=True)
            return None
        log.info("job %s: its last submission's outcome at %s is unknown: settled there", run.job.id, backend)
        run.lane, run.why = lane, f"pinned: submission of unknown outcome at {backend}"
        return _Again(None, moved=True)

    async def _submit_error(self, run: JobRun, exc: BackendError, submission: int) -> Started | None:
        """A submit that raised: the remote id a webhook named meanwhile, if any, else the attempt fails."""
        await run.on.limits.count("errors")
        await self.ctx.health.call(functools.partial(run.on.failed, exc))
        if run.on.hooks is not None and not isinstance(exc, Fatal):
            # no answer, but the provider may have called back meanwhile: then the submission was accepted
            job_id = run.job.id
            adopted, current = await self.ctx.health.call(lambda: self.ctx.store.current_remote(job_id))
            if adopted is not None and current == submission:
                return Started(await self.record_known(run, adopted, submission), None, submission)
        await self._submit_failed(run, exc)
        return None

    async def _acquire(self, run: JobRun) -> None:
        """Wait for the backend's rate limit (up to an hour), or until a cancel of this job is heard of: the
        begin script then finds the cancel and the job is not submitted."""
        limits, health = run.on.limits, self.ctx.health
        if run.cancel or limits.free_now() or await health.call(limits.ready):
            return
        if run.cancel_wait is None:
            run.cancel_wait = asyncio.Event()
        waits = [asyncio.ensure_future(health.call(limits.acquire)), asyncio.ensure_future(run.cancel_wait.wait())]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in waits:
                task.cancel()
            run.cancel_wait = None

    async def _submit_failed(self, run: JobRun, exc: BackendError) -> None:
        """The submit failed. Where the provider may have accepted it all the same (`maybe_accepted`: a gateway's
        502/503/504/52x, a timeout or a reset after sending, an unreadable 2xx; see offload.backends.http) its
        intent stays open, as for a lost reply: the next claim looks for it (tag, listing, webhook) and a resend
        is counted as a possible duplicate. Otherwise (the provider's own answer, or a connection never made) the
        intent is closed and the next try is the same submission under the same key, uncounted."""
        answered = not exc.maybe_accepted and not run.unsettled
        if isinstance(exc, Fatal):  # refused: nothing runs, so nothing counts against the caps
            error = f"fatal: {exc}{detail(exc)}"
            await self.endings.fail(run, error, retryable=False, answered=answered, refund=answered)
        else:
            await self.endings.fail(run, f"{type(exc).__name__.lower()}: {exc}", retryable=True, answered=answered)

    async def record_known(self, run: JobRun, remote_id: str, submission: int) -> str:
        """`record` for a remote job known to exist. A checkpoint that raises something other than an outage
        (the reply to a write that landed, lost in a way redis-py does not call a connection error; a script
        error) is sent once more, as every checkpoint is idempotent; a second failure raises `Unrecorded`."""
        job_id = run.job.id
        for last in (False, True):
            try:
                return await self.record(run, remote_id, submission)
            except StaleLease:
                raise
            except Exception as exc:
                if last:
                    raise Unrecorded(f"job {job_id}: remote job {remote_id} could not be recorded") from exc
                log.warning("job %s: recording remote job %s failed (%s); once more", job_id, remote_id, describe(exc))
        raise AssertionError("unreachable")

    async def record(self, run: JobRun, remote_id: str, submission: int) -> str:
        """Checkpoint a remote job (through any outage: until the id is recorded, a lost worker means the
        next attempt pays for the job again) and return the remote id the job goes on with. A lease lost
        while the submit call was out still records the answer (ATTACHED: the job's next owner polls it) before
        giving up. When the submission already has another remote id (the provider ran it twice), our copy is
        cancelled and the first one kept."""
        job = run.job
        item = (job.id, job.token, run.on.name, remote_id, submission)
        code = await self.ctx.health.call(lambda: self.ctx.writes.checkpoints(item))
        if code.cancel:
            run.cancel = True
        elif code.duplicate:
            log.warning(
                "job %s: submission %d already runs remotely; cancelling our copy %s", job.id, submission, remote_id
            )
            with contextlib.suppress(BackendError), tracing.call(run.trace, "cancel", remote_id=remote_id):
                await run.on.backend.cancel(remote_id)
            if code.verdict is Verdict.DUP:
                return code.first
        if not code.recorded:
            what = "attached for the job's next owner" if code.verdict is Verdict.ATTACHED else f"not recorded ({code})"
            raise StaleLease(f"job {job.id}: lease lost while submitting; remote id {remote_id} {what}")
        return remote_id


def detail(exc: BackendError) -> str:
    """The excerpt of the provider's answer, when the error's text does not already carry it."""
    return f" ({exc.excerpt})" if exc.excerpt and exc.excerpt not in str(exc) else ""
