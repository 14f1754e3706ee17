"""The webhook half of a job's path (see jobpath.py): waiting for a kept webhook instead of polling.

With webhooks on (`WorkerOptions.hook_base`), a job's result comes from the final webhook the server kept in the
job record (hook.lua), read when the worker's subscription wakes the job (wakeups.py) and once up front; the
provider is polled only every `hook_poll_interval`, so a webhook that never comes cannot strand the job. And a
job whose last submission's outcome is unknown waits `hook_grace_s` for that submission's webhook before paying
for it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING

import orjson

from offload.backends.base import Backend, NotFound, RemoteResult, Throttled, Transient, WebhookBackend
from offload.errors import StaleLease, WorkerError
from offload.models import ClaimedJob
from offload.queue.backend_limits import BackendLimits
from offload.queue.batching import Batcher
from offload.worker.endings import Endings
from offload.worker.lag import Sighting

if TYPE_CHECKING:
    from offload.worker.options import WorkerOptions

log = logging.getLogger("offload.worker")


class PollTimeout(WorkerError):
    """The remote job did not finish within `poll_timeout`."""


class HookPath(Endings):
    limits: BackendLimits
    cancels: set[str]
    _hook_backend: WebhookBackend | None  # see _hooks
    _hooked: dict[str, asyncio.Event]  # jobs in flight a webhook may wake (see wakeups.py)
    _heard: dict[str, tuple[int, str]]  # the final body a wake-up carried, by job id (see wakeups.py)
    _hook_bodies: Batcher[tuple[str, int], str | None]  # QueueStore.hook_bodies, coalesced

    def _hooks(self) -> WebhookBackend | None:
        """The backend, when this worker's submissions carry webhook URLs. Decided once (`hook_backend`): an
        isinstance check against a runtime Protocol walks its members, and this is asked a few times per job."""
        return self._hook_backend

    def _hook_event(self, job_id: str) -> asyncio.Event:
        return self._hooked.setdefault(job_id, asyncio.Event())

    async def _await_hook(self, job: ClaimedJob, run: int) -> str | None:
        """Submission `run` of this job may have reached the provider (its worker died inside the submit call):
        wait up to the grace for its webhook, which records its remote id (hook.lua), instead of paying again.
        Replicate's `start` usually recorded it before this job was even re-claimed (then the claim carries the
        id and nothing waits here); this wait is for a late `start` (woken by hook.lua's PUBLISH) or, on
        providers that call only on completion, for that."""
        heard = self._hook_event(job.id)
        deadline = time.monotonic() + self.options.hook_grace_s
        while True:
            heard.clear()
            remote_id, current = await self.health.call(lambda: self.store.current_remote(job.id))
            if current != run:
                raise StaleLease(f"job {job.id}: submission {run} is no longer current ({current})")
            if remote_id is not None:
                log.info("job %s: submission %d adopted from its webhook; not submitted again", job.id, run)
                return remote_id
            left = deadline - time.monotonic()
            if left <= 0 or job.id in self.cancels:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(heard.wait(), left)

    def _sighting(self) -> Sighting:
        """A remote job's sighting (worker/lag.py), with the grace bounded by `poll_timeout`."""
        return Sighting(min(self.options.not_found_grace_s, self.options.poll_timeout))

    async def _lagging(self, job: ClaimedJob, exc: NotFound, lag: Sighting) -> bool:
        """Whether `exc`, a 404 for the job's remote job, is the provider's status lagging its submit (poll on)
        rather than expiry. A NotFound that is no 404 (a result the provider said it removed) is expiry."""
        if exc.status != 404:
            return False
        lagging = await lag.lagging(lambda: self.health.call(lambda: self.store.submitted_age_ms(job.id)))
        if lagging:
            log.debug("job %s: its remote job is not found yet; taken for a status that lags the submit", job.id)
        return lagging

    async def _poll_hooked(self, job: ClaimedJob, remote_id: str, run: int, lag: Sighting) -> RemoteResult | None:
        """With webhooks on: the result comes from the webhook the server kept, taken from the wake-up or read at
        once when woken, and read once up front (it may have come before this task, or before this worker
        claimed the job); the provider is polled only every `hook_poll_interval`, so a webhook that never comes
        cannot strand the job, and at once when the kept body lacks the result (fal's `payload_error`)."""
        hooks = self._hooks()
        assert hooks is not None
        heard = self._hook_event(job.id)
        deadline = time.monotonic() + self.options.poll_timeout
        next_poll = time.monotonic() + self.options.hook_poll_interval
        transient = 0
        while True:
            if job.id in self.cancels:
                await self._cancel(job, remote_id)
                return None
            heard.clear()
            carried = self._heard.pop(job.id, None)
            if carried is not None and carried[0] == run:
                body: str | None = carried[1]  # the wake-up brought it: no read (wakeups.py)
            else:
                body = await self.health.call(lambda: self._hook_bodies((job.id, run)))  # batched: a burst wakes many
            if body is not None:
                kept = _kept(hooks, body)
                if kept is not None:
                    return kept
                next_poll = min(next_poll, time.monotonic())
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.options.hook_poll_interval
                try:
                    result = await self.backend.poll(remote_id)
                    transient = 0
                    lag.seen = True
                    if result.terminal:
                        return result
                except NotFound as exc:
                    if not await self._lagging(job, exc, lag):
                        raise
                    next_poll = time.monotonic() + min(self.options.poll_interval, self.options.hook_poll_interval)
                except Throttled as exc:
                    self.limits.note("throttled")
                    await self.health.call(functools.partial(self.limits.cool_down, exc.retry_after or 5.0))
                except Transient:
                    self.limits.note("errors")
                    transient += 1
                    if transient >= 10:
                        raise
                    next_poll = time.monotonic() + min(self.options.poll_interval, self.options.hook_poll_interval)
            now = time.monotonic()
            if now > deadline:
                raise PollTimeout(f"remote job {remote_id} not done after {self.options.poll_timeout:g}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(heard.wait(), max(0.0, min(next_poll, deadline) - now))


def _kept(hooks: WebhookBackend, body: str) -> RemoteResult | None:
    """The result a kept final webhook body carries, or None (unreadable, or without the result)."""
    try:
        result = hooks.hook_result(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None
    return result if result is not None and result.terminal else None


def hook_backend(backend: Backend, options: WorkerOptions) -> WebhookBackend | None:
    """`backend` when the worker's submissions carry webhook URLs (`hook_base` set and a provider that calls
    back), else None."""
    return backend if options.hook_base and isinstance(backend, WebhookBackend) else None
