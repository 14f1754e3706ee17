"""Jobs routed to a provider batch API (offload.backends.batched), packed: one provider batch per pack, each job
completed on its own line (docs/how-to/batch-apis.md).

A job bound for a batch backend takes no `concurrency` slot: it holds a place in the backend's own pool
(`max_in_flight`, per worker), from before its begin to its line's end, so thousands of jobs wait in batches from
one process while the slots serve the per-job backends. Its lease is kept by the heartbeat like any other.

Never lost, never paid twice: each job's intent is opened by begin.lua (backend pinned) as it joins a pack; the
pack's record (`PackRecords`: pack id, count, time, each job's line) is written before the create; the batch
carries the pack id where the provider takes one (OpenAI's metadata); once created, each job records
`<batch id>#<line>` as its remote id and waits on the batch's one poll loop (batch_watch.py). A job whose intent
is open without a remote id (a worker killed inside the create, a lost answer) is looked for in the provider's
listing (`find_pack`) and adopted, or proven absent, before it is packed again.

A pack closes at `max_pack` jobs, before the provider's size limit, `max_wait_s` after its first job joined, or
`DEADLINE_MARGIN_S` before the earliest deadline (latest start) of its jobs. A draining worker creates no batch:
the jobs of an open pack go back unsent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from offload.backends.anthropic_batch import AnthropicBatch, custom_id
from offload.backends.base import BackendError, Fatal, RemoteResult, Throttled
from offload.backends.batch import LineResult, PackTooLarge
from offload.backends.batched import BatchBackend
from offload.backends.openai_batch import TAG, OpenAIBatch
from offload.errors import StaleLease
from offload.eventloop import within
from offload.queue.batch_packs import PackRecord, PackRecords
from offload.queue.replies import Begun, Verdict
from offload.worker.batch_watch import BatchWatch, find_pack
from offload.worker.context import WorkerContext
from offload.worker.endings import Endings
from offload.worker.job_run import Drained, JobRun
from offload.worker.routing import Lane
from offload.worker.slots import SlotPool
from offload.worker.submit import Submitter

log = logging.getLogger("offload.worker")
DEADLINE_MARGIN_S = 10.0  # a pack goes out this long before the earliest deadline (latest start) of its jobs
LINE_OVERHEAD = 256  # bytes a line adds to its body (custom_id, method, url; the params wrapper), counted generously


@dataclass(eq=False)
class Pack:
    """Jobs gathering for one batch. `lines`: each job's line, fixed at the close; `created`: the batch id (""
    when nothing was sent)."""

    id: str
    closes_at: float  # monotonic
    members: list[tuple[JobRun, Any]] = field(default_factory=list)
    size: int = 0
    closing: bool = False
    lines: dict[str, int] = field(default_factory=dict)
    created: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    changed: asyncio.Event = field(default_factory=asyncio.Event)


def batch_of(remote_id: str | None) -> str | None:
    """The batch id of a job's remote id (`<batch id>#<line>`)."""
    return remote_id.rpartition("#")[0] or remote_id if remote_id else None


