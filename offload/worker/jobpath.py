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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
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
from offload.errors import StaleLease
from offload.models import ClaimedJob
from offload.queue.keys import hook_digest
from offload.queue.store import QueueStore, retry_delay_ms
from offload.storage import InvalidKey, StorageError, validate_key
from offload.worker.batching import Batcher
from offload.worker.health import StoreHealth, describe
from offload.worker.hookpath import HookPath, PollTimeout
from offload.worker.limits import BackendLimits

log = logging.getLogger("offload.worker")
Fence = Callable[[], Awaitable[None]]
# (output key, output, run, fence) -> location. `run` names the remote run (the submission number), so files
# of two runs never share a key; `fence` is awaited right before the output itself is written.
StoreOutput = Callable[[str, Any, str, Fence], Awaitable[str]]


@dataclass
class WorkerOptions:
    queue: str
    backend_name: str
    concurrency: int = 256
    lease_ms: int = 10_000
    poll_interval: float = 5.0
    poll_timeout: float = 600.0
    first_poll: float = 0.25
    claim_batch: int = 500
    grace_s: float = 30.0
    daily_job_cap: int | None = None
    daily_spend_cap: float | None = None
    price_per_job: float | None = None
    price_per_second: float | None = None
    max_job_cost: float | None = None
    ingest_list: str | None = None
    max_attempts: int = 3
    submit_retries_on_429: int = 8
    submit_concurrency: int = 32
    # Webhooks (`server.public_url` set and a backend whose provider calls back): the URL prefix
    # `<public_url>/v1/hooks/<backend>`, the fallback poll interval, and how long a job whose earlier
    # submission's outcome is unknown waits for that submission's webhook before submitting again.
    hook_base: str | None = None
    hook_poll_interval: float = 60.0
    hook_grace_s: float = 0.0

    @property
    def reservation(self) -> float:
        """What one submission is reserved at against the spend cap before it is sent: the most it may cost.
        `max_job_cost` when set; else `price_per_job`; else `price_per_second` times `poll_timeout` (a remote
        job still running then is cancelled)."""
        if self.max_job_cost is not None:
            return self.max_job_cost
        if self.price_per_job is not None:
            return self.price_per_job
        if self.price_per_second is not None:
            return self.price_per_second * self.poll_timeout
        return 0.0

    def cost(self, result: RemoteResult) -> float | None:
        """What a finished remote run cost: as reported, else billed seconds times the price, else the price
        per job; None when unknown (its reservation then stands as its cost)."""
        if result.cost is not None:
            return result.cost
        if self.price_per_second is not None and result.duration_s is not None:
            return self.price_per_second * result.duration_s
        return self.price_per_job


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
    o: WorkerOptions
    health: StoreHealth
    tasks: dict[str, asyncio.Task[None]]
    cancels: set[str]
    _submitting: set[str]  # jobs whose submit call is out: a lost lease waits for the answer to be recorded
    _cancel_waits: dict[str, asyncio.Event]
    _gate: asyncio.Semaphore | None
    _checkpoints: Batcher[tuple[str, str, str, str, int], str]
    _completes: Batcher[tuple[str, str, str, float | None], str]
    _begins: Batcher[tuple[str, str, str], str]
    _fences: Batcher[tuple[str, str], str]

    async def _fresh_lease(self, job: ClaimedJob) -> None: ...

    def _done(self, job: ClaimedJob) -> None: ...

    async def _run_job(self, job: ClaimedJob, after: asyncio.Task[None] | None = None) -> None:
        remote_id: str | None = None  # once set: recorded in the job record
        try:
            if after is not None:
                await asyncio.wait([after])
            try:
                job_input = job.input
            except orjson.JSONDecodeError as exc:
                await self._fail(job, f"fatal: the job input is not valid JSON: {exc}", retryable=False)
                return
            if job.cancel_requested:
                await self._cancel(job, job.remote_id)
                return
            if problem := _key_problem(job.output_key):  # before paying for a result that cannot be stored
                await self._fail(job, f"output_key cannot be stored: {problem}", retryable=False)
                return
            remote_id = job.remote_id
            run = job.submission or 1
            result: RemoteResult | None = None
            if remote_id is None and job.intent_open and self._hooks() and self.o.hook_grace_s > 0:
                remote_id = await self._await_hook(job, run)
                if remote_id is not None:
                    remote_id = await self._record(job, remote_id, run)
            if remote_id is None:
                if adopted := await self._adopt(job):
                    remote_id = await self._record(job, adopted, run)
                else:
                    started = await self._submit(job, job_input)
                    if started is None:
                        return  # held, cancelled or failed: the job has moved on
                    remote_id, result, run = started
            if result is None:
                result = await (self._poll_hooked(job, remote_id, run) if self._hooks() else self._poll(job, remote_id))
                if result is None:
                    return  # cancelled
            await self._finish(job, result, run)
        except StaleLease:
            log.info("job %s: lease taken over, leaving it to its new owner", job.id)
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
                with contextlib.suppress(BackendError):
                    await self.backend.cancel(remote_id)
            await self._retry(
                job,
                f"{type(exc).__name__.lower()}: {exc}",
                keep_remote=remote_id is not None and not isinstance(exc, PollTimeout),
            )
        except StorageError as exc:  # the remote job finished: keep its id so the retry re-polls, not re-pays,
            # unless the failure cannot heal (e.g. a provider file already expired): then it must run again
            await self._retry(
                job,
                f"storing the output failed: {exc}",
                keep_remote=remote_id is not None and not getattr(exc, "permanent", False),
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
            await self._fail(
                job, f"worker error: {type(exc).__name__}: {exc}", retryable=True, keep_remote=remote_id is not None
            )
        finally:
            self._done(job)

    async def _adopt(self, job: ClaimedJob) -> str | None:
        """A job whose last submit intent has no remote id may have been submitted by a worker that died (or
        lost its lease) inside the submit call; backends that tag submissions can find it, so we poll it
        instead of paying again."""
        if not job.intent_open:
            return None
        with contextlib.suppress(BackendError):
            return await self.backend.find(job.id)
        return None

    async def _submit(self, job: ClaimedJob, job_input: Any) -> tuple[str, RemoteResult | None, int] | None:
        """Submit a job that has no remote job: (remote id, result of a synchronous API, submission number), or
        None when it went elsewhere (held over a cap, cancelled, failed)."""
        throttled: Throttled | None = None
        hooks = self._hooks()
        secret = secrets.token_urlsafe(24) if hooks else ""  # one per claim: a resend keeps its URL
        digest = hook_digest(secret) if hooks else ""
        for attempt in range(self.o.submit_retries_on_429 + 1):
            await self._fresh_lease(job)
            await self._acquire(job)  # may wait long: the intent (with the cancel check) comes after
            async with self._gate or contextlib.nullcontext():
                verdict = await self.health.call(lambda: self._begins((job.id, job.token, digest)))
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
                if not verdict.startswith("OK:"):
                    raise StaleLease(f"job {job.id}: lease lost before its submission ({verdict})")
                _, number, *dup = verdict.split(":")
                n = int(number)
                await self._fresh_lease(job)  # no I/O unless this process stalled since its last proof of life
                if dup:
                    log.warning(
                        "job %s: submission %d may have reached the provider already (its worker was lost "
                        "inside the submit call); sending it again with the same Idempotency-Key",
                        job.id,
                        n,
                    )
                self._submitting.add(job.id)  # a lost lease now must not throw the answer away (see _record)
                try:
                    key = f"{job.id}.{n}"
                    if hooks is not None:
                        url = f"{self.o.hook_base}/{quote(job.id, safe='')}/{n}/{secret}"
                        submission = await hooks.submit(job_input, tag=job.id, idempotency_key=key, webhook=url)
                    else:
                        submission = await self.backend.submit(job_input, tag=job.id, idempotency_key=key)
                except Throttled as exc:
                    await self.limits.count("throttled")
                    if attempt == self.o.submit_retries_on_429:
                        raise
                    throttled = exc
                except BackendError as exc:
                    await self.limits.count("errors")
                    if hooks is not None and not isinstance(exc, Fatal):  # no answer, but the provider may
                        # have called back meanwhile: then the submission was accepted and its id is known
                        adopted, current = await self.health.call(lambda: self.store.current_remote(job.id))
                        if adopted is not None and current == n:
                            return await self._record(job, adopted, n), None, n
                    await self._submit_failed(job, exc)
                    return None
                else:
                    remote = await self._record(job, submission.remote_id, n)
                    await self.limits.count("submitted")  # after the checkpoint: the window before it stays small
                    if self.tasks.get(job.id) is not asyncio.current_task():
                        raise StaleLease(f"job {job.id}: leased to this worker again while submitting")
                    return remote, submission.result if remote == submission.remote_id else None, n
                finally:
                    self._submitting.discard(job.id)
            pause = (throttled.retry_after if throttled else None) or min(2.0**attempt, 30.0)
            await self.health.call(functools.partial(self.limits.cool_down, pause))
        raise AssertionError("unreachable")

    async def _acquire(self, job: ClaimedJob) -> None:
        """Wait for the backend's rate limit (up to an hour), or until a cancel of this job is heard of: the
        begin script then finds the cancel and the job is not submitted."""
        if job.id in self.cancels:
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
        """The provider answered the submit with an error (or none arrived: a timeout, a reset connection,
        whose submission may still have been accepted: its intent stays open and a resend is counted)."""
        answered = exc.status is not None
        if isinstance(exc, Fatal):  # refused: nothing runs, so nothing counts against the caps
            await self._fail(job, f"fatal: {exc}{_detail(exc)}", retryable=False, answered=True, refund=True)
        else:
            await self._fail(job, f"{type(exc).__name__.lower()}: {exc}", retryable=True, answered=answered)

    async def _record(self, job: ClaimedJob, remote_id: str, run: int) -> str:
        """Checkpoint a remote job (through any outage: until the id is recorded, a lost worker means the
        next attempt pays for the job again) and return the remote id the job goes on with. A lease lost
        while the submit call was out still records the answer (ATTACHED: the job's next owner polls it) before
        giving up. When the submission already has another remote id (the provider ran it twice), our copy is
        cancelled and the first one kept."""
        item = (job.id, job.token, self.o.backend_name, remote_id, run)
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

    async def _poll(self, job: ClaimedJob, remote_id: str) -> RemoteResult | None:
        deadline = time.monotonic() + self.o.poll_timeout
        interval = self.o.first_poll
        transient = 0
        while True:
            if job.id in self.cancels:
                await self._cancel(job, remote_id)
                return None
            wait = interval
            try:
                result = await self.backend.poll(remote_id)
                transient = 0
                if result.terminal:
                    return result
            except Throttled as exc:
                await self.limits.count("throttled")
                wait = exc.retry_after or interval
                await self.health.call(functools.partial(self.limits.cool_down, wait))
            except Transient:
                await self.limits.count("errors")
                transient += 1
                if transient >= 10:
                    raise
            if time.monotonic() > deadline:  # also when every poll is throttled: the timeout bounds the job
                raise PollTimeout(f"remote job {remote_id} not done after {self.o.poll_timeout:g}s")
            await asyncio.sleep(wait)
            interval = min(interval * 2, self.o.poll_interval)  # doubling: few wasted polls on long GPU jobs

    async def _finish(self, job: ClaimedJob, result: RemoteResult, run: int) -> None:
        if result.status != "succeeded":
            await self._retry(
                job,
                f"remote job {result.status}: {result.error or 'no error given'}",
                keep_remote=False,
                cost=self.o.cost(result),
            )
            return
        location = await self._store(job, result.output, run)
        cost = self.o.cost(result)
        code = await self.health.call(lambda: self._completes((job.id, job.token, location, cost)))
        if code != "OK":
            raise StaleLease(f"job {job.id}: lease lost before it could be completed ({code})")

    async def _store(self, job: ClaimedJob, output: Any, run: int) -> str:
        """Store the output. Object storage (our own infrastructure, like Redis) failing for a while costs the
        job nothing: it keeps its lease and its finished remote result and tries again, up to `poll_timeout`;
        only then (or for a failure that cannot heal, like an expired provider file) is the attempt given up."""
        deadline = time.monotonic() + self.o.poll_timeout
        pause = 0.5
        while True:
            try:
                return await self.store_output(job.output_key, output, str(run), lambda: self._fence(job))
            except StorageError as exc:
                if exc.permanent or time.monotonic() + pause > deadline:
                    raise
                log.warning("job %s: storing the output failed (%s), trying again in %.1fs", job.id, exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 30.0)

    async def _fence(self, job: ClaimedJob) -> None:
        """Right before the output is written: a worker whose lease was taken over must not overwrite what the
        job's new owner stores (perhaps from a newer remote run)."""
        code = await self.health.call(lambda: self._fences((job.id, job.token)))
        if code != "OK":
            raise StaleLease(f"job {job.id}: lease lost before its output was written ({code})")

    async def _cancel(self, job: ClaimedJob, remote_id: str | None) -> None:
        if remote_id:
            with contextlib.suppress(NotFound):
                await self.backend.cancel(remote_id)
        await self.health.call(lambda: self.store.ack_cancel(job.id, job.token))

    async def _retry(
        self,
        job: ClaimedJob,
        error: str,
        *,
        keep_remote: bool,
        delay_ms: int | None = None,
        cost: float | None = None,
        answered: bool = False,
    ) -> None:
        await self._fail(
            job, error, retryable=True, keep_remote=keep_remote, delay_ms=delay_ms, cost=cost, answered=answered
        )

    async def _fail(
        self,
        job: ClaimedJob,
        error: str,
        *,
        retryable: bool,
        keep_remote: bool = False,
        delay_ms: int | None = None,
        answered: bool = False,
        cost: float | None = None,
        refund: bool = False,
    ) -> None:
        delay = delay_ms if delay_ms is not None else retry_delay_ms(job.attempt)
        try:
            state = await self.health.call(
                lambda: self.store.fail(
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
                )
            )
        except StaleLease:
            return
        log.info("job %s: %s -> %s", job.id, error[:200], state)


def _detail(exc: BackendError) -> str:
    return f" ({exc.excerpt})" if exc.excerpt and exc.excerpt not in str(exc) else ""
