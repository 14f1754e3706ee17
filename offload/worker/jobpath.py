"""One job's path through a dispatch worker: submit (or resume), record the remote id, poll, store, complete.

Every store write on the way goes through `StoreHealth.call`, so a Redis outage makes the job wait where it
is instead of failing it (and charging it an attempt), and a write whose reply was lost is simply sent again:
the scripts are idempotent. The submit itself is framed as tightly as the design allows: the submit intent
(with the cancel check, the lease check and the cap reservation) is recorded in one script right before the
request, the request carries `Idempotency-Key: <job id>.<submission number>`, and the remote id is recorded
the moment the answer is in. A job whose last intent has no remote id (its worker died in between) is looked
up by its tag where the provider allows it, else submitted again under the same key, and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import quote

import orjson

from offload.backends.base import (
    Backend,
    BackendError,
    Fatal,
    NotFound,
    RemoteResult,
    Throttled,
    Transient,
)
from offload.connection import is_outage
from offload.errors import StaleLease, WorkerError
from offload.models import ClaimedJob
from offload.queue.backend_limits import BackendLimits
from offload.queue.batching import Batcher
from offload.queue.keyspace import hook_digest
from offload.queue.memory import PolicyWatch
from offload.queue.store import CompleteItem, QueueStore
from offload.storage import InvalidKey, StorageError, validate_key
from offload.storage.outputs import FileRefused
from offload.worker.endings import Fence, StoreOutput
from offload.worker.health import StoreHealth, describe
from offload.worker.hookpath import HookPath, PollTimeout
from offload.worker.lag import Sighting
from offload.worker.options import WorkerOptions
from offload.worker.slots import Slot

log = logging.getLogger("offload.worker")
__all__ = ["Drained", "Fence", "JobPath", "StoreOutput", "WorkerOptions"]
T = TypeVar("T")


class Unrecorded(WorkerError):
    """A remote job known to exist (accepted, adopted, named by a webhook) whose checkpoint raised twice with an
    error that is not an outage (`_record` waits outages out). The write may have landed with its reply lost,
    so the attempt fails keeping whatever remote id the store holds: dropping one would pay for the job again."""


class Drained(WorkerError):
    """The worker is draining and this job has not sent its call: it goes back to the queue unsent (its intent, if
    this lease opened one, closed by the release), instead of starting a submission the drain would have to wait
    for or cut."""


def _key_problem(key: str) -> str | None:
    try:
        validate_key(key)
    except InvalidKey as exc:
        return str(exc)
    return None


class JobPath(HookPath):
    """The per-job half of the Worker (see dispatch.py for the other)."""

    store: QueueStore
    backend: Backend
    store_output: StoreOutput
    limits: BackendLimits
    options: WorkerOptions
    health: StoreHealth
    policy: PolicyWatch
    tasks: dict[str, asyncio.Task[None]]
    tokens: dict[str, str]  # the newest lease of each job this process runs
    cancels: set[str]
    _submitting: set[str]  # jobs whose submit call is out: a lost lease waits for the answer to be recorded
    _unsent: dict[str, str]  # job id -> token: begun (an open intent), the call not sent yet
    _answers: set[str]  # jobs holding a synchronous answer not acked yet: a drain awaits them like calls out
    _draining: bool  # no submission starts once set (see dispatch.py, _drain)
    _grace_over: bool  # the drain's grace has ended: a job whose answer was just recorded does not poll
    settling: set[str]
    _cancel_waits: dict[str, asyncio.Event]
    _gate: asyncio.Semaphore | None
    _checkpoints: Batcher[tuple[str, str, str, str, int], str]
    _completes: Batcher[CompleteItem, str]
    _begins: Batcher[tuple[str, str, str], str]
    _fences: Batcher[tuple[str, str], str]

    def _lease_stale(self, job: ClaimedJob) -> bool:
        raise NotImplementedError  # the Worker's (dispatch.py), as every method declared here without a body

    async def _renew_leases(self) -> None: ...

    def _take_free(self, job: ClaimedJob) -> bool:
        raise NotImplementedError

    async def _enter_remote(self, job: ClaimedJob) -> None: ...

    async def _wait_ahead(self, job: ClaimedJob, aw: Awaitable[T]) -> T:
        raise NotImplementedError

    async def _hand_back(self, jobs: list[ClaimedJob]) -> None: ...

    def _leave_remote(self, job: ClaimedJob) -> None: ...

    def _done(self, job: ClaimedJob) -> None: ...

    def _newest(self, job: ClaimedJob) -> bool:
        """Whether `job` is the newest lease of its job this process runs, i.e. its task is the one in `tasks`
        (each lease has its own token; compared instead of `asyncio.current_task()`, a Python call in 3.11 that
        ran four times per job)."""
        return self.tokens.get(job.id) == job.token

    async def _run_job(self, job: ClaimedJob, after: asyncio.Task[None] | None = None) -> None:
        remote_id: str | None = None  # once set: recorded in the job record (unless `unrecorded`)
        # A synchronous answer: its run is recorded with the ack. A failure before the ack closes the intent,
        # unrecorded: the next try is the same run under the same Idempotency-Key (a provider that honours it
        # answers again without charging twice), not a possible duplicate, and no attempt is spent polling a
        # call that cannot be polled.
        unrecorded = False
        try:
            if after is not None:
                await asyncio.wait([after])
            try:
                job_input = job.input
            except orjson.JSONDecodeError as exc:
                await self._fail(job, f"fatal: the job input is not valid JSON: {exc}", retryable=False)
                return
            remote_id = job.remote_id  # set before the cancel: a failed cancel call keeps it (the retry cancels)
            if job.cancel_requested:  # its remote job is cancelled first (cancel.lua)
                if remote_id is None and job.intent_open:  # a submission of unknown outcome: found by its tag
                    remote_id = await self._adopt(job)
                await self._cancel(job, remote_id)
                return
            if problem := _key_problem(job.output_key):  # before paying for a result that cannot be stored
                await self._fail(job, f"output_key cannot be stored: {problem}", retryable=False)
                return
            run = job.submission or 1
            result: RemoteResult | None = None
            lag = self._sighting()  # a resumed remote job: not seen yet, its grace from the store's submit time
            # One of the `concurrency` slots while the job is at the provider: taken at its first remote step (a
            # fresh submission takes it after its begin script, see _submit), given back when the remote work
            # ends; the store writes after it (output, ack) run outside the slot.
            slot = Slot(self, job)
            try:
                if remote_id is None and job.intent_open and self._hooks() and self.options.hook_grace_s > 0:
                    await slot.take()
                    remote_id = await self._await_hook(job, run)  # its webhook may name the remote job: no resend
                    if remote_id is not None:
                        remote_id = await self._record_known(job, remote_id, run)
                        lag.submitted()
                if remote_id is None:
                    adopted = None
                    if job.intent_open:
                        await slot.take()  # the provider is asked for the job by its tag
                        adopted = await self._adopt(job)
                    if adopted:
                        remote_id = await self._record_known(job, adopted, run)
                        lag.submitted()  # named by a listing or a webhook; a status read may lag it still
                    else:
                        if self._gate is not None:
                            # an asynchronous API: slot, then gate, then begin, as a job holding a slot may wait for
                            # the gate again (after a 429), so one holding the gate must never wait for a slot
                            await slot.take()
                        started = await self._submit(job, job_input, slot)
                        if started is None:
                            return  # held, cancelled or failed: the job has moved on
                        remote_id, result, run = started
                        unrecorded = result is not None
                        lag.submitted()
                        if unrecorded:
                            self._answers.add(job.id)
                if result is None:
                    if self._grace_over:
                        return  # a drain past its grace: recorded, the next owner polls it
                    if not slot.take_now():
                        await slot.take()
                    hooked = self._hooks()
                    result = await (
                        self._poll_hooked(job, remote_id, run, lag) if hooked else self._poll(job, remote_id, lag)
                    )
                    if result is None:
                        return  # cancelled
            finally:
                slot.give_back()
            await self._finish(job, result, run, remote_id if unrecorded else None)
        except StaleLease:
            log.info("job %s: lease taken over, leaving it to its new owner", job.id)
        except Drained:
            if self._newest(job):
                self.settling.add(job.id)
                await self._hand_back([job])
        except asyncio.CancelledError:
            raise
        except Throttled as exc:
            await self.health.call(functools.partial(self.limits.cool_down, exc.retry_after or 5.0))
            await self._retry(
                job,
                f"throttled: {exc}",
                keep_remote=remote_id is not None,
                delay_ms=int((exc.retry_after or 5.0) * 1000),
                answered=True,
            )
        except NotFound as exc:
            await self._retry(job, f"remote result expired: {exc}", keep_remote=False)
        except (Transient, PollTimeout) as exc:
            if isinstance(exc, PollTimeout) and remote_id:
                await self._timed_out(job, remote_id, exc)  # a new run only once this one is cancelled
                return
            await self._retry(
                job,
                f"{type(exc).__name__.lower()}: {exc}",
                keep_remote=remote_id is not None and not isinstance(exc, PollTimeout),
            )
        except FileRefused as exc:  # the egress rule refuses a file of this output: another run would be too
            await self._fail(job, f"storing the output failed: {exc}", retryable=False, answered=unrecorded)
        except StorageError as exc:  # the remote job finished: keep its id so the retry re-polls, not re-pays,
            # unless the failure cannot heal (e.g. a provider file already expired): then it must run again
            await self._retry(
                job,
                f"storing the output failed: {exc}",
                keep_remote=remote_id is not None and not getattr(exc, "permanent", False),
                answered=unrecorded,
            )
        except Fatal as exc:
            await self._fail(job, f"fatal: {exc}{_detail(exc)}", retryable=False)
        except Exception as exc:
            if is_outage(exc):  # a store call outside the retried writes: the lease is handed back, uncounted
                log.warning("job %s: job store unreachable (%s); the job goes back to the queue", job.id, describe(exc))
                return
            # A bug or garbage must dead-letter the job, never kill the worker. A recorded remote id is kept: the
            # retry resumes the paid-for remote job instead of submitting again.
            log.exception("job %s: unexpected error", job.id)
            cause = exc.__cause__ if isinstance(exc, Unrecorded) and exc.__cause__ is not None else exc
            await self._fail(
                job,
                f"worker error: {type(cause).__name__}: {cause}",
                retryable=True,
                keep_remote=remote_id is not None or isinstance(exc, Unrecorded),
                answered=unrecorded,
            )
        finally:
            self._done(job)

    async def _adopt(self, job: ClaimedJob) -> str | None:
        """A job whose last submit intent has no remote id may have been submitted by a worker that died (or
        lost its lease) inside the submit call; backends that tag submissions can find it, so we poll it
        instead of paying again. Called for such a job only (`job.intent_open`)."""
        with contextlib.suppress(BackendError):
            return await self.backend.find(job.id)
        return None

    async def _submit(self, job: ClaimedJob, job_input: Any, slot: Slot) -> tuple[str, RemoteResult | None, int] | None:
        """Submit a job that has no remote job: (remote id, result of a synchronous API, submission number), or
        None when it went elsewhere (held over a cap, cancelled, failed).

        For a synchronous API (no submit gate) the begin script runs before the job takes its slot (see
        docs/explanation/architecture.md, *Slots*): its round trip is spent while the slot is still busy with
        another job, not inside this one's. Between the begin and the call the job is `unsent` (a drain closes its
        intent: nothing was sent) and, once it has its slot, the cancels this worker has heard of since the begin are
        checked right before the call. A job the claim has begun (`job.begun`: a synchronous API without a rate
        limit or caps, see claim.lua) starts here with its intent open and skips the begin of its first try.

        Once the worker drains, no call is sent: a job at the rate limit, the gate or its slot, or pausing before a
        resend, raises `Drained` (the drain cancels those waits), and so does one whose begin or slot came after
        the drain began, checked right before the call, with nothing awaited in between."""
        throttled: Throttled | None = None
        retries = self.options.submit_retries_on_429
        hooks = self._hooks()
        secret = secrets.token_urlsafe(24) if hooks else ""  # one per claim: a resend keeps its URL
        digest = hook_digest(self.options.backend_name, secret) if hooks else ""
        for attempt in range(retries + 1):
            in_progress = False
            begun = job.begun and attempt == 0
            if self._draining:  # (also before every resend after a 429 or a 409)
                raise Drained(job.id)
            if not begun and self._lease_stale(job):
                await self._renew_leases()
            if not self.limits.free_now():  # (checked here too: a call less per job on the common path)
                # may wait long: the intent (with the cancel check) comes after; a drain ends the wait
                await self._wait_ahead(job, self._acquire(job))
            # The gate by hand, not `async with self._gate or nullcontext()`: a synchronous API has none, and the
            # context manager cost it two coroutines per job. Only a wait for it is one a drain can end.
            gate = self._gate
            if gate is not None:
                await (self._wait_ahead(job, gate.acquire()) if gate.locked() else gate.acquire())
            try:
                if not self.policy.current:  # the store may evict: no new payment until it is fixed (queue/memory.py)
                    await self.policy.confirm()
                if begun:  # the claim opened this intent: no verdict to read
                    n, dup = job.submission, False
                else:
                    verdict = await self.health.call(lambda: self._begins((job.id, job.token, digest)))
                    if not verdict.startswith("OK:"):
                        return await self._not_begun(job, verdict)
                    _, number, *more = verdict.split(":")
                    n, dup = int(number), bool(more)
                self._unsent[job.id] = job.token
                if not slot.take_now():
                    await slot.take()
                if job.id in self.cancels:  # heard of since the begin (a heartbeat): not sent
                    self._unsent.pop(job.id, None)
                    await self._cancel(job, None)
                    return None
                if not self.policy.current:  # again: the begin or the slot may have waited meanwhile
                    await self.policy.confirm()
                if self._lease_stale(job):  # only if this process stalled since its last proof of life
                    await self._renew_leases()
                if self._draining:  # since the begin or the slot: not sent, its intent closed by the release
                    raise Drained(job.id)
                if dup:
                    log.warning(
                        "job %s: submission %d may have reached the provider already (its outcome is unknown: a "
                        "worker lost inside the call, or no answer that says); sending it again with the same "
                        "Idempotency-Key",
                        job.id,
                        n,
                    )
                self._unsent.pop(job.id, None)
                self._submitting.add(job.id)  # a lost lease now must not throw the answer away (see _record)
                try:
                    key = f"{job.id}.{n}"
                    if hooks is not None:
                        url = f"{self.options.hook_base}/{quote(job.id, safe='')}/{n}/{secret}"
                        submission = await hooks.submit(job_input, tag=job.id, idempotency_key=key, webhook=url)
                    else:
                        submission = await self.backend.submit(job_input, tag=job.id, idempotency_key=key)
                except Throttled as exc:
                    self.limits.note("throttled")
                    if attempt == retries:
                        raise
                    throttled = exc
                    self._unsent[job.id] = job.token  # answered 429, nothing accepted: unsent until sent again
                except BackendError as exc:
                    if exc.status == 409 and attempt < retries:
                        # 409 to a request carrying an Idempotency-Key: the provider is still serving an earlier
                        # request under the same key (this run, sent by a worker lost inside the call; a
                        # synchronous call lasts as long as the job). Nothing failed: wait inside this attempt
                        # and send again under the same key, which is answered from the first request once it
                        # is done. (As an attempt's failure, a kill inside a 30 s call spent every attempt of a
                        # job with the default 3 on 409s while its paid run was still finishing.)
                        in_progress = True
                    else:
                        return await self._submit_error(job, exc, n, hooked=hooks is not None)
                else:
                    # A remote job is recorded before it is polled. A synchronous answer carries the result: its
                    # run is recorded by the ack itself (one write, not two), or closed by the failure that
                    # follows; a worker lost in between leaves the intent open, and the next attempt submits
                    # again under the same key, counted as a possible duplicate (there is nothing to resume).
                    remote = submission.remote_id
                    if submission.result is None:
                        remote = await self._record_known(job, submission.remote_id, n)
                    self.limits.note("submitted")  # after the checkpoint: the window before it stays small
                    if not self._newest(job):
                        raise StaleLease(f"job {job.id}: leased to this worker again while submitting")
                    return remote, submission.result if remote == submission.remote_id else None, n
                finally:
                    self._submitting.discard(job.id)
            finally:
                if gate is not None:
                    gate.release()
            if in_progress:  # only this job waits: the backend is not throttled (no cool-down for the others)
                pause = min(2.0**attempt, 30.0)
                log.info("job %s: submission still being served by the provider (409); again in %gs", job.id, pause)
                # a drain ends the wait with the intent left open: that earlier request may yet be accepted
                await self._wait_ahead(job, asyncio.sleep(pause))
                continue
            pause = (throttled.retry_after if throttled else None) or min(2.0**attempt, 30.0)
            await self.health.call(functools.partial(self.limits.cool_down, pause))
        raise AssertionError("unreachable")

    async def _not_begun(self, job: ClaimedJob, verdict: str) -> tuple[str, RemoteResult | None, int] | None:
        """A begin that opened no intent (begin.lua's verdicts other than OK): the remote job a stale worker's
        answer attached (polled, not submitted again), or None when the job went elsewhere (cancelled, or held
        over a cap); a lost lease raises `StaleLease`."""
        if verdict == "CANCEL":
            await self._cancel(job, None)
            return None
        if verdict.startswith("CAP:"):
            log.info("job %s: daily %s cap reached: held until the cap window rolls over", job.id, verdict[4:])
            return None
        if verdict.startswith("REMOTE:"):  # a stale worker's answer was attached to the job: poll it
            _, number, remote = verdict.split(":", 2)
            log.info("job %s: submission %s already has remote job %s; polling it", job.id, number, remote)
            return remote, None, int(number)
        raise StaleLease(f"job {job.id}: lease lost before its submission ({verdict})")

    async def _submit_error(
        self, job: ClaimedJob, exc: BackendError, n: int, *, hooked: bool
    ) -> tuple[str, RemoteResult | None, int] | None:
        """A submit that raised: the remote id a webhook named meanwhile, if any, else the attempt fails."""
        await self.limits.count("errors")
        if hooked and not isinstance(exc, Fatal):  # no answer, but the provider may have called back
            # meanwhile: then the submission was accepted and its id is known
            adopted, current = await self.health.call(lambda: self.store.current_remote(job.id))
            if adopted is not None and current == n:
                return await self._record_known(job, adopted, n), None, n
        await self._submit_failed(job, exc)
        return None

    async def _acquire(self, job: ClaimedJob) -> None:
        """Wait for the backend's rate limit (up to an hour), or until a cancel of this job is heard of: the
        begin script then finds the cancel and the job is not submitted."""
        if job.id in self.cancels or self.limits.free_now() or await self.health.call(self.limits.ready):
            return
        heard = self._cancel_waits.setdefault(job.id, asyncio.Event())
        waits = [asyncio.ensure_future(self.health.call(self.limits.acquire)), asyncio.ensure_future(heard.wait())]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in waits:
                task.cancel()
            self._cancel_waits.pop(job.id, None)

    async def _submit_failed(self, job: ClaimedJob, exc: BackendError) -> None:
        """The submit failed. Where the provider may have accepted it all the same (`maybe_accepted`: a gateway's
        502/503/504/52x, a timeout or a reset after sending, an unreadable 2xx; see offload.backends.http) its
        intent stays open, as for a lost reply: the next claim looks for it (tag, listing, webhook) and a resend
        is counted as a possible duplicate. Otherwise (the provider's own answer, or a connection never made) the
        intent is closed and the next try is the same run under the same key, uncounted."""
        answered = not exc.maybe_accepted
        if isinstance(exc, Fatal):  # refused: nothing runs, so nothing counts against the caps
            await self._fail(job, f"fatal: {exc}{_detail(exc)}", retryable=False, answered=answered, refund=answered)
        else:
            await self._fail(job, f"{type(exc).__name__.lower()}: {exc}", retryable=True, answered=answered)

    async def _record_known(self, job: ClaimedJob, remote_id: str, run: int) -> str:
        """`_record` for a remote job known to exist. A checkpoint that raises something other than an outage
        (the reply to a write that landed, lost in a way redis-py does not call a connection error; a script
        error) is sent once more, as every checkpoint is idempotent; a second failure raises `Unrecorded`."""
        for last in (False, True):
            try:
                return await self._record(job, remote_id, run)
            except StaleLease:
                raise
            except Exception as exc:
                if last:
                    raise Unrecorded(f"job {job.id}: remote job {remote_id} could not be recorded") from exc
                log.warning("job %s: recording remote job %s failed (%s); once more", job.id, remote_id, describe(exc))
        raise AssertionError("unreachable")

    async def _record(self, job: ClaimedJob, remote_id: str, run: int) -> str:
        """Checkpoint a remote job (through any outage: until the id is recorded, a lost worker means the
        next attempt pays for the job again) and return the remote id the job goes on with. A lease lost
        while the submit call was out still records the answer (ATTACHED: the job's next owner polls it) before
        giving up. When the submission already has another remote id (the provider ran it twice), our copy is
        cancelled and the first one kept."""
        item = (job.id, job.token, self.options.backend_name, remote_id, run)
        code = await self.health.call(lambda: self._checkpoints(item))
        if code == "OK:CANCEL":
            self.cancels.add(job.id)
        elif code.startswith("DUP:") or code == "STALE:DUP":
            log.warning("job %s: submission %d already runs remotely; cancelling our copy %s", job.id, run, remote_id)
            with contextlib.suppress(BackendError):
                await self.backend.cancel(remote_id)
            if code.startswith("DUP:"):
                return code[4:]
        if code not in ("OK", "OK:CANCEL") and not code.startswith("DUP:"):
            what = "attached for the job's next owner" if code == "ATTACHED" else f"not recorded ({code})"
            raise StaleLease(f"job {job.id}: lease lost while submitting; remote id {remote_id} {what}")
        return remote_id

    async def _poll(self, job: ClaimedJob, remote_id: str, lag: Sighting) -> RemoteResult | None:
        deadline = time.monotonic() + self.options.poll_timeout
        interval = self.options.first_poll
        transient = 0
        while True:
            if job.id in self.cancels:
                await self._cancel(job, remote_id)
                return None
            wait = interval
            try:
                result = await self.backend.poll(remote_id)
                transient = 0
                lag.seen = True
                if result.terminal:
                    return result
            except NotFound as exc:
                if not await self._lagging(job, exc, lag):
                    raise
            except Throttled as exc:
                self.limits.note("throttled")
                wait = exc.retry_after or interval
                await self.health.call(functools.partial(self.limits.cool_down, wait))
            except Transient:
                self.limits.note("errors")
                transient += 1
                if transient >= 10:
                    raise
            if time.monotonic() > deadline:  # also when every poll is throttled: the timeout bounds the job
                raise PollTimeout(f"remote job {remote_id} not done after {self.options.poll_timeout:g}s")
            await asyncio.sleep(wait)
            interval = min(interval * 2, self.options.poll_interval)  # doubling: few wasted polls on long GPU jobs

    async def _finish(self, job: ClaimedJob, result: RemoteResult, run: int, unrecorded: str | None = None) -> None:
        """Store the output and ack. `unrecorded`: the remote id of a run that was never checkpointed, recorded
        by the ack."""
        if result.status != "succeeded":
            if unrecorded is not None:  # recorded, so that the next try is a new run (a new Idempotency-Key)
                await self._record(job, unrecorded, run)
            await self._retry(
                job,
                f"remote job {result.status}: {result.error or 'no error given'}",
                keep_remote=False,
                cost=self.options.cost(result),
            )
            return
        location = await self._store(job, result.output, run)
        cost = self.options.cost(result)
        self.settling.add(job.id)
        item: CompleteItem = (job.id, job.token, location, cost)
        if unrecorded is not None:
            item = (*item, self.options.backend_name, unrecorded, run)
        code = await self.health.call(lambda: self._completes(item))
        if code != "OK":
            raise StaleLease(f"job {job.id}: lease lost before it could be completed ({code})")


def _detail(exc: BackendError) -> str:
    return f" ({exc.excerpt})" if exc.excerpt and exc.excerpt not in str(exc) else ""