class Packer:
    """One batch backend's packs and batches in one worker."""

    def __init__(
        self, ctx: WorkerContext, lane: Lane, submitter: Submitter, endings: Endings, room: asyncio.Event
    ) -> None:
        assert isinstance(lane.backend, BatchBackend)
        self.ctx, self.lane, self.backend = ctx, lane, lane.backend
        self.submitter, self.endings = submitter, endings
        self.room = room  # the claim loop's: set when a job leaves the slots' count for the pool
        self.pool = SlotPool(self.backend.settings.max_in_flight)
        self.held = 0  # jobs holding a place in the pool (not the slots: see Runs.batched)
        self.records = PackRecords(ctx.store.redis, ctx.options.queue)
        self.open: Pack | None = None
        self.watches: dict[str, BatchWatch] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.created_at: dict[str, float] = {}  # batches this process created (monotonic): their run time measured
        self.mean_s: float | None = None  # batches' mean run time, create to results, in this process

    async def run(self, run: JobRun, job_input: Any) -> RemoteResult | None:
        """The job's line: sent in a pack (or found where a lost create put it), then awaited. None: the job has
        moved on (cancelled, held, failed, back to the queue)."""
        ctx = self.ctx
        await ctx.wait_ahead(run.job, self.pool.acquire())
        run.sent_at = time.monotonic()  # (a resumed batch: its run time from here, a lower bound)
        ctx.runs.batched += 1
        self.held += 1
        self.room.set()  # one job less held against the claims: claim more now
        try:
            batch_id = batch_of(run.remote_id)
            if batch_id is None and run.job.intent_open:
                batch_id = await self._adopt(run)
            if batch_id is None:
                batch_id = await self._send(run, self.backend.request(run.on.job_input(job_input)))
            if batch_id is None:
                return None
            return await self._line(run, batch_id)
        finally:
            ctx.runs.batched -= 1
            self.held -= 1
            self.pool.release()

    async def _adopt(self, run: JobRun) -> str | None:
        """An open intent without a remote id: its pack's batch, found in the provider's listing and recorded; None
        once proven absent (or the job never reached a create). A listing that fails raises: no resubmit then."""
        job = run.job
        rec = await self.ctx.health.call(lambda: self.records.lookup(job.id))
        if rec is None or rec.backend != self.lane.name:
            return None
        poll_cap = self.backend.settings.batch_poll_interval_s
        found = await find_pack(self.backend.client, rec, job.id, poll_cap)
        if found is None:
            log.info("job %s: pack %s was never created at %s; packed again", job.id, rec.pack, self.lane.name)
            await self.ctx.health.call(lambda: self.records.forget(job.id))  # (it may end before a new pack)
            return None
        log.warning("job %s: adopted batch %s of pack %s (its create's answer was lost)", job.id, found, rec.pack)
        run.remote_id = await self.submitter.record_known(run, f"{found}#{rec.line}", run.submission)
        return found

    async def _send(self, run: JobRun, body: Any) -> str | None:
        """Begin (intent open, backend pinned), join a pack, and once its batch is created record the line."""
        job = run.job
        size = len(orjson.dumps(body)) + LINE_OVERHEAD
        if problem := self._refusal(job.id, body, size):  # one job the provider would refuse must not sink its pack
            await self.endings.fail(run, f"fatal: {problem}", retryable=False)
            return None
        deadline = await self._deadline(job.id)
        if not self.ctx.storage_gate.open:  # this host's clock refused by the storage (worker/storage_gate.py)
            await self.ctx.wait_ahead(job, self.ctx.storage_gate.wait_open())
        if not self.ctx.policy.current:  # the store may evict: no new intent until it is fixed (queue/memory.py)
            await self.ctx.wait_ahead(job, self.ctx.policy.confirm())
        item = (job.id, job.token, "", self.lane.name, run.why)
        verdict = await self.ctx.health.call(lambda: self.ctx.writes.begins(item))
        if verdict.verdict is not Verdict.OK:
            return await self._not_begun(run, verdict)
        run.submission = verdict.submission
        run.unsent = job.token  # until its pack closes, a drain hands it back with the intent closed
        pack = self._join(run, body, size, deadline)  # (nothing awaited since the begin: no drain in between)
        try:
            try:
                batch_id = await self.ctx.wait_ahead(job, asyncio.shield(pack.created))
            except asyncio.CancelledError:
                self._leave(pack, run)
                raise
            except BackendError as exc:
                if exc.maybe_accepted:  # the batch may exist: the intent stays open, the next owner looks for it
                    raise
                await self._not_created(run, exc)
                return None
            line = pack.lines.get(job.id)
            if line is None or not batch_id:  # left out at the close: cancelled meanwhile, or its lease lost
                if not run.cancel:
                    raise StaleLease(f"job {job.id}: left out of its pack, its lease lost")
                closable, run.unsent = run.unsent is not None, None
                await self.endings.cancel(run, None, unsent=closable)
                return None
            run.remote_id = await self.submitter.record_known(run, f"{batch_id}#{line}", run.submission)
            run.sent_at = time.monotonic()
            return batch_id
        finally:
            run.submitting = False

    async def _not_created(self, run: JobRun, exc: BackendError) -> None:
        """The provider answered the create with an error: no batch exists, so the intent is closed and the
        reservation refunded; a refusal (a 4xx) is the same for every try, anything else is retried."""
        delay = int(exc.retry_after * 1000) if isinstance(exc, Throttled) and exc.retry_after else None
        error = f"{type(exc).__name__.lower()}: batch create: {exc}"
        retry = not isinstance(exc, Fatal)
        # forgotten before the job is let go: once back in the queue, a new owner may write a record of its own
        await self.ctx.health.call(lambda: self.records.forget(run.job.id))
        await self.endings.fail(run, error, retryable=retry, answered=True, refund=True, delay_ms=delay)

    async def _not_begun(self, run: JobRun, verdict: Begun) -> str | None:
        job = run.job
        if verdict.verdict is Verdict.CANCEL:
            await self.endings.cancel(run, None)
        elif verdict.verdict is Verdict.REMOTE:
            run.remote_id, run.submission = verdict.detail, verdict.submission
            return batch_of(verdict.detail)
        elif verdict.verdict is Verdict.MOVED:  # an earlier submission of unknown outcome settles there first
            await self.endings.fail(run, f"pinned to backend {verdict.detail}: settled there first", retryable=True)
        elif verdict.verdict is not Verdict.CAP:
            raise StaleLease(f"job {job.id}: lease lost before its pack ({verdict})")
        return None

    async def _deadline(self, job_id: str) -> float | None:
        """The job's deadline (latest start, epoch seconds on the store's clock), read from its record: the claim
        does not carry it, and only a packed job waits long enough for it to matter here."""
        raw = await self.ctx.health.call(lambda: self.records.job_field(job_id, "deadline"))
        return int(raw) / 1000 if raw else None

    def _refusal(self, job_id: str, body: Any, size: int) -> str | None:
        """Why the provider would refuse this job in any pack (not a request body, too large alone, an id it cannot
        carry: OpenAI fails a whole batch over one such line), or None."""
        if not isinstance(body, dict):
            return "the job's input must be a JSON object (the request body of its batch line)"
        if size > self.backend.max_bytes:
            return f"the job's request ({size} bytes) is over {self.lane.name}'s batch size limit"
        if isinstance(self.backend.client, AnthropicBatch):
            try:
                custom_id(job_id)
            except PackTooLarge as exc:
                return str(exc)
        return None

    def _join(self, run: JobRun, body: Any, size: int, deadline: float | None) -> Pack:
        """The open pack with this job in it (a full one closed first); a deadline may bring its close forward."""
        pack = self.open
        if pack is not None and pack.size + size > self.backend.max_bytes:
            self._close(pack, "size")
            pack = None
        if pack is None:
            pack = self._open()
        pack.members.append((run, body))
        pack.size += size
        if deadline is not None:
            at = time.monotonic() + deadline - time.time() - DEADLINE_MARGIN_S
            if at < pack.closes_at:
                pack.closes_at = at
                pack.changed.set()
        if len(pack.members) >= self.backend.max_pack:
            self._close(pack, "max_pack")
        return pack

    def _leave(self, pack: Pack, run: JobRun) -> None:
        """A member stopped before its pack closed (a drain): it is not sent; an emptied pack is dropped."""
        if pack.closing:
            return
        pack.members = [(r, b) for r, b in pack.members if r is not run]
        if not pack.members:
            pack.closing = True
            pack.changed.set()
            if self.open is pack:
                self.open = None

    def _open(self) -> Pack:
        pack = Pack(secrets.token_hex(8), time.monotonic() + self.backend.settings.max_wait_s)
        self.open = pack
        self._spawn(self._timer(pack), f"pack {pack.id}")
        return pack

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _timer(self, pack: Pack) -> None:
        while not pack.closing:
            pack.changed.clear()
            with contextlib.suppress(TimeoutError):
                await within(pack.changed.wait(), max(0.0, pack.closes_at - time.monotonic()))
            if not pack.closing and time.monotonic() >= pack.closes_at:
                self._close(pack, "max_wait_s or a deadline")

    def _close(self, pack: Pack, why: str) -> None:
        if pack.closing:
            return
        pack.closing = True
        pack.changed.set()
        if self.open is pack:
            self.open = None
        log.info("pack %s of %s: closed with %d jobs (%s)", pack.id, self.lane.name, len(pack.members), why)
        self._spawn(self._create(pack), f"create {pack.id}")

    async def _create(self, pack: Pack) -> None:
        """The pack's batch: its record first, then the create; each member records its own line. From here on
        no drain stops a member: its create's answer is awaited and recorded (`submitting`)."""
        ctx, leases = self.ctx, self.submitter.leases
        if not ctx.policy.current:  # the pack waited since its members began: the store may evict now
            await ctx.policy.confirm()  # (a drain meanwhile cancels the members: left out below)
        if any(leases.stale(r) for r, _ in pack.members):  # a stalled process: leases proven before paying
            await leases.renew()  # (a lease found lost cancels its task: left out below)
        members = [(r, b) for r, b in pack.members if not (r.task and r.task.cancelling()) and ctx.runs.newest(r)]
        for r, _ in members:
            if r.task is not None:
                ctx.ahead.pop(r.task, None)
        if ctx.draining:
            pack.created.set_exception(Drained(f"pack {pack.id}"))
            return
        live = [(r, b) for r, b in members if not r.cancel]
        if not live:
            pack.created.set_result("")
            return
        for r, _ in live:
            r.submitting, r.unsent = True, None
        ids = [r.job.id for r, _ in live]
        pack.lines = {job_id: i for i, job_id in enumerate(ids)}
        try:
            rec = PackRecord(pack.id, self.lane.name, len(ids), time.time())
            await ctx.health.call(lambda: self.records.record(ids, rec))
            batch_id = await self._submit(pack.id, [(r.job.id, b) for r, b in live])
        except Exception as exc:
            log.warning("pack %s of %s: create failed: %s", pack.id, self.lane.name, exc)
            pack.created.set_exception(exc)
            return
        log.info("pack %s of %s: batch %s with %d jobs", pack.id, self.lane.name, batch_id, len(ids))
        self.lane.limits.note("submitted")
        self.created_at[batch_id] = time.monotonic()
        pack.created.set_result(batch_id)

    async def _submit(self, pack_id: str, lines: list[tuple[str, Any]]) -> str:
        client = self.backend.client
        if isinstance(client, OpenAIBatch):
            return await client.submit(lines, metadata={TAG: pack_id})
        return await client.submit(lines)

    async def _line(self, run: JobRun, batch_id: str) -> RemoteResult | None:
        """The job's line once its batch has ended (one poll loop per batch), ended here unless it succeeded."""
        job = run.job
        if self.ctx.grace_over:  # a drain past its grace: the next owner polls the batch (its remote id recorded)
            return None
        watch = self.watches.get(batch_id)
        if watch is None:
            cap = self.backend.settings.batch_poll_interval_s
            watch = self.watches[batch_id] = BatchWatch(self.backend.client, batch_id, cap)
            watch.done.add_done_callback(lambda _: self._unwatch(batch_id, watch))
        watch.members[job.id] = run
        try:
            results = await asyncio.shield(watch.done)
        except Fatal as exc:  # the batch failed as a whole (OpenAI's validation): none of its lines ran
            await self.ctx.health.call(lambda: self.records.forget(job.id))
            await self.endings.fail(run, f"fatal: {exc}", retryable=False, answered=True, refund=True)
            return None
        finally:
            watch.members.pop(job.id, None)
            if not watch.members and not watch.done.done():  # nobody waits here any more (a drain)
                watch.task.cancel()
                self._unwatch(batch_id, watch)
        await self.ctx.health.call(lambda: self.records.forget(job.id))
        return await self._ended(run, batch_id, results.get(job.id))

    def _unwatch(self, batch_id: str, watch: BatchWatch) -> None:
        if self.watches.get(batch_id) is watch:
            del self.watches[batch_id]
        created = self.created_at.pop(batch_id, None)
        if created is not None and watch.done.done() and not watch.done.cancelled() and not watch.done.exception():
            self._measured(time.monotonic() - created)

    def _measured(self, run_s: float) -> None:
        """A batch's run time: the lane's `turnaround_s` (what a router compares with a deadline) follows the
        mean of this process's batches (a moving mean) instead of `expected_duration_s`."""
        self.mean_s = run_s if self.mean_s is None else 0.8 * self.mean_s + 0.2 * run_s
        self.lane.turnaround_s = self.backend.settings.max_wait_s + self.mean_s

    async def _ended(self, run: JobRun, batch_id: str, line: LineResult | None) -> RemoteResult | None:
        job_id = run.job.id
        if await self.ctx.health.call(lambda: self.records.job_field(job_id, "cancel")) == "1":
            run.cancel = True  # (read now: the heartbeat that would tell may be seconds away)
        if run.cancel:  # the operator's cancel, honoured now that the batch has ended: its line is discarded
            await self.endings.cancel(run, None)
            return None
        if line is None:
            line = LineResult("expired", error="not in the batch's results")
        if line.ok:
            return RemoteResult("succeeded", output=line.output)
        if line.kind == "errored":
            error = f"batch line errored: {line.error}"
            fatal = line.status is not None and 400 <= line.status < 500 and line.status not in (408, 409, 429)
            await self.endings.fail(run, error, retryable=not fatal, answered=True, refund=True)
            return None
        # canceled or expired: it never ran, nothing is paid; it goes out again in a later pack, its attempt given
        # back (a return is not a try: a job whose batches keep expiring must not die of it)
        error = f"batch {batch_id}: {line.kind} before its line ran; back to the queue"
        await self.endings.fail(run, error, retryable=True, answered=True, refund=True, delay_ms=0, returned=True)
        return None

    async def aclose(self) -> None:
        for task in [*self.tasks, *(w.task for w in self.watches.values())]:
            task.cancel()
