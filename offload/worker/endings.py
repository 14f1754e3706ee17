"""How a job's attempt ends in the store: its output written (fenced), retried, failed or dead, or cancelled.

The last writes of every path through `jobpath.JobPath` (and its webhook half, `hookpath.HookPath`), kept apart
from the path itself: each goes through `StoreHealth.call`, so an outage makes the job wait where it is, and a
lease lost meanwhile is someone else's job now, never an error of this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from offload.backends.base import Backend, BackendError, NotFound
from offload.backoff import retry_delay_ms
from offload.errors import StaleLease
from offload.models import ClaimedJob
from offload.queue.batching import Batcher
from offload.queue.store import QueueStore
from offload.storage import StorageError
from offload.worker.health import StoreHealth
from offload.worker.options import WorkerOptions

log = logging.getLogger("offload.worker")
Fence = Callable[[], Awaitable[None]]
# (output key, output, run, fence) -> location. `run` names the remote run (the submission number), so files
# of two runs never share a key; `fence` is awaited right before the output itself is written.
StoreOutput = Callable[[str, Any, str, Fence], Awaitable[str]]


class Endings:
    """The store writes that end a job's attempt (mixed into the Worker through JobPath)."""

    store: QueueStore
    backend: Backend
    store_output: StoreOutput
    options: WorkerOptions
    health: StoreHealth
    settling: set[str]  # jobs whose last write is out: a lease lost meanwhile is not worth a warning
    _fences: Batcher[tuple[str, str], str]

    async def _store(self, job: ClaimedJob, output: Any, run: int) -> str:
        """Store the output. Object storage (our own infrastructure, like Redis) failing for a while costs the
        job nothing: it keeps its lease and its finished remote result and tries again, up to `poll_timeout`;
        only then (or for a failure that cannot heal, like an expired provider file) is the attempt given up."""
        deadline = time.monotonic() + self.options.poll_timeout
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
                if not await self.backend.cancel(remote_id):
                    log.warning(
                        "job %s: the backend cannot cancel remote job %s: it runs to its end", job.id, remote_id
                    )
        self.settling.add(job.id)
        await self.health.call(lambda: self.store.ack_cancel(job.id, job.token))

    async def _timed_out(self, job: ClaimedJob, remote_id: str, timeout: Exception) -> None:
        """`poll_timeout` passed with the remote job still running. A new run is submitted only once the provider
        took the cancel of this one: a backend that cannot cancel ends the job dead (or, with
        `resubmit_on_timeout`, pays for a second run, counted), and a cancel that failed keeps the remote job for
        the retry to poll again. Either way nothing is paid twice unseen."""
        waited = f"remote job {remote_id} still running after {self.options.poll_timeout:g}s"
        try:
            stopped = await self.backend.cancel(remote_id)
        except BackendError as exc:
            reason = f"{waited}; its cancel failed ({exc}), so it is kept (a retry polls it), not submitted again"
            await self._retry(job, f"polltimeout: {reason}", keep_remote=True)
            return
        if stopped:
            await self._retry(job, f"polltimeout: {timeout}; cancelled at the provider", keep_remote=False)
        elif self.options.resubmit_on_timeout:
            reason = f"{waited}; this backend cannot cancel it: submitted again (resubmit_on_timeout, counted)"
            await self._fail(job, f"polltimeout: {reason}", retryable=True, duplicate=True)
        else:
            reason = f"{waited}; this backend cannot cancel it, so it is not submitted again"
            await self._fail(job, f"polltimeout: {reason}", retryable=False, keep_remote=True)

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
        duplicate: bool = False,
    ) -> None:
        delay = delay_ms if delay_ms is not None else retry_delay_ms(job.attempt)
        self.settling.add(job.id)
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
                    duplicate=duplicate,
                )
            )
        except StaleLease:
            return
        log.info("job %s: %s -> %s", job.id, error[:200], state)
