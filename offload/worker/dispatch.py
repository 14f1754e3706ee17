"""The dispatch loop: one asyncio process keeps up to `concurrency` remote jobs in flight.

It claims in batches, submits each job to the queue's backend, records the remote id before the first poll
(so a re-delivered job is resumed, never paid for twice), polls with growing intervals, stores the output and
only then completes. One heartbeat call per interval keeps every lease alive. Nothing here sleeps on behalf
of another job: retries are scheduled in Redis, waits are per-task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from offload.backends.base import Backend, BackendError, Fatal, NotFound, RemoteResult, Throttled, Transient
from offload.errors import StaleLease
from offload.models import ClaimedJob
from offload.queue.store import QueueStore, retry_delay_ms
from offload.storage import InvalidKey, StorageError, validate_key
from offload.worker.batching import Batcher
from offload.worker.limits import BackendLimits

log = logging.getLogger("offload.worker")
StoreOutput = Callable[[str, Any], Awaitable[str]]


class PollTimeout(Exception):
    """The remote job did not finish within POLL_TIMEOUT."""


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
    ingest_list: str | None = None
    max_attempts: int = 3
    submit_retries_on_429: int = 8


def _key_problem(key: str) -> str | None:
    try:
        validate_key(key)
    except InvalidKey as exc:
        return str(exc)
    return None


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Worker:
    """Serves one queue. `run(stop)` returns after a graceful drain once `stop` is set."""

    def __init__(
        self, store: QueueStore, backend: Backend, store_output: StoreOutput, limits: BackendLimits,
        options: WorkerOptions, *, worker_id: str | None = None, clock: Callable[[], float] = time.time,
        control: QueueStore | None = None,
    ) -> None:
        self.store, self.backend, self.store_output, self.limits = store, backend, store_output, limits
        # Claims and heartbeats on their own connection (when given): job tasks can keep every connection of
        # the main pool busy, and a heartbeat that waits for one past the lease loses every job.
        self.control = control or store
        self.o = options
        self.id = worker_id or default_worker_id()
        self.clock = clock
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.tokens: dict[str, str] = {}
        self.cancels: set[str] = set()
        self.peak_in_flight = 0
        self._slot = asyncio.Event()
        self._window = ""  # unknown: the first loop releases jobs held in earlier windows
        # The per-job writes of the hot path, coalesced: thousands of tasks, a few script calls.
        q = options.queue
        self._checkpoints: Batcher[tuple[str, str, str, str], str] = Batcher(
            lambda items: store.checkpoint_many(q, items))
        self._completes: Batcher[tuple[str, str, str, float | None], str] = Batcher(
            lambda items: store.complete_many(q, items))
        self._reservations: Batcher[tuple[str, str, float], str | None] = Batcher(self._reserve_many)
        self._beats: Batcher[None, None] = Batcher(self._beat_many, concurrency=1)
        self._beat_at = time.monotonic()  # claims prove liveness too: a claim precedes every job

    def window(self) -> str:
        """The cap window: the UTC day of the (injectable) clock."""
        return time.strftime("%Y%m%d", time.gmtime(self.clock()))

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        helpers = [asyncio.create_task(self._heartbeat_loop(stop))]
        if self.o.ingest_list:
            helpers.append(asyncio.create_task(self._ingest_loop(stop)))
        idle = 0.02
        try:
            while not stop.is_set():
                await self._roll_window()
                free = self.o.concurrency - len(self.tasks)
                claimed: list[ClaimedJob] = []
                if free > 0:
                    batch = min(free, self.o.claim_batch)
                    sent = time.monotonic()
                    claimed = await self.control.claim(self.o.queue, self.id, batch, self.o.lease_ms)
                    self._beat_at = max(self._beat_at, sent)  # a claim renews the worker's liveness too
                for job in claimed:
                    self.tokens[job.id] = job.token
                    self.tasks[job.id] = asyncio.create_task(self._run_job(job))
                self.peak_in_flight = max(self.peak_in_flight, len(self.tasks))
                if claimed and len(claimed) == min(free, self.o.claim_batch):
                    idle = 0.02
                    continue
                self._slot.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wait_slot_or_stop(stop), idle if free > 0 else None)
                idle = min(idle * 2, 0.5) if not claimed else 0.02
        finally:
            await self._drain(helpers)

    async def _wait_slot_or_stop(self, stop: asyncio.Event) -> None:
        waiters = [asyncio.create_task(self._slot.wait()), asyncio.create_task(stop.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def _drain(self, helpers: list[asyncio.Task[None]]) -> None:
        """Stop claiming, let in-flight jobs finish for the grace period, then hand the rest back with
        their remote ids (the next worker resumes polling them)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=self.o.grace_s)
        left = list(self.tasks)
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if left:
            released = await self.control.release_leases(self.o.queue, self.id, left)
            log.info("drained: released %d leases (remote ids kept)", released)
        for h in helpers:
            h.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await self.control.release_leases(self.o.queue, self.id)

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(self.o.lease_ms / 3000)
            try:
                await self._beat()
            except Exception as exc:  # Redis blip: the next beat retries well inside the lease
                log.warning("heartbeat failed: %s", exc)

    async def _beat(self) -> None:
        """Extend every lease in one call; cancel the tasks whose lease another worker holds now."""
        sent = time.monotonic()
        reply = await self.control.heartbeat(self.o.queue, self.id, list(self.tasks), self.o.lease_ms)
        self._beat_at = sent
        for job_id in reply.lost:
            if task := self.tasks.get(job_id):
                log.warning("lease of %s lost; another worker owns it now", job_id)
                task.cancel()
        self.cancels.update(reply.cancel_requested)

    async def _fresh_lease(self) -> None:
        """Before paying for a submission, make sure the lease is fresh. A process starved of CPU (an
        overloaded host) can miss beats; if its leases lapsed, another worker may already own this job, and
        submitting now would pay twice. A late beat here cancels this task instead (the job is lost to us)."""
        if time.monotonic() - self._beat_at > self.o.lease_ms / 3000:
            await self._beats(None)

    async def _beat_many(self, items: list[None]) -> list[None]:
        await self._beat()
        return [None] * len(items)

    async def _ingest_loop(self, stop: asyncio.Event) -> None:
        assert self.o.ingest_list is not None
        while not stop.is_set():
            try:
                ok, bad = await self.store.ingest(self.o.ingest_list, self.o.queue, max_attempts=self.o.max_attempts)
            except Exception as exc:
                log.warning("ingest from %s failed: %s", self.o.ingest_list, exc)
                ok = bad = 0
            if ok + bad == 0:
                await asyncio.sleep(0.2)

    async def _roll_window(self) -> None:
        """Jobs held in an earlier cap window go back to ready: when the window rolls over during the worker's
        life, and when a worker starts in a later window than the one they were held in (a restart after
        midnight). Every worker may do this: moving a held job is atomic."""
        window = self.window()
        if window != self._window:
            self._window = window
            released = await self.control.release_held_before(self.o.queue, window)
            if released:
                log.info("cap window %s: released %d held jobs", window, released)

    # -- one job -----------------------------------------------------------------------------------

    async def _run_job(self, job: ClaimedJob) -> None:
        remote_id = job.remote_id
        recorded = remote_id is not None  # the job record holds the remote id
        try:
            if job.cancel_requested:
                await self._cancel(job, remote_id)
                return
            if problem := _key_problem(job.output_key):  # before paying for a result that cannot be stored
                await self._fail(job, f"output_key cannot be stored: {problem}", retryable=False)
                return
            result: RemoteResult | None = None
            estimate = self.o.price_per_job or 0.0
            if remote_id is None:
                if remote_id := await self._adopt(job):
                    await self._checkpoint(job, remote_id)
                    recorded = True
                else:
                    capped = self.o.daily_job_cap is not None or self.o.daily_spend_cap is not None
                    cap = await self._reservations((job.id, self._window, estimate)) if capped else None
                    if cap:
                        await self.store.hold(job.id, job.token, f"daily {cap} cap reached (window {self._window})",
                                              self._window)
                        return
                    await self._fresh_lease()
                    submission = await self._submit(job)
                    remote_id = submission.remote_id
                    result = submission.result
                    if await self._record(job, remote_id):
                        self.cancels.add(job.id)
                    recorded = True
                    await self.limits.count("submitted")  # after the checkpoint: the window before it stays as small
            if result is None:
                result = await self._poll(job, remote_id)
                if result is None:
                    return  # cancelled
            await self._finish(job, result, estimate)
        except StaleLease:
            log.info("job %s: lease taken over, leaving it to its new owner", job.id)
        except asyncio.CancelledError:
            raise
        except Throttled as exc:
            await self.limits.cool_down(exc.retry_after or 5.0)
            await self._retry(job, f"throttled: {exc}", keep_remote=remote_id is not None,
                              delay_ms=int((exc.retry_after or 5.0) * 1000))
        except NotFound as exc:
            await self._retry(job, f"remote result expired: {exc}", keep_remote=False)
        except (Transient, PollTimeout) as exc:
            if isinstance(exc, PollTimeout) and remote_id:
                with contextlib.suppress(BackendError):
                    await self.backend.cancel(remote_id)
            await self._retry(job, f"{type(exc).__name__.lower()}: {exc}",
                              keep_remote=remote_id is not None and not isinstance(exc, PollTimeout))
        except StorageError as exc:  # the remote job finished: keep its id so the retry re-polls, not re-pays,
            # unless the failure cannot heal (e.g. a provider file already expired): then it must run again
            await self._retry(job, f"storing the output failed: {exc}",
                              keep_remote=remote_id is not None and not getattr(exc, "permanent", False))
        except Fatal as exc:
            detail = f" ({exc.excerpt})" if exc.excerpt and exc.excerpt not in str(exc) else ""
            await self._fail(job, f"fatal: {exc}{detail}", retryable=False)
        except Exception as exc:  # a bug or garbage must dead-letter the job, never kill the worker
            log.exception("job %s: unexpected error", job.id)
            # A recorded remote id is kept: the retry resumes the paid-for remote job instead of submitting again.
            await self._fail(job, f"worker error: {type(exc).__name__}: {exc}", retryable=True,
                             keep_remote=recorded)
        finally:
            self.tasks.pop(job.id, None)
            self.tokens.pop(job.id, None)
            self.cancels.discard(job.id)
            self._slot.set()

    async def _adopt(self, job: ClaimedJob) -> str | None:
        """A re-delivered job without a remote id may have been submitted by a worker killed inside the
        submit call; backends that tag submissions can find it, so we poll it instead of paying again."""
        if not job.redelivered:
            return None
        with contextlib.suppress(BackendError):
            return await self.backend.find(job.id)
        return None

    async def _record(self, job: ClaimedJob, remote_id: str) -> bool:
        """Checkpoint a fresh submission, riding out a Redis blip: until the id is recorded, a failure here
        means the next attempt pays for the job again. Returns whether a cancel was requested meanwhile."""
        for delay in (0.2, 0.5, 1.0, 2.0, 4.0):
            try:
                return await self._checkpoint(job, remote_id)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("job %s: recording remote id %s failed (%s), retrying", job.id, remote_id, exc)
                await asyncio.sleep(delay)
        return await self._checkpoint(job, remote_id)

    async def _checkpoint(self, job: ClaimedJob, remote_id: str) -> bool:
        code = await self._checkpoints((job.id, job.token, self.o.backend_name, remote_id))
        if code in ("STALE", "NOTFOUND"):
            raise StaleLease(f"job {job.id}: lease lost before its remote id {remote_id} was recorded ({code})")
        return code == "OK:CANCEL"

    async def _reserve_many(self, items: list[tuple[str, str, float]]) -> list[str | None]:
        """Cap reservations in claim order, one script call per cap window present (normally one)."""
        verdicts: dict[int, str | None] = {}
        for window in dict.fromkeys(w for _, w, _ in items):
            picked = [(n, job_id, cost) for n, (job_id, w, cost) in enumerate(items) if w == window]
            got = await self.store.reserve_many(
                self.o.queue, window, [(job_id, cost) for _, job_id, cost in picked],
                job_cap=self.o.daily_job_cap, spend_cap=self.o.daily_spend_cap,
            )
            verdicts.update(zip((n for n, _, _ in picked), got, strict=True))
        return [verdicts[n] for n in range(len(items))]

    async def _submit(self, job: ClaimedJob) -> Any:
        for attempt in range(self.o.submit_retries_on_429 + 1):
            await self.limits.acquire()
            try:
                return await self.backend.submit(job.input, tag=job.id)
            except Throttled as exc:
                await self.limits.count("throttled")
                if attempt == self.o.submit_retries_on_429:
                    raise
                await self.limits.cool_down(exc.retry_after or min(2.0**attempt, 30.0))
            except BackendError:
                await self.limits.count("errors")
                raise
        raise AssertionError("unreachable")

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
                await self.limits.cool_down(wait)
            except Transient:
                await self.limits.count("errors")
                transient += 1
                if transient >= 10:
                    raise
            if time.monotonic() > deadline:  # also when every poll is throttled: the timeout bounds the job
                raise PollTimeout(f"remote job {remote_id} not done after {self.o.poll_timeout:g}s")
            await asyncio.sleep(wait)
            interval = min(interval * 2, self.o.poll_interval)  # doubling: few wasted polls on long GPU jobs

    async def _finish(self, job: ClaimedJob, result: RemoteResult, estimate: float) -> None:
        if result.status != "succeeded":
            await self._retry(job, f"remote job {result.status}: {result.error or 'no error given'}", keep_remote=False)
            return
        location = await self.store_output(job.output_key, result.output)
        cost = result.cost
        if cost is None and self.o.price_per_second is not None and result.duration_s is not None:
            cost = self.o.price_per_second * result.duration_s
        if cost is None:
            cost = self.o.price_per_job
        code = await self._completes((job.id, job.token, location, cost))
        if code != "OK":
            raise StaleLease(f"job {job.id}: lease lost before it could be completed ({code})")
        if cost is not None and job.remote_id is None and self.o.daily_spend_cap is not None:
            await self.store.add_spend(self.o.queue, self._window, cost - estimate)

    async def _cancel(self, job: ClaimedJob, remote_id: str | None) -> None:
        if remote_id:
            with contextlib.suppress(NotFound):
                await self.backend.cancel(remote_id)
        await self.store.ack_cancel(job.id, job.token)

    async def _retry(self, job: ClaimedJob, error: str, *, keep_remote: bool, delay_ms: int | None = None) -> None:
        await self._fail(job, error, retryable=True, keep_remote=keep_remote, delay_ms=delay_ms)

    async def _fail(self, job: ClaimedJob, error: str, *, retryable: bool, keep_remote: bool = False,
                    delay_ms: int | None = None) -> None:
        with contextlib.suppress(StaleLease):
            state = await self.store.fail(
                job.id, job.token, error, retryable=retryable, keep_remote=keep_remote,
                delay_ms=delay_ms if delay_ms is not None else retry_delay_ms(job.attempt), attempt=job.attempt,
            )
            log.info("job %s: %s -> %s", job.id, error[:200], state)
