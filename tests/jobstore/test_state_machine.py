"""Stateful property test of the job store: random operation sequences against a real Valkey, checked
step by step against a plain-Python model of the lifecycle (docs/explanation/architecture.md, "The job lifecycle" and
"The guarantees").

Rules: enqueue (one or a batch, random priority, optional delay, existing ids mixed in); claim (3 workers,
random batch size, sometimes on a paused queue); a worker's turn (heartbeat, claim, then per lease: submit
= checkpoint of a remote id, complete, retryable or fatal fail, hold, the cancel it was asked for, or
nothing); complete and complete_many with live, superseded, stale and already-winning tokens; every other
write with a stale token; cancel of any job in any state, and of a running job followed through to its
worker's ack or the worker's death; release_leases; release of held jobs and requeue of dead ones; reap;
clock ticks, lease expiry of all workers but some survivors, a worker crash; SIGKILL/SIGTERM and restart
of Valkey (AOF, appendfsync always: nothing may be lost).

Invariants, after every step: each job's record equals the model (state, attempts, lease expiries, owner,
token, lease deadline, backend and remote id, cancel flag, error, result, cost, timestamps); the counts
of stats() equal the model's per state, its totals the model's (succeeded = successful completes: no job
completes twice), its live workers and paused flag too; every job is listed by list_jobs in exactly one
state, in the order the store promises (priority then FIFO for ready jobs), and none is lost; claims hand
out jobs in that order, re-delivered ones with their remote id (state submitted) and cancel flag; a job
whose lease expired more than max_attempts times is dead with "lease expired" (unless a cancel ended it).

Time is virtual: the store's injected clock is passed to every script as ARGV `now`, so leases expire and
delayed jobs come due by moving `self.now`, never by sleeping. Hypothesis stateful is synchronous, so the
async store runs on one private event loop shared by the whole run. The machine owns its Valkey because
one of its rules kills it. The model mirrors the Lua where the design leaves details open (ready-order
scores, lease expiry counting, cancel flags, and: a complete repeated with the token that completed the
job answers OK and changes nothing, any other stale token is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import redis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as conjecture_engine
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support.servers import ValkeyServer

from offload.connection import connect
from offload.errors import InvalidTransition, StaleLease
from offload.models import Job
from offload.queue.keyspace import STATE_SETS
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

T = TypeVar("T")

Q = "sm"
LEASE = 10_000
T0 = 1_700_000_000_000
RETENTION = 30 * 86_400  # far longer than any run's virtual time: retention never deletes a record here
PRIO_SPAN = 10**12
WORKERS = ("w1", "w2", "w3")
LEASED = ("active", "submitted")
TERMINAL = ("succeeded", "dead", "cancelled")
COUNT_NAMES = (
    "queued",
    "delayed",
    "active",
    "submitted",
    "retrying",
    "held",
    "succeeded",
    "dead",
    "cancelled",
)
MAX_JOBS = 40  # per example, and at most MAX_WAITING unfinished at a time
MAX_WAITING = 16
MAX_RESTARTS = 2  # per example: a restart replays the AOF, the slowest step by far
AOF_COMPACT_BYTES = 1 << 20
SHRINK_SECONDS = 45

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

PRIORITIES = st.sampled_from([0, 0, 0, 1, -1, 1000, -1000])  # mostly equal: FIFO order matters
DELAYS = st.sampled_from([None, None, None, 0, 0.5, 2, 7])  # seconds; 0 means "no delay" to the store
SPECS = st.fixed_dictionaries({"priority": PRIORITIES, "delay": DELAYS, "max_attempts": st.integers(1, 3)})


@dataclass
class MJob:
    """What one job's record should hold. `score` is its place in the ready set, `term_score` in its
    terminal set (finish time + retention)."""

    id: str
    input: Any
    priority: int
    max_attempts: int
    created_at: int
    state: str
    score: int | None = None
    ready_at: int | None = None  # when it last entered the ready set (a returned lease too)
    queued_since: int | None = None  # when it last entered it afresh (a returned lease keeps this)
    run_at: int | None = None
    held_at: int | None = None
    started_at: int | None = None
    finished_at: int | None = None
    term_score: int | None = None
    attempts: int = 0
    expiries: int = 0
    owner: str | None = None
    token: str | None = None
    backend: str | None = None
    remote_id: str | None = None
    intent_open: bool = False  # a submit intent with no remote id recorded (its outcome unknown)
    cancel: bool = False
    error: str | None = None
    result: str | None = None
    cost: float | None = None
    completes: int = 0


@dataclass(frozen=True)
class Lease:
    """A token a worker was once given; it stays in the pool after it goes stale."""

    job_id: str
    token: str
    worker: str


class Backend:
    """What the whole run shares: the Valkey, one event loop and one client (replaced after a restart),
    so examples cost no connection set-up."""

    def __init__(self, server: ValkeyServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.client: Any = None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def connect(self) -> None:
        if self.client is not None:
            self.run(self.client.aclose())
        self.client = self.run(connect(self.server.url, retry_for=10))

    def compact_aof(self) -> None:
        """Rewrite the AOF now and then, or each restart would replay the whole run so far (and shrinking
        a failure, hundreds of examples with restarts, would crawl). Waited for, so no restart kills
        Valkey in the middle of a rewrite."""
        info = self.run(self.client.info("persistence"))
        if int(info["aof_current_size"]) <= AOF_COMPACT_BYTES:
            return
        with contextlib.suppress(redis.ResponseError):  # one is in progress already
            self.run(self.client.bgrewriteaof())
        deadline = time.monotonic() + 10
        while any(
            int(self.run(self.client.info("persistence"))[k])
            for k in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
        ):
            assert time.monotonic() < deadline, "AOF rewrite did not finish within 10 s"
            time.sleep(0.005)

    def restart(self, graceful: bool) -> None:
        if graceful:
            self.server.stop()
        else:
            self.server.kill()
        self.server.restart()
        self.connect()

    def close(self) -> None:
        if self.client is not None:
            self.run(self.client.aclose())
        self.loop.close()


class QueueMachine(RuleBasedStateMachine):
    backend: Backend  # set by the test function

    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.store: QueueStore | None = None
        self.jobs: dict[str, MJob] = {}
        self.workers: dict[str, int] = {}  # worker id -> lease deadline (its entry in the workers zset)
        self.beliefs: dict[str, set[str]] = {w: set() for w in WORKERS}  # jobs each worker thinks it holds
        self.leases: list[Lease] = []
        self.totals: Counter[str] = Counter()
        self.seq = 0
        self.n_jobs = 0
        self.n_remote = 0
        self.paused = False
        self.restarts = 0
        self.seen: int | None = None  # when a worker-side script last ran (the queue's `seen` stamp)
        self.excused: set[str] = set()  # workers whose lease an outage moved on, until they speak again
        self.last_seq: dict[str, int] = {}  # the lease sequence number each worker's last heartbeat returned

    # -- plumbing ---------------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.backend.run(coro)

    @property
    def s(self) -> QueueStore:
        assert self.store is not None
        return self.store

    def _new_store(self) -> None:
        self.store = QueueStore(self.backend.client, clock_ms=lambda: self.now, lease_ms=LEASE)

    @initialize(specs=st.lists(SPECS, min_size=1, max_size=8))
    def start(self, specs: list[dict[str, Any]]) -> None:
        """A flushed database (each example starts from nothing) and a first batch of jobs."""
        if self.backend.client is None:
            self.backend.connect()
        self.run(self.backend.client.flushdb())
        self.backend.compact_aof()
        self._new_store()
        self._enqueue(list(specs), bulk=True)

    # -- the model: each helper mirrors one piece of the Lua includes -------------------------------------

    def _in(self, *states: str) -> list[MJob]:
        return [j for j in self.jobs.values() if j.state in states]

    def _owned(self, worker: str) -> list[str]:
        return sorted(j.id for j in self._in(*LEASED) if j.owner == worker)

    def _valid(self, lease: Lease) -> bool:
        j = self.jobs[lease.job_id]
        return j.state in LEASED and j.token == lease.token

    def _repeat(self, lease: Lease) -> bool:
        """This lease is the one whose complete went through: a repeat of it (the reply was lost and the
        client retried) answers OK again and changes nothing (complete.lua); other stale tokens: STALE."""
        j = self.jobs[lease.job_id]
        return j.state == "succeeded" and j.token == lease.token

    def _make_ready(self, ids: list[str], fresh: bool) -> None:
        for jid in ids:
            j = self.jobs[jid]
            if fresh:  # behind everything of its priority; a returned lease keeps its old place
                self.seq += 1
                j.score, j.queued_since = (1000 - j.priority) * PRIO_SPAN + self.seq, self.now
            assert j.score is not None
            if j.cancel:  # a cancel that waits for its remote job: ahead of every priority, in sequence order
                j.score = j.score % PRIO_SPAN - PRIO_SPAN
            j.state, j.owner, j.token, j.ready_at = "queued", None, None, self.now

    def _finish(self, ids: list[str], state: str, error: str | None = None) -> None:
        for jid in ids:
            j = self.jobs[jid]
            # the token stays on the record (not a lease any more): it recognises a repeated complete
            j.state, j.owner, j.finished_at = state, None, self.now
            j.term_score = self.now + RETENTION * 1000
            if error is not None:
                j.error = error
        self.totals[state] += len(ids)

    def _promote(self, limit: int = 1000) -> int:
        moved = 0
        for state in ("delayed", "retrying"):
            due = sorted((j.run_at, j.id) for j in self._in(state) if (j.run_at or 0) <= self.now)
            self._make_ready([jid for _, jid in due[:limit]], fresh=True)
            moved += len(due[:limit])
            if due:
                event(f"promote: due {state} jobs -> queued")
        return moved

    def _return_leases(self, ids: list[str], counted: bool) -> int:
        back, dead, cancelled = [], [], []
        for jid in ids:
            j = self.jobs[jid]
            j.attempts -= 1  # an attempt that ended without a verdict is given back
            if counted:
                j.expiries += 1
            if j.cancel and not j.remote_id and not j.intent_open:
                cancelled.append(jid)
            elif j.expiries > j.max_attempts:
                j.attempts += 1
                dead.append(jid)
            else:
                back.append(jid)
        self._finish(cancelled, "cancelled")
        self._finish(dead, "dead", "lease expired")
        self._make_ready(back, fresh=False)
        how = "expired" if counted else "released"
        for outcome, group in (("cancelled", cancelled), ("dead", dead), ("back to ready", back)):
            if group:
                event(f"lease {how} -> {outcome}")
        if any(self.jobs[jid].remote_id for jid in back):
            event(f"lease {how} -> back to ready with its remote id")
        return len(ids)

    def _reap_workers(self, limit: int) -> int:
        n = 0
        for _, worker in sorted((d, w) for w, d in self.workers.items() if d <= self.now)[:limit]:
            n += self._return_leases(self._owned(worker), counted=True)
            self._forget(worker)
        return n

    def _forget(self, worker: str) -> None:
        self.workers.pop(worker, None)
        self.excused.discard(worker)

    def _stamp(self, lease_ms: int) -> None:
        """`stamp` (outages.lua): a silence of the whole queue longer than half the caller's lease (at most 5 s)
        is an outage; the deadlines of the workers alive when it began move on by its length, once per worker
        until it speaks again."""
        seen = self.seen
        self.seen = max(seen or self.now, self.now)
        if seen is None or self.now - seen <= min(lease_ms // 2, 5_000):
            return
        moved = [w for w, d in self.workers.items() if d > seen and w not in self.excused]
        for w in moved:
            self.workers[w] += self.now - seen
        self.excused |= set(moved)
        if moved:
            event("silence: an outage moved live workers' leases on")

    def _heard(self, worker: str, lease_ms: int) -> None:
        self.workers[worker] = self.now + lease_ms
        self.excused.discard(worker)

    def _token_of(self, worker: str, job_id: str) -> str:
        """The newest lease this worker was given for the job ('' if none: judged by ownership alone)."""
        return next((le.token for le in reversed(self.leases) if le.job_id == job_id and le.worker == worker), "")

    @staticmethod
    def _seq(token: str) -> int:
        return int(token.rsplit("/", 1)[1])

    def _pick(self, data: st.DataObject, which: str, ok: Callable[[Lease], bool] = lambda _: True) -> Lease | None:
        """A lease from the pool: a live one (passing `ok`); a superseded one (its job is leased again
        under another token: the stale worker the token check exists for); or any stale one. Falls back
        to whichever kind exists."""
        live = [le for le in self.leases if self._valid(le) and ok(le)]
        stale = [le for le in self.leases if not self._valid(le)]
        superseded = [le for le in stale if self.jobs[le.job_id].state in LEASED]
        pools = {"live": [live, stale], "superseded": [superseded, stale, live]}.get(which, [stale, live])
        pool = next((p for p in pools if p), [])
        return data.draw(st.sampled_from(pool), label="lease") if pool else None

    def _room(self) -> bool:
        return len(self.jobs) < MAX_JOBS and len(self.jobs) - len(self._in(*TERMINAL)) < MAX_WAITING

    def _done_by(self, lease: Lease) -> None:
        self.beliefs[lease.worker].discard(lease.job_id)

    # -- producing --------------------------------------------------------------------------------

    def _enqueue(self, items: list[dict[str, Any] | str], bulk: bool) -> None:
        specs = []
        for item in items:
            if isinstance(item, str):  # an id that already exists: must come back unchanged
                specs.append(JobSpec(input={"dup": True}, job_id=item, retention=RETENTION))
                continue
            self.n_jobs += 1
            specs.append(
                JobSpec(
                    input={"n": self.n_jobs},
                    priority=item["priority"],
                    delay=item["delay"],
                    max_attempts=item["max_attempts"],
                    retention=RETENTION,
                    job_id=f"{Q}:job{self.n_jobs:03d}",
                )
            )
        ids = self.run(self.s.enqueue_many(Q, specs)) if bulk else [self.run(self.s.enqueue(Q, specs[0]))]
        assert ids == [spec.job_id for spec in specs]
        seq, self.seq = self.seq, self.seq + len(specs)
        for spec in specs:
            assert spec.job_id is not None
            if spec.job_id in self.jobs:
                continue
            seq += 1
            j = MJob(
                id=spec.job_id,
                input=spec.input,
                priority=spec.priority,
                max_attempts=spec.max_attempts,
                created_at=self.now,
                state="queued",
            )
            run_at = int((self.now / 1000 + spec.delay) * 1000) if spec.delay else None  # as the store does
            if run_at is not None and run_at > self.now:
                j.state, j.run_at = "delayed", run_at
            else:
                j.score, j.ready_at = (1000 - j.priority) * PRIO_SPAN + seq, self.now
                j.queued_since = self.now
            self.jobs[j.id] = j
            self.totals["enqueued"] += 1

    @precondition(lambda self: self._room())
    @rule(
        data=st.data(),
        specs=st.lists(SPECS, min_size=1, max_size=5),
        bulk=st.booleans(),
        dups=st.sampled_from([0, 0, 1, 2]),
    )
    def enqueue(self, data: st.DataObject, specs: list[dict[str, Any]], bulk: bool, dups: int) -> None:
        """enqueue (one job) or enqueue_many (a batch); ids that exist already may be mixed in, and must
        come back as they are (idempotent)."""
        items: list[dict[str, Any] | str] = list(specs)
        if self.jobs:
            for _ in range(dups):
                at = data.draw(st.integers(0, len(items)), label="dup position")
                items.insert(at, data.draw(st.sampled_from(sorted(self.jobs)), label="dup id"))
        self._enqueue(items if bulk else items[:1], bulk=bulk)

    # -- working ----------------------------------------------------------------------------------

    @rule(
        worker=st.sampled_from(WORKERS),
        n=st.sampled_from([1, 1, 2, 4, 0]),
        paused=st.sampled_from([False, False, False, False, True]),
        data=st.data(),
    )
    def claim(self, worker: str, n: int, paused: bool, data: st.DataObject) -> None:
        """Claim up to n jobs, and (as a worker does first) submit some of them: record their remote id,
        unless the job came back with one. On a paused queue a claim hands out nothing (but still
        renews the worker, promotes and reaps); resume lets claims through again."""
        if not paused:
            for lease in self._claim(worker, n):
                if not self.jobs[lease.job_id].remote_id and data.draw(st.booleans(), label="submit"):
                    self._checkpoint(lease)
            return
        self.run(self.s.pause(Q))
        self.paused = True
        assert self.run(self.s.stats(Q)).paused
        assert self._claim(worker, n) == []
        self.run(self.s.resume(Q))
        self.paused = False

    def _claim(self, worker: str, n: int) -> list[Lease]:
        begin = worker == WORKERS[0]  # this one serves a synchronous API: its claims open the submit intents
        got = self.run(self.s.claim(Q, worker, n, begin=begin))
        self._stamp(LEASE)
        self._heard(worker, LEASE)  # claiming proves the worker alive, before reaping
        self._promote()
        self._reap_workers(100)
        expected = [] if n <= 0 or self.paused else sorted(self._in("queued"), key=lambda j: (j.score or 0, j.id))[:n]
        assert [c.id for c in got] == [j.id for j in expected], "claim order: priority, then FIFO"
        issued = {le.token for le in self.leases}
        for c, j in zip(got, expected, strict=True):
            assert c.token not in issued, "a lease token was issued twice"
            j.attempts += 1
            j.state = "submitted" if j.remote_id else "active"
            j.owner, j.token, j.started_at = worker, c.token, self.now
            # re-delivery resumes the remote job recorded by an earlier lease, never resubmits
            assert (c.remote_id, c.backend) == (j.remote_id, j.backend)
            assert (c.attempt, c.max_attempts) == (j.attempts, j.max_attempts)
            assert c.cancel_requested == j.cancel
            assert c.intent_open == j.intent_open, "an intent an earlier lease left open is reported"
            assert c.input == j.input
            assert c.output_key == f"results/{j.id}.json"
            # a claim begins only a job with nothing unsettled: no remote job, no cancel, no intent left open
            settled = not c.remote_id and not c.cancel_requested and not c.intent_open
            assert c.begun == (begin and settled), "a claim begins exactly the jobs with nothing unsettled"
            if c.begun:
                j.intent_open = True
                event("claim: begun (submit intent opened by the claim)")
            if c.remote_id:
                event("claim: re-delivered with its remote id (resume, not resubmit)")
            if c.cancel_requested:
                event("claim: delivered with a cancel request")
            self.leases.append(Lease(j.id, c.token, worker))
            self.beliefs[worker].add(j.id)
        return self.leases[len(self.leases) - len(got) :]

    def _heartbeat(self, worker: str, ids: list[str], lease_ms: int = LEASE, since: bool = False) -> None:
        """Heartbeat (job id, newest token of this worker) pairs. A lease is lost when the job is not owned by
        the worker or is owned under another token. With `since` (the sequence number of the worker's last
        heartbeat), owned jobs it does not list whose lease is no newer are handed back, uncounted."""
        refs = [(jid, self._token_of(worker, jid)) for jid in ids]
        mark = self.last_seq.get(worker) if since else None
        reply = self.run(self.s.heartbeat(Q, worker, refs, lease_ms, since=mark))
        self._stamp(lease_ms)
        self._heard(worker, lease_ms)  # before reaping: a late heartbeat keeps the jobs nobody took meanwhile
        self._reap_workers(100)
        owned = set(self._owned(worker))
        lost = [jid for jid, tok in refs if jid not in owned or (tok and self.jobs[jid].token != tok)]
        assert reply.lost == lost
        if set(lost) & self.beliefs[worker]:
            event("heartbeat: worker learns it lost a lease")
        listed = {jid for jid, _ in refs} - set(lost)
        assert reply.cancel_requested == [jid for jid, _ in refs if jid in listed and self.jobs[jid].cancel]
        unknown = [jid for jid in self._owned(worker) if jid not in listed]
        handed = [] if mark is None else [jid for jid in unknown if self._seq(self.jobs[jid].token or "") <= mark]
        assert reply.released == self._return_leases(handed, counted=False)
        if handed:
            event("heartbeat: leases the worker did not list handed back")
        issued = max((self._seq(le.token) for le in self.leases), default=0)
        assert reply.seq == issued
        self.last_seq[worker] = reply.seq
        self.beliefs[worker] -= set(lost)

    @rule(worker=st.sampled_from(WORKERS), data=st.data(), since=st.booleans())
    def heartbeat(self, worker: str, data: st.DataObject, since: bool) -> None:
        """Ids it does not hold come back as lost; with `since`, leases it holds but does not list (a
        restarted process with the same worker id knows none of its predecessor's) are handed back."""
        others = self._some_ids(data) if self.jobs else []
        self._heartbeat(worker, sorted(self.beliefs[worker] | set(others)), since=since)

    @rule(worker=st.sampled_from(WORKERS), n=st.integers(1, 3), data=st.data())
    def worker_forgets(self, worker: str, n: int, data: st.DataObject) -> None:
        """A worker loses track of leases the store gave it: a claim whose reply never arrived, a process
        restarted with the same worker id (a container with the same hostname and PID 1), a task that ended
        without a verdict. Its heartbeats hand them back, uncounted, once they are no newer than what its
        previous heartbeat saw; never a lease from a claim that may still be on its way."""
        self._heartbeat(worker, sorted(self.beliefs[worker]), since=True)
        leases = self._claim(worker, n)
        if data.draw(st.booleans(), label="restarted"):
            self.beliefs[worker].clear()
        else:
            gone = data.draw(st.sets(st.sampled_from(leases)), label="forgotten") if leases else set()
            self.beliefs[worker] -= {le.job_id for le in gone}
        for _ in range(2):  # the first may not hand back the newest claim's leases; the second must
            self._heartbeat(worker, sorted(self.beliefs[worker]), since=True)
        assert not [jid for jid in self._owned(worker) if jid not in self.beliefs[worker]]

    @precondition(lambda self: self.leases)
    @rule(
        data=st.data(),
        which=st.sampled_from(["live", "live", "superseded", "stale", "repeat"]),
        cost=st.none() | st.sampled_from([0.25, 1.5]),
    )
    def complete(self, data: st.DataObject, which: str, cost: float | None) -> None:
        """Complete with a live token, a stale one, or the token that already completed its job (a retry
        after a lost reply)."""
        winners = [le for le in self.leases if self._repeat(le)]
        if which == "repeat" and winners:
            lease: Lease | None = data.draw(st.sampled_from(winners), label="lease")
        else:
            lease = self._pick(data, which)
        assert lease is not None
        self._complete(lease, cost)

    def _complete(self, lease: Lease, cost: float | None) -> None:
        result = f"s3://bucket/results/{lease.job_id}.json"
        call = self.s.complete(lease.job_id, lease.token, result, cost)
        if self._repeat(lease):
            self.run(call)
            event("complete: repeat of the winning complete: OK, no effect")
        elif not self._valid(lease):
            with pytest.raises(StaleLease):
                self.run(call)
            event("complete: stale token rejected")
        else:
            self.run(call)
            self._succeed(lease, result, cost)

    def _succeed(self, lease: Lease, result: str, cost: float | None) -> None:
        j = self.jobs[lease.job_id]
        j.result, j.cost = result, cost
        j.completes += 1
        self._finish([j.id], "succeeded")
        self._done_by(lease)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), size=st.integers(1, 4), repeat_first=st.booleans())
    def complete_batch(self, data: st.DataObject, size: int, repeat_first: bool) -> None:
        """One complete_many round trip; the same (id, token) may appear twice (an HTTP retry merged into
        the same batch): only the first takes effect, the second is a repeat."""
        which = st.sampled_from(["live", "live", "superseded", "stale"])
        picks = [self._pick(data, data.draw(which, label="which")) for _ in range(size)]
        items = [le for le in picks if le is not None]
        if repeat_first:
            items.append(items[0])
        got = self.run(
            self.s.complete_many(
                Q, [(le.job_id, le.token, f"s3://bucket/{le.job_id}/{i}", None) for i, le in enumerate(items)]
            )
        )
        expected = []
        for i, le in enumerate(items):
            if self._valid(le):
                expected.append("OK")
                self._succeed(le, f"s3://bucket/{le.job_id}/{i}", None)
            elif self._repeat(le):
                expected.append("OK")
            else:
                expected.append("STALE")
        assert got == expected
        event(f"complete_batch: {'+'.join(sorted(set(expected)))}")

    def _fail(self, lease: Lease, retryable: bool, delay_ms: int, keep_remote: bool) -> None:
        err = f"boom {lease.token}"
        call = self.s.fail(
            lease.job_id, lease.token, err, retryable=retryable, delay_ms=delay_ms, keep_remote=keep_remote
        )
        if not self._valid(lease):
            with pytest.raises(StaleLease):
                self.run(call)
            event("fail: stale token rejected")
            return
        got = self.run(call)
        j = self.jobs[lease.job_id]
        self.totals["failed"] += 1
        self._done_by(lease)
        if retryable and j.attempts < j.max_attempts:
            assert got == "retrying"
            event("fail -> retrying")
            j.state, j.owner, j.token, j.error, j.run_at = "retrying", None, None, err, self.now + delay_ms
            if not keep_remote:
                j.backend = j.remote_id = None
        else:
            assert got == "dead"
            event(f"fail -> dead ({'attempts used up' if retryable else 'not retryable'})")
            self._finish([j.id], "dead", err)

    def _checkpoint(self, lease: Lease) -> None:
        self.n_remote += 1
        remote_id = f"remote-{self.n_remote}"
        call = self.s.checkpoint(lease.job_id, lease.token, "sim", remote_id)
        if not self._valid(lease):
            with pytest.raises(StaleLease):
                self.run(call)
            event("checkpoint: stale token rejected")
            return
        cancel = self.run(call)
        j = self.jobs[lease.job_id]
        assert cancel == j.cancel
        event(f"checkpoint: {'OK:CANCEL' if cancel else 'OK'}{', new remote id' if j.remote_id else ''}")
        j.state, j.backend, j.remote_id, j.intent_open = "submitted", "sim", remote_id, False

    def _hold(self, lease: Lease) -> None:
        call = self.s.hold(lease.job_id, lease.token, "daily cap")
        if not self._valid(lease):
            with pytest.raises(StaleLease):
                self.run(call)
            event("hold: stale token rejected")
            return
        self.run(call)
        j = self.jobs[lease.job_id]
        j.attempts -= 1  # waiting for the cap window is not an attempt
        j.state, j.owner, j.token, j.error, j.held_at = "held", None, None, "daily cap", self.now
        self._done_by(lease)
        event("hold: held")

    def _ack_cancel(self, lease: Lease) -> None:
        call = self.s.ack_cancel(lease.job_id, lease.token)
        if not self._valid(lease):
            with pytest.raises(StaleLease):
                self.run(call)
            event("ack_cancel: stale token rejected")
            return
        self.run(call)
        self._finish([lease.job_id], "cancelled")
        self._done_by(lease)
        event("ack_cancel: cancelled")

    @rule(data=st.data())  # one argument and a name early in the alphabet: Hypothesis favours it
    def claim_and_work(self, data: st.DataObject) -> None:
        """One turn of a worker's loop: heartbeat the jobs it holds (learning of lost leases and cancel
        requests), claim more, then for each lease it holds maybe submit it (record the remote id) and
        give it what a real worker would: a result, a retryable or fatal failure, a hold (cap reached),
        the cancel it was asked for, or nothing yet. A worker that went quiet (crashed-looking: its lease
        ran out but was not reaped yet) still holds its leases when it comes back; its writes count."""
        worker = data.draw(st.sampled_from(WORKERS), label="worker")
        more = data.draw(st.sampled_from([0, 1, 1, 2]), label="claims")
        if self.beliefs[worker]:
            self._heartbeat(worker, sorted(self.beliefs[worker]))
        if more:
            self._claim(worker, more)
        for lease in [le for le in self.leases if le.worker == worker and self._valid(le)]:
            if not self.jobs[lease.job_id].remote_id and data.draw(st.booleans(), label="submit"):
                self._checkpoint(lease)  # submitted: the remote id is recorded before polling
            ops = ["complete", "complete", "retry", "retry", "fatal", "hold", "nothing", "nothing"]
            ops += ["ack_cancel"] * 3 if self.jobs[lease.job_id].cancel else []
            op = data.draw(st.sampled_from(ops), label=lease.job_id)
            if op == "complete":
                self._complete(lease, data.draw(st.none() | st.just(0.5), label="cost"))
            elif op in ("retry", "fatal"):
                delay = data.draw(st.sampled_from([0, 5_000]), label="delay") if op == "retry" else 0
                self._fail(lease, op == "retry", delay, data.draw(st.booleans(), label="keep remote id"))
            elif op == "hold":
                self._hold(lease)
            elif op == "ack_cancel":
                self._ack_cancel(lease)

    @precondition(lambda self: any(j.state in LEASED for j in self.jobs.values()))
    @rule(data=st.data(), worker_dies=st.booleans())
    def cancel_running(self, data: st.DataObject, worker_dies: bool) -> None:
        """An operator cancels a running job. Its worker learns it from its next heartbeat (or from the
        reply to the checkpoint of a submission) and acknowledges. Or the worker dies first: a job with
        a remote id comes back flagged, and its next worker is told at claim (it must cancel the remote
        job); a job without one is cancelled by the reaper."""
        jid = data.draw(st.sampled_from(sorted(j.id for j in self._in(*LEASED))), label="job")
        j = self.jobs[jid]
        owner = j.owner
        assert owner is not None
        assert self.run(self.s.cancel(jid)) == "requested"
        j.cancel = True
        if worker_dies:
            self.beliefs[owner].clear()
            self._expire(set(self.workers) - {owner}, 0, reap_now=True)
            if j.state != "queued":
                return
            queue = sorted(self._in("queued"), key=lambda m: (m.score or 0, m.id))
            heir = data.draw(st.sampled_from([w for w in WORKERS if w != owner]), label="next worker")
            self._claim(heir, queue.index(j) + 1)  # everything ahead of it, and it
        lease = next(le for le in reversed(self.leases) if le.job_id == jid)
        assert self._valid(lease)
        self._heartbeat(lease.worker, sorted(self.beliefs[lease.worker] | {jid}))
        if not j.remote_id and data.draw(st.booleans(), label="submitted meanwhile"):
            self._checkpoint(lease)
        self._ack_cancel(lease)

    @precondition(lambda self: any(not self._valid(le) for le in self.leases))
    @rule(
        data=st.data(),
        op=st.sampled_from(["complete", "fail", "checkpoint", "hold", "ack_cancel"]),
        superseded=st.booleans(),
    )
    def stale_write(self, data: st.DataObject, op: str, superseded: bool) -> None:
        """A worker whose lease is gone (it expired and another worker took the job over, or the job moved
        on) writes anyway: every write must be refused, and change nothing."""
        lease = self._pick(data, "superseded" if superseded else "stale")
        assert lease is not None and not self._valid(lease)
        if op == "complete":
            self._complete(lease, None)  # the lease that completed the job: a repeat, answered OK
        elif op == "fail":
            self._fail(lease, data.draw(st.booleans(), label="retryable"), 0, False)
        elif op == "checkpoint":
            self._checkpoint(lease)
        elif op == "hold":
            self._hold(lease)
        else:
            self._ack_cancel(lease)

    @rule(worker=st.sampled_from(WORKERS), data=st.data(), everything=st.booleans())
    def release_leases(self, worker: str, data: st.DataObject, everything: bool) -> None:
        """A draining worker lets go: jobs go back with their remote id, no lease expiry counted."""
        if everything:
            got = self.run(self.s.release_leases(Q, worker))
            ids = self._owned(worker)
            self._forget(worker)
            self.beliefs[worker].clear()
        else:
            mine = sorted(self.beliefs[worker])
            asked = data.draw(st.lists(st.sampled_from(mine), unique=True), label="ids") if mine else []
            if not asked:
                return  # no ids means "everything" to the store
            got = self.run(self.s.release_leases(Q, worker, asked))
            owned = set(self._owned(worker))
            ids = [jid for jid in asked if jid in owned]
            self.beliefs[worker] -= set(asked)
        assert got == self._return_leases(ids, counted=False)

    # -- operating --------------------------------------------------------------------------------

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), leased=st.sampled_from([True, True, False]))
    def cancel(self, data: st.DataObject, leased: bool) -> None:
        """Cancel any job in any state; mostly one that is leased (the interesting case)."""
        pool = sorted(j.id for j in self._in(*LEASED)) if leased else []
        jid = data.draw(st.sampled_from(pool or sorted(self.jobs)), label="job")
        j = self.jobs[jid]
        if j.state in TERMINAL:
            with pytest.raises(InvalidTransition):
                self.run(self.s.cancel(jid))
        elif j.state in LEASED:  # only flagged: its worker cancels the remote job, then acks
            assert self.run(self.s.cancel(jid)) == "requested"
            j.cancel = True
        elif j.remote_id or j.intent_open:  # waiting, but a remote job may run: first in line for a worker
            assert self.run(self.s.cancel(jid)) == "requested"
            j.cancel = True
            self._make_ready([jid], fresh=True)
            event("cancel: a waiting job whose remote job may run -> requested, first in line")
        else:
            assert self.run(self.s.cancel(jid)) == "cancelled"
            self._finish([jid], "cancelled")

    def _some_ids(self, data: st.DataObject) -> list[str]:
        return data.draw(st.lists(st.sampled_from(sorted(self.jobs)), max_size=4, unique=True), label="ids")

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), source=st.sampled_from(["held", "dead"]), everything=st.booleans())
    def move_back(self, data: st.DataObject, source: str, everything: bool) -> None:
        """release (held jobs) or requeue_dead (dead jobs, with a fresh attempt budget and no remote id):
        all of them, or the given ids, of which only those really in that state move."""
        asked = []
        if not everything:  # mostly jobs that are in that state, and maybe some that are not
            mine = sorted(j.id for j in self._in(source))
            asked = data.draw(st.lists(st.sampled_from(mine), unique=True), label="ids") if mine else []
            asked += [jid for jid in self._some_ids(data) if jid not in asked][:1]
        call = self.s.release(Q, asked) if source == "held" else self.s.requeue_dead(Q, asked)
        got = self.run(call)
        if asked:
            moved = [jid for jid in asked if self.jobs[jid].state == source]
        else:
            key = (lambda j: 0) if source == "held" else (lambda j: j.term_score)  # held: by window (none), id
            moved = [jid for _, jid in sorted((key(j), j.id) for j in self._in(source))]
        assert got == moved
        if moved:
            event(f"move_back: {source} jobs back to ready")
        if source == "dead":
            for jid in moved:
                j = self.jobs[jid]
                j.attempts = j.expiries = 0
                j.finished_at = j.backend = j.remote_id = None
                j.cancel = j.intent_open = False
        self._make_ready(moved, fresh=True)

    def _reap(self, limit: int = 1000) -> None:
        got = self.run(self.s.reap(Q, limit))
        self._stamp(LEASE)
        promoted = self._promote(limit)
        reaped = self._reap_workers(limit)
        assert got == (promoted, reaped, 0)

    @rule(limit=st.sampled_from([1000, 1000, 1]))
    def reap(self, limit: int) -> None:
        """The maintenance step; limit 1 takes one due job per waiting set and one dead worker per call."""
        self._reap(limit)

    @rule(data=st.data(), jump=st.sampled_from(["tick", "tick", "leases"]))
    def time_passes(self, data: st.DataObject, jump: str) -> None:
        """A tick of the clock (a small one, or one that lands on or just past a lease deadline), or a
        jump past the leases of every worker but some survivors, which heartbeat long enough to outlive
        it; the next claim / heartbeat / reap returns the others' jobs."""
        if jump == "tick" or not self.workers:
            small = st.integers(0, 2_500)  # mostly: leases outlive a few ticks, delays come due after some
            ticks = st.one_of(small, small, st.sampled_from([LEASE - 1, LEASE, LEASE + 1, 3 * LEASE]))
            self.now += data.draw(ticks, label="ms")
            return
        survivors = data.draw(st.sets(st.sampled_from(WORKERS), max_size=2), label="survivors")
        past = data.draw(st.sampled_from([0, 1, 2_500]), label="ms past the last deadline")
        self._expire(survivors, past, data.draw(st.booleans(), label="reap now"))

    @rule(worker=st.sampled_from(WORKERS), n=st.integers(1, 3), data=st.data(), reap_now=st.booleans())
    def worker_crashes(self, worker: str, n: int, data: st.DataObject, reap_now: bool) -> None:
        """A worker claims a batch, records the remote job of some, and dies (SIGKILL: no verdict, no
        heartbeat) while the others live on past its lease. Its jobs must come back, remote ids intact."""
        for lease in self._claim(worker, n):
            if data.draw(st.booleans(), label=f"submit {lease.job_id}"):
                self._checkpoint(lease)
        self.beliefs[worker].clear()  # a restarted process remembers nothing
        self._expire(set(self.workers) - {worker}, 0, reap_now)

    def _expire(self, survivors: set[str], past: int, reap_now: bool) -> None:
        doomed = [w for w in self.workers if w not in survivors]
        target = max([self.workers[w] for w in doomed], default=self.now + LEASE) + past
        target = max(target, self.now)
        for w in sorted(survivors):
            self._heartbeat(w, sorted(self.beliefs[w]), lease_ms=target - self.now + LEASE)
        # Time passes with the queue heard from (a maintenance pass every 4 s, as a server does every second):
        # a jump in silence would be an outage, which moves every lease on instead (see _stamp).
        while self.now + 4_000 < target:
            self.now += 4_000
            self._reap()
        self.now = target
        if reap_now:
            self._reap()

    @precondition(lambda self: self.restarts < MAX_RESTARTS)
    @rule(graceful=st.sampled_from([False, False, True]))
    def restart_server(self, graceful: bool) -> None:
        """SIGKILL (or SIGTERM) Valkey and start it on the same AOF (appendfsync always): nothing
        acknowledged is lost."""
        self.backend.restart(graceful)
        self._new_store()  # a fresh process would start with a fresh store, too
        self.restarts += 1
        event(f"valkey {'stopped' if graceful else 'SIGKILLed'} and restarted")

    # -- invariants -------------------------------------------------------------------------------

    def _expected_order(self, state: str) -> list[str]:
        if state == "queued":
            return [j.id for j in sorted(self._in("queued"), key=lambda j: (j.score or 0, j.id))]
        key: Callable[[MJob], Any] = {
            "delayed": lambda j: j.run_at,
            "retrying": lambda j: j.run_at,
            "active": lambda j: j.started_at,
            "held": lambda j: 0,  # scored by cap window (none here), so by id
        }.get(state, lambda j: j.term_score)
        members = self._in(*LEASED) if state == "active" else self._in(state)
        ordered = sorted(((key(j), j.id) for j in members), reverse=state in TERMINAL)
        return [jid for _, jid in ordered]

    @invariant()
    def store_matches_model(self) -> None:
        """After every step, read it all back: stats (counts per state, totals, live workers), then each
        non-empty state index through list_jobs, which reads every listed job with store.get; a known id
        that no index lists is read with store.get directly (so a lost record fails as JobNotFound)."""
        stats = self.run(self.s.stats(Q))
        model = Counter(j.state for j in self.jobs.values())
        assert stats.counts == {name: model[name] for name in COUNT_NAMES}
        assert stats.totals == {k: v for k, v in self.totals.items() if v}
        # no job completes twice: every success counted is one successful complete
        assert stats.totals.get("succeeded", 0) == sum(j.completes for j in self.jobs.values())
        assert stats.workers == sum(d >= self.now for d in self.workers.values())
        assert stats.paused == self.paused
        self._check_oldest_ready_age(stats.oldest_ready_age_ms)
        found: dict[str, Job] = {}
        for state in STATE_SETS:
            expected = self._expected_order(state)
            if not expected:
                continue  # stats (ZCARD of the same index) already showed it empty
            listed, cursor = self.run(self.s.list_jobs(Q, state, limit=len(self.jobs) + 1))
            assert cursor is None
            assert [g.id for g in listed] == expected, f"{state} index (in listing order)"
            for g in listed:
                assert g.id not in found, f"{g.id} is listed in two states"
                assert g.state.value in (LEASED if state == "active" else (state,)), (g.id, state)
                found[g.id] = g
        for jid, m in self.jobs.items():
            g = found.get(jid) or self.run(self.s.get(jid))  # JobNotFound here: a lost job
            assert jid in found, f"{jid} ({g.state.value}) is in no state index"
            self._check_job(g, m)

    def _check_oldest_ready_age(self, age: int | None) -> None:
        """The autoscaler's signal: how long the longest-waiting ready job has waited. Whether a job whose
        lease was returned waits since then or since it first became ready is left open, so the answer
        must lie between the two readings; today it can be far below both (see the report)."""
        ready = self._in("queued")
        if not ready:
            assert age is None, "oldest ready age of an empty ready set"
            return
        at_least = self.now - min(j.ready_at or 0 for j in ready)
        at_most = self.now - min(j.queued_since or 0 for j in ready)
        assert age is not None and at_least <= age <= at_most, (
            f"oldest ready age {age}, expected {at_least}..{at_most} ms"
        )

    def _check_job(self, g: Job, m: MJob) -> None:
        jid = m.id
        assert g.state.value == m.state, jid
        assert (g.attempts, g.lease_expiries) == (m.attempts, m.expiries), jid
        assert g.max_attempts == m.max_attempts, jid
        assert (g.lease_owner, g.lease_token) == (m.owner, m.token if m.state in LEASED else None), jid
        assert g.lease_deadline == (self.workers[m.owner] if m.owner else None), jid
        assert (g.backend, g.remote_id) == (m.backend, m.remote_id), jid
        assert g.cancel_requested == m.cancel, jid
        assert (g.error, g.result, g.cost) == (m.error, m.result, m.cost), jid
        assert (g.created_at, g.run_at, g.started_at, g.finished_at) == (
            m.created_at,
            m.run_at,
            m.started_at,
            m.finished_at,
        ), jid
        assert (g.priority, g.input, g.output_key) == (m.priority, m.input, f"results/{jid}.json"), jid
        # model-independent guarantees, straight from the store's answer
        assert (g.lease_owner is not None) == (g.state.value in LEASED), jid
        if g.lease_expiries > g.max_attempts:  # a crash loop ends dead, unless a cancel ended it first
            assert (g.state.value, g.error) == ("dead", "lease expired") or (
                g.state.value == "cancelled" and g.cancel_requested
            ), jid
        assert m.completes <= 1, f"{jid} completed {m.completes} times"


@pytest.fixture(scope="module")
def machine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    with ValkeyServer(tmp_path_factory.mktemp("state-machine"), appendfsync="always") as server:
        yield server


def test_queue_state_machine(machine_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every example replays against a real server, so shrinking a failure runs hundreds of them; cap it
    # (Hypothesis's own cap is 5 min, past pytest's timeout) and report a partly shrunk example instead.
    monkeypatch.setattr(conjecture_engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS, raising=False)
    QueueMachine.backend = backend = Backend(machine_server)
    try:
        run_state_machine_as_test(QueueMachine, settings=SETTINGS)
    finally:
        backend.close()
