"""The dispatch loop: one asyncio process keeps up to `concurrency` remote jobs in flight.

It claims in batches, runs each job as a task (`offload.worker.jobpath`: submit, record the remote id, poll,
store, complete), and keeps every lease alive with one heartbeat per interval. Nothing here sleeps on behalf of
another job: retries are scheduled in Redis, waits are per task.

`concurrency` is a number of slots, one per job at the provider (from its submit call to its result). A few
jobs more are claimed ahead and wait for a slot (on a synchronous API already begun: their submit intent
recorded), so a slot that frees is filled at once instead of after a claim's (and a begin's) round trips; the
output and the ack come after the slot is given back, so their round trips do not keep a remote job from
starting either (measured by bench/worker_throughput.py: waiting for a claim and for the ack inside the slot
cost a 50 ms job a third of its slot, the begin inside it another ~5 ms). See docs/explanation/architecture.md, *Slots*.

What the loop guarantees about leases: a heartbeat never runs while a claim is in flight (one lock), so every
lease the store has handed this process by the time a heartbeat is sent is either in its list or was never
received; the heartbeat lists (job id, token) pairs and hands the others back (`since`). A job claimed again
while an older task of it still runs (the old lease was reaped) starts only after the old task is stopped.
And the loop never exits for the job store's sake: claims, window rolls and the drain wait out an outage.

What a drain (SIGTERM) guarantees: no submission starts once it begins (the jobs that have not sent their call go
back unsent, their intents closed), and every submit call already out is awaited and its answer checkpointed
before the leases are handed back, for up to the backend's timeout, even past the grace; only a second signal (or
a call hung past that bound) cuts one off. See `_drain`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from offload.backends.base import Backend
from offload.connection import is_outage
from offload.eventloop import first_of
from offload.models import ClaimedJob
from offload.queue.backend_limits import BackendLimits
from offload.queue.batching import Batcher
from offload.queue.keyspace import hooks_channel, wake_channel
from offload.queue.memory import PolicyWatch, has_room
from offload.queue.store import CompleteItem, QueueStore
from offload.queue.store_clock import log_clock_step
from offload.worker import wakeups
from offload.worker.health import StoreHealth, describe
from offload.worker.hookpath import hook_backend
from offload.worker.jobpath import Drained, JobPath, StoreOutput, WorkerOptions
from offload.worker.prefetch import Prefetch
from offload.worker.slots import SlotPool

log = logging.getLogger("offload.worker")
# The store answers each release of held jobs with the time until its next cap window (its UTC day, never this
# host's); it is asked again at least this often, so a step of its clock is followed within seconds (the server's
# maintenance releases every second too).
WINDOW_RECHECK_S = 10.0
__all__ = ["StoreOutput", "Worker", "WorkerOptions", "default_worker_id"]
T = TypeVar("T")
# How long a drain waits, past the backend's timeout, for the answers of the calls that were out to be checkpointed
# (a store write, which waits out a short outage).
RECORD_S = 10.0


def default_worker_id() -> str:
    """`host:pid:random`. The random part makes every process a new worker to the store, also a container
    restarted with the same hostname and PID 1, which would otherwise inherit its predecessor's leases."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Worker(JobPath):
    """Serves one queue. `run(stop)` returns after a graceful drain once `stop` is set."""

    def __init__(
        self,
        store: QueueStore,
        backend: Backend,
        store_output: StoreOutput,
        limits: BackendLimits,
        options: WorkerOptions,
        *,
        worker_id: str | None = None,
        control: QueueStore | None = None,
    ) -> None:
        self.store, self.backend, self.store_output, self.limits = store, backend, store_output, limits
        # Claims and heartbeats on their own connection (when given): job tasks can keep every connection of
        # the main pool busy, and a heartbeat that waits for one past the lease loses every job.
        self.control = control or store
        self.options = options
        self._hook_backend = hook_backend(backend, options)
        self.id = worker_id or default_worker_id()
        # (with durability, the probe waits for replicas too: a write they did not confirm is sent again)
        self.health = StoreHealth(
            lambda: store.probe(options.queue),
            max_pause_s=min(2.0, options.lease_ms / 4000),
            room=functools.partial(has_room, store.redis),
            heal=functools.partial(store.reap, options.queue),  # trims first: the store's way back under its limit
        )
        # a store that may evict stops the claims and submissions (no new payments) until it is fixed
        self.policy = PolicyWatch(store.redis, what="claim or submission")
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.tokens: dict[str, str] = {}  # the newest lease of each job this process runs
        self.claimed_at: dict[str, float] = {}  # when the claim that delivered it was sent (monotonic)
        self.cancels: set[str] = set()
        self._submitting: set[str] = set()
        self._unsent: dict[str, str] = {}  # begun, not sent: a drain closes these intents (kept while draining)
        self._answers: set[str] = set()
        self._draining = False
        self._grace_over = False
        self._cut = asyncio.Event()  # a second signal: the drain ends at once (see run_workers)
        # Jobs whose last write (ack, failure, cancel) is on its way: a heartbeat that no longer finds their lease
        # has most likely raced that write, and the write's own reply tells the task what happened.
        self.settling: set[str] = set()
        self._cancel_waits: dict[str, asyncio.Event] = {}  # jobs waiting on the rate limit, woken by a cancel
        self.peak_in_flight = 0  # the most remote jobs at once (slots taken), at most `concurrency`
        self.in_flight = 0
        self._slots = SlotPool(options.concurrency)
        self._prefetch = Prefetch(options, time.monotonic())  # how many jobs to lease ahead of the slots
        # waiting for a slot, the rate limit or the gate, or pausing before a resend: nothing sent, a drain cancels
        self._ahead: dict[asyncio.Task[Any], ClaimedJob] = {}
        self._past: set[str] = set()  # jobs whose remote work is over: storing the output, acking
        self._room = asyncio.Event()  # set when a task ends: room to claim
        self._ready = asyncio.Event()  # set when jobs became ready after a claim found none (wakeups.py)
        self._next_window = 0.0  # when the store's next cap window begins (monotonic): the first loop releases
        self._lock = asyncio.Lock()  # claim and heartbeat, never both at once
        self._since: int | None = None  # the lease sequence number of the last heartbeat
        self._beat_at = 0.0  # when the last heartbeat that went through was sent (monotonic)
        # Each submission between its intent and its recorded remote id is one a kill would leave unknown: a
        # bounded number of them at a time bounds what one kill can cost (not for synchronous APIs, whose
        # submit is the whole job).
        self._gate = None if backend.synchronous else asyncio.Semaphore(options.submit_concurrency)
        # A synchronous API without a rate limit begins each job the moment it has it (see _submit), so the claim
        # opens the intents itself: one script call per job less (claim.lua's `begin`; caps leave it to begin).
        # Not with durability: the intent must be replicated before the call, and begin.lua's WAIT is resent
        # through an outage like any write of a job, where a claim's would not be.
        self._begin_at_claim = (
            backend.synchronous and not limits.interval_ms and self._hooks() is None and store.durability is None
        )
        # The per-job writes of the hot path, coalesced: thousands of tasks, a few script calls.
        q = options.queue
        self._checkpoints: Batcher[tuple[str, str, str, str, int], str] = Batcher(
            lambda items: store.checkpoint_many(q, items)
        )
        self._completes: Batcher[CompleteItem, str] = Batcher(lambda items: store.complete_many(q, items))
        self._begins: Batcher[tuple[str, str, str], str] = Batcher(self._begin_many)
        self._hooked: dict[str, asyncio.Event] = {}
        self._heard: dict[str, tuple[int, str]] = {}  # job id -> (submission, final body) a wake-up carried
        self._hook_bodies: Batcher[tuple[str, int], str | None] = Batcher(store.hook_bodies)
        self._fences: Batcher[tuple[str, str], str] = Batcher(lambda items: store.fence_many(q, items))
        self._beats: Batcher[None, None] = Batcher(self._beat_many, concurrency=1)
        self._handbacks: Batcher[ClaimedJob, None] = Batcher(self._release_unsent)

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, cut: asyncio.Event | None = None) -> None:
        """Serve until `stop`, then drain; `cut` (a second signal) ends the drain at once."""
        if cut is not None:
            self._cut = cut
        helpers = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self.policy.run())]
        if self.options.ingest_list:
            helpers.append(asyncio.create_task(self._ingest_loop(stop)))
        channels: dict[str, Callable[[str | None], None]] = {wake_channel(self.options.queue): self._ready_news}
        if self._hooks():
            channels[hooks_channel(self.options.queue, self.id)] = wakeups.hook_messages(self._wake)
        helpers.append(asyncio.create_task(wakeups.listen(self.store.redis, channels)))
        idle = 0.02
        try:
            while not stop.is_set():
                if not self.policy.safe:
                    await first_of(self.policy.wait_safe(), stop.wait())
                    continue
                free = self._room_to_claim()
                batch = min(free, self.options.claim_batch)
                claimed: list[ClaimedJob] = []
                self._ready.clear()  # before the claim: news that comes while it is out is not missed
                try:
                    await self._roll_window()
                    if batch > 0:
                        claimed = await self._claim(batch)
                except Exception as exc:
                    if not is_outage(exc):
                        raise
                    await first_of(self.health.after(exc), stop.wait())
                    continue
                if claimed and len(claimed) == batch:
                    idle = 0.02
                    continue
                self._room.clear()
                # Room (a task ended) or, with room, jobs made ready (wakeups.py); the poll is the fallback for
                # a lost message and for jobs that became due in the delayed and retry sets.
                wake = (self._room.wait(), self._ready.wait()) if free > 0 else (self._room.wait(),)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(first_of(*wake, stop.wait()), idle if free > 0 else None)
                idle = min(idle * 2, self.options.idle_poll_max) if not claimed else 0.02
        finally:
            await self._drain(helpers)

    async def _claim(self, n: int) -> list[ClaimedJob]:
        opts = self.options
        async with self._lock:
            sent = time.monotonic()
            jobs = await self.control.claim(
                opts.queue,
                self.id,
                n,
                opts.lease_ms,
                job_cap=opts.daily_job_cap,
                spend_cap=opts.daily_spend_cap,
                estimate=opts.reservation,
                begin=self._begin_at_claim,
            )
            self._prefetch.claimed(sent, time.monotonic())
            loop = asyncio.get_running_loop()
            for job in jobs:
                self._start(job, sent, loop)
        return jobs

    def _start(self, job: ClaimedJob, sent: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run a claimed job as a task (on `loop`: the claim passes it, one lookup per claim instead of one per job
        inside `asyncio.create_task`)."""
        old = self.tasks.get(job.id)
        if old is not None and job.id not in self._submitting:
            # our old lease of it was reaped (we stalled) and the store gave it back to us; an old task whose
            # submit call is out is left to record the answer (attached), which the new task then polls
            log.warning("job %s: leased to this worker again; its earlier task is stopped first", job.id)
            old.cancel()
        self.tokens[job.id] = job.token
        self.claimed_at[job.id] = sent
        self.settling.discard(job.id)  # an older lease's last write says nothing about this one
        self._past.discard(job.id)
        if job.begun:  # an open intent, nothing sent: a drain closes it (see _submit)
            self._unsent[job.id] = job.token
        self.tasks[job.id] = (loop or asyncio.get_running_loop()).create_task(self._run_job(job, old))

    def _take_free(self, job: ClaimedJob) -> bool:
        """A slot now, if one is free (see `_enter_remote`); False, taking nothing, if the job must wait."""
        if not self._slots.try_take():
            return False
        self._entered()
        return True

    async def _enter_remote(self, job: ClaimedJob) -> None:
        """Take a slot: at most `concurrency` jobs are past this point (submitting, at the provider, polled). A
        job that must wait is one of the jobs ahead (a drain cancels those at once)."""
        if self._take_free(job):
            return
        await self._wait_ahead(job, self._slots.acquire())
        self._entered()

    async def _wait_ahead(self, job: ClaimedJob, aw: Awaitable[T]) -> T:
        """Wait for `aw` (a slot, the rate limit, the submit gate, a pause before a resend) as one of the jobs
        ahead of their call: a drain cancels the wait and hands the job back; once draining none starts
        (`Drained`). Only a wait is registered, and its task looked up then (`asyncio.current_task` is a Python
        call in 3.11: once per job it was ~4 % of the worker's no-op run, bench/worker_throughput.py)."""
        if self._draining:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise Drained(job.id)
        task = asyncio.current_task()
        assert task is not None
        self._ahead[task] = job
        try:
            return await aw
        finally:
            self._ahead.pop(task, None)

    def _entered(self) -> None:
        """A slot was taken: count the job in flight."""
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight = self.in_flight

    def _leave_remote(self, job: ClaimedJob) -> None:
        self.in_flight -= 1
        self._slots.release()
        self._prefetch.left()
        if self._newest(job):
            self._past.add(job.id)
        self._room.set()

    def _room_to_claim(self) -> int:
        """Jobs to claim now. Up to `leased_max` jobs that are before or in their remote work (prefetch.py: how
        many ahead of the slots); the ones past it (storing an output, acking: a round trip or two) do not hold
        back the next claim, but they have an allowance of their own, `concurrency`, so that a storage outage
        stops the claiming (and paying) soon."""
        before = len(self.tasks) - len(self._past)
        most = self._prefetch.leased_max()
        return min(most - before, most + self.options.concurrency - len(self.tasks))

    def _ready_news(self, _: str | None) -> None:
        """Jobs became ready (or the subscription was lost and may have missed it): claim now."""
        self._ready.set()

    def _wake(self, job_id: str | None, submission: int, body: str | None) -> None:
        """A webhook for a job of ours was kept by the server: its task reads it now (None: every job, once the
        subscription is in place; see wakeups.py), from `body` when the message carried it."""
        if job_id is None:
            for event in self._hooked.values():
                event.set()
        elif job_id in self.tasks:
            if body is not None and submission > 0:
                self._heard[job_id] = (submission, body)
            self._hook_event(job_id).set()

    def _done(self, job: ClaimedJob) -> None:
        """A task ends: forget it, unless a newer lease of the same job has taken its place."""
        if self._newest(job):
            del self.tasks[job.id]
            self.tokens.pop(job.id, None)
            self.claimed_at.pop(job.id, None)
            self.cancels.discard(job.id)
            self.settling.discard(job.id)
            self._past.discard(job.id)
            self._hooked.pop(job.id, None)
            self._heard.pop(job.id, None)
            self._answers.discard(job.id)
            if not self._draining:
                self._unsent.pop(job.id, None)
        self._room.set()

    async def _drain(self, helpers: list[asyncio.Task[None]]) -> None:
        """Stop claiming and start no submission; hand the jobs that have not sent their call back at once (their
        intents closed: the next owner sends the same submission, not a possible duplicate); let the rest finish
        for the grace period. Then cut the polls (their remote ids are recorded: the next worker resumes them),
        but await every submit call still out, and a synchronous answer being stored, until the backend's timeout
        (from the drain's start: no call starts after it) plus RECORD_S, so that its answer is checkpointed
        instead of paid for again. Last, hand every lease back with its remote id. A second signal (`_cut`) ends
        every wait at once: a call it cuts leaves its intent open, and the next worker adopts or resends it,
        counted as a possible duplicate."""
        self._draining = True
        began = time.monotonic()
        ahead = dict(self._ahead)
        for task in ahead:
            task.cancel()
        log.info(
            "draining: no new submissions; %d waiting jobs handed back unsent, %d submit calls out awaited (up to "
            "%gs), the rest finish for up to %gs; a second SIGTERM or SIGINT cuts",
            len(ahead),
            len(self._submitting),
            self.options.backend_timeout + RECORD_S,
            self.options.grace_s,
        )
        if ahead:
            await asyncio.gather(*ahead, return_exceptions=True)
            await self._hand_back([job for job in ahead.values() if job.id not in self.tasks])
        await self._until_ended(list(self.tasks.values()), began + self.options.grace_s - time.monotonic())
        self._grace_over = True
        out = [t for j, t in self.tasks.items() if j in self._submitting or j in self._answers]
        for task in self.tasks.values():
            if task not in out:
                task.cancel()
        await self._until_ended(out, began + self.options.backend_timeout + RECORD_S - time.monotonic())
        left = sum(1 for j, t in self.tasks.items() if not t.done() and (j in self._submitting or j in self._answers))
        if left or self._cut.is_set():
            log.warning(
                "drain cut (%s) with %d submit calls out: their intents stay open, the next worker adopts or "
                "resends them, counted as possible duplicates",
                "a second signal" if self._cut.is_set() else "no answer within the backend's timeout",
                left,
            )
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for h in helpers:
            h.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await self._release_all()

    async def _release_all(self) -> None:
        """The drain's end: every task and helper has ended; flush the metrics and hand every lease back."""
        with contextlib.suppress(TimeoutError):  # metrics only: never hold a drain past a moment for them
            async with asyncio.timeout(2.0):
                await self.limits.flush()
        try:
            async with asyncio.timeout(max(5.0, self.options.lease_ms / 1000)):
                unsent = list(self._unsent.items())  # every task has ended: these never sent their call
                released = await self.health.call(
                    lambda: self.control.release_leases(self.options.queue, self.id, unsent=unsent)
                )
            log.info("drained: released %d leases (remote ids kept)", released)
        except TimeoutError:
            log.warning("drained without the job store: the leases run out instead (and count as expired)")
        await self.health.aclose()

    async def _until_ended(self, tasks: list[asyncio.Task[None]], timeout: float) -> None:
        """Until every task of `tasks` has ended, `timeout` has passed, or the drain is cut."""
        pending = [t for t in tasks if not t.done()]
        if not pending or timeout <= 0 or self._cut.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await first_of(asyncio.wait(pending), self._cut.wait())

    async def _hand_back(self, jobs: list[ClaimedJob]) -> None:
        """Draining: jobs that never sent their call go back to the queue now (uncounted, remote ids kept),
        closing the intents their leases opened, instead of at the drain's end; the jobs of one moment in one
        release. Bounded; whatever does not go through is handed back by the drain's last release."""
        if not jobs:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(5.0, self.options.lease_ms / 1000)):
                await first_of(
                    self.health.call(lambda: asyncio.gather(*(self._handbacks(job) for job in jobs))),
                    self._cut.wait(),
                )

    async def _release_unsent(self, jobs: list[ClaimedJob]) -> list[None]:
        unsent = [(job.id, token) for job in jobs if (token := self._unsent.get(job.id)) is not None]
        ids = [job.id for job in jobs]
        await self.control.release_leases(self.options.queue, self.id, ids, unsent=unsent)
        for job_id, _ in unsent:  # closed: the last release need not send them again
            self._unsent.pop(job_id, None)
        return [None] * len(jobs)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.lease_ms / 3000)
            try:
                await self._beats(None)
            except Exception as exc:  # an outage is waited out by the tasks; the next beat tries again
                if is_outage(exc):
                    self.health.failed(exc)
                else:
                    log.warning("heartbeat failed: %s", describe(exc))

    async def _beat(self) -> None:
        """Extend every lease in one call; stop the tasks whose lease is gone; hand back leases we never got."""
        async with self._lock:
            sent = time.monotonic()
            reply = await self.control.heartbeat(
                self.options.queue, self.id, list(self.tokens.items()), self.options.lease_ms, since=self._since
            )
            self._since, self._beat_at = reply.seq, sent
            if reply.stepped_back_ms:  # held jobs of a window the store's clock left behind were released too
                log_clock_step(self.options.queue, reply.stepped_back_ms)
                self._next_window = 0.0
            for job_id in reply.lost:
                if job_id in self.settling:
                    continue
                if job_id in self._submitting:  # its answer is recorded for the new owner, then the task ends
                    log.warning("lease of %s lost while its submit call is out", job_id)
                elif task := self.tasks.get(job_id):
                    log.warning("lease of %s lost; another worker owns it now", job_id)
                    task.cancel()
        if reply.released:
            log.warning(
                "handed back %d leases this worker never knew of (a claim whose reply was lost, or an "
                "earlier process with this worker id)",
                reply.released,
            )
        self.cancels.update(reply.cancel_requested)
        for job_id in reply.cancel_requested:
            if heard := self._cancel_waits.get(job_id):
                heard.set()
            if hooked := self._hooked.get(job_id):  # a task waiting for its webhook acts on the cancel now
                hooked.set()

    async def _beat_many(self, items: list[None]) -> list[None]:
        await self._beat()
        return [None] * len(items)

    def _lease_stale(self, job: ClaimedJob) -> bool:
        """Whether the lease must be proven fresh before paying for a submission. A process starved of CPU (an
        overloaded host, a SIGSTOP) can miss beats; if its leases lapsed, another worker may already own this
        job, and submitting now would pay twice. The lease is known fresh from the claim that delivered it or
        from a later heartbeat (which listed it); else `_renew_leases` first, which cancels this task if it is
        gone. A check, not a coroutine: it runs once or twice per job, and is almost always False."""
        fresh = max(self.claimed_at.get(job.id, 0.0), self._beat_at)
        return time.monotonic() - fresh > self.options.lease_ms / 3000

    async def _renew_leases(self) -> None:
        """A heartbeat now (joining one on its way), through any outage."""
        await self.health.call(lambda: self._beats(None))

    async def _ingest_loop(self, stop: asyncio.Event) -> None:
        assert self.options.ingest_list is not None
        while not stop.is_set():
            try:
                ok, bad = await self.store.ingest(
                    self.options.ingest_list, self.options.queue, max_attempts=self.options.max_attempts
                )
            except Exception as exc:
                if is_outage(exc):
                    await self.health.after(exc)
                else:
                    log.warning("ingest from %s failed: %s", self.options.ingest_list, exc)
                ok = bad = 0
            if ok + bad == 0:
                await asyncio.sleep(0.2)

    async def _roll_window(self) -> None:
        """Jobs held in an earlier cap window go back to ready: when the window rolls over during the worker's
        life, and when a worker starts in a later window than the one they were held in (a restart after
        midnight). The window is the store's UTC day, whatever this host's clock says: the store answers which
        window it is in and when the next begins, and this host only measures that wait (monotonic). Every worker
        may do this: moving a held job is atomic. The next release is scheduled only once this one went through,
        so one interrupted by an outage is done again."""
        if time.monotonic() < self._next_window:
            return
        done = await self.control.release_held(self.options.queue)
        self._next_window = time.monotonic() + min(max(done.next_window_s, 0.05), WINDOW_RECHECK_S)
        if done.released:
            log.info("cap window %s (the job store's UTC day): released %d held jobs", done.window, done.released)

    async def _begin_many(self, items: list[tuple[str, str, str]]) -> list[str]:
        opts = self.options
        return await self.store.begin_many(
            opts.queue,
            [(i, t, opts.reservation, h) for i, t, h in items],
            job_cap=opts.daily_job_cap,
            spend_cap=opts.daily_spend_cap,
            backend=opts.backend_name,
        )
