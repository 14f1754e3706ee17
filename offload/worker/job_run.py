"""One lease's state inside a dispatch worker: a `JobRun` from the claim that delivered the job to its task's end.

Everything the worker knows of one job it runs lives in its `JobRun`; `Runs` keeps the newest run of each job, so
ending a job drops one object. A job leased to this process again while an older task of it still runs (the old
lease was reaped) gets a new run, which inherits what was heard of the job (a cancel, a webhook, an open intent,
an answer held) and sees the old run's submit call while it is out (see `Runs.start`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload.errors import WorkerError
from offload.models import ClaimedJob

if TYPE_CHECKING:
    from offload.tracing import Attempt
    from offload.worker.routing import Lane
    from offload.worker.slots import Slot


class Unrecorded(WorkerError):
    """A remote job known to exist (accepted, adopted, named by a webhook) whose checkpoint raised twice with an
    error that is not an outage (`Submitter.record_known` waits outages out). The write may have landed with its
    reply lost, so the attempt fails keeping whatever remote id the store holds: dropping one would pay for the
    job again."""


class Drained(WorkerError):
    """The worker is draining and this job has not sent its call: it goes back to the queue unsent (its intent, if
    this lease opened one, closed by the release), instead of starting a submission the drain would have to wait
    for or cut."""


@dataclass(slots=True, eq=False)
class JobRun:
    """One lease of one job in this process: what the job path, the heartbeat, the wake-ups and the drain know of
    it. Created by the claim, dropped when its task ends."""

    job: ClaimedJob
    claimed_at: float  # when the claim that delivered it was sent (monotonic): the lease is known fresh since
    previous: JobRun | None = None  # an older run of the same job whose task had not ended when this one began
    task: asyncio.Task[None] | None = None
    slot: Slot | None = None  # its hold on one of the `concurrency` slots, from its first remote step
    submission: int = 0  # the submission this run sends, resumes or polls
    lane: Lane | None = None  # the backend it sends to, resumes or polls at (worker/routing.py)
    why: str = ""  # the router's reason for `lane` (for the job's events)
    prerouted: bool = False  # routed before its first submit try (a queue with batch lanes: worker/packing.py)
    # It resends a submission of unknown outcome (begin.lua's DUP) on a routed queue: no answer to this resend
    # settles the first try's outcome, so its intent is never closed by one (the job stays on its backend).
    unsettled: bool = False
    sent_at: float = 0.0  # when its submit call went out, or it was resumed (monotonic): its run time, for routing
    submitted: bool = False  # this run submitted its remote job (`sent_at` is its submit): its queue delay counts
    remote_id: str | None = None  # once set: recorded in the job record (unless `unrecorded`)
    # A synchronous answer: its run is recorded with the ack. A failure before the ack closes the intent,
    # unrecorded: the next try is the same submission under the same Idempotency-Key, not a possible duplicate.
    unrecorded: bool = False
    answered: bool = False  # holds a synchronous answer not acked yet: a drain awaits it like a call out
    submitting: bool = False  # its submit call is out: a lost lease waits for the answer to be recorded
    unsent: str | None = None  # the token of an intent it opened (begun) whose call is not sent yet
    cancel: bool = False  # a cancel was heard of (a heartbeat, a checkpoint)
    settling: bool = False  # its last write (ack, failure, cancel) is out: a lost lease then is no news
    past: bool = False  # its remote work is over: storing the output, acking
    hooked: asyncio.Event | None = None  # set by a webhook's wake-up, or a cancel, while it waits
    heard: tuple[int, str] | None = None  # (submission, final body) a wake-up carried
    cancel_wait: asyncio.Event | None = None  # set by a cancel heard while it waits for the rate limit
    trace: Attempt | None = None  # its attempt's span, while tracing is on (offload/tracing.py)

    @property
    def on(self) -> Lane:
        """The lane (backend) this run is at: set from the claim (`Router.resumed`), changed by routing."""
        assert self.lane is not None
        return self.lane

    def hook_event(self) -> asyncio.Event:
        if self.hooked is None:
            self.hooked = asyncio.Event()
        return self.hooked

    def calling(self) -> bool:
        """Whether a submit call of this job is out (this run's, or an older run's it replaced)."""
        return self.submitting or (self.previous is not None and self.previous.calling())

    def awaited_by_drain(self) -> bool:
        """A call out or a synchronous answer not stored yet: the drain awaits it past its grace."""
        return self.calling() or self.answered


class Runs:
    """The newest run of every job this process runs, by job id; and, while draining, the open intents of runs
    that ended unsent (the drain's last release closes them)."""

    __slots__ = ("_runs", "batched", "left_unsent", "past")

    def __init__(self) -> None:
        self._runs: dict[str, JobRun] = {}
        self.left_unsent: dict[str, str] = {}
        self.past = 0  # how many of the runs are past their remote work (counted: read at every claim)
        self.batched = 0  # how many hold a place in a batch backend's pool (worker/packing.py), not a slot

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._runs

    def get(self, job_id: str) -> JobRun | None:
        return self._runs.get(job_id)

    def all(self) -> list[JobRun]:
        return list(self._runs.values())

    def tasks(self) -> dict[str, asyncio.Task[None]]:
        """The task of each job's newest run."""
        return {job_id: run.task for job_id, run in self._runs.items() if run.task is not None}

    def leases(self) -> list[tuple[str, str]]:
        """(job id, token) of every newest run: what the heartbeat extends."""
        return [(job_id, run.job.token) for job_id, run in self._runs.items()]

    def newest(self, run: JobRun) -> bool:
        """Whether `run` is the newest lease of its job this process runs."""
        return self._runs.get(run.job.id) is run

    def start(self, job: ClaimedJob, sent: float) -> tuple[JobRun, JobRun | None]:
        """A new run for a claimed job, and the older run it replaces (None for most). The new run inherits what
        is known of the job rather than of the lease: a cancel, a webhook's event and body, a synchronous answer
        held, an intent left unsent; its own lease is fresh, neither settling nor past its remote work."""
        old = self._runs.get(job.id)
        run = JobRun(job, sent)
        if old is not None:
            self.past -= old.past
            run.previous = old
            run.cancel, run.hooked, run.heard = old.cancel, old.hooked, old.heard
            run.answered, run.unsent = old.answered, old.unsent
        if job.begun:  # an open intent, nothing sent: a drain closes it
            run.unsent = job.token
        self._runs[job.id] = run
        return run, old

    def end(self, run: JobRun, *, draining: bool) -> None:
        """`run`'s task ends: forget it, unless a newer run of the same job has taken its place. While draining,
        an intent it left unsent is kept for the drain's release."""
        if not self.newest(run):
            return
        del self._runs[run.job.id]
        self.past -= run.past
        if draining and run.unsent is not None:
            self.left_unsent[run.job.id] = run.unsent

    def mark_past(self, run: JobRun) -> None:
        """`run`'s remote work is over (its slot given back): it no longer holds back the next claim."""
        if self.newest(run) and not run.past:
            run.past = True
            self.past += 1

    def unsent_token(self, job_id: str) -> str | None:
        run = self._runs.get(job_id)
        return run.unsent if run is not None else self.left_unsent.get(job_id)

    def close_unsent(self, job_id: str) -> None:
        """The intent was closed by a release: it need not be sent again."""
        if (run := self._runs.get(job_id)) is not None:
            run.unsent = None
        self.left_unsent.pop(job_id, None)
