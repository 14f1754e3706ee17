"""Provider batches as fixed timelines, and the uploaded files they read and write (OpenAI's Files API).

A batch is made of lines, each answered by one simulator job (so stats, `/_sim/jobs` and output files see it).
At create the lines get their finish times, spread evenly over `batches.seconds`, and their outcomes; a cancel
only records when it was asked. Everything a poll shows (status, counts, which lines expired or were cancelled)
is then a pure function of the clock, as a job's phase is (store.py). The provider modules (openai_batch_api,
anthropic_api) render the same timeline in their own words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from offload.testing.sim.config import BatchSim
from offload.testing.sim.store import Job

if TYPE_CHECKING:  # the engine holds the BatchStore, so it imports this module
    from offload.testing.sim.engine import Call

Stage = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
LineState = Literal["processing", "succeeded", "errored", "canceled", "expired"]
ENDED: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


@dataclass(slots=True)
class Line:
    """One request of a batch. `error` is set when the request itself was invalid (a 400 the endpoint would
    have answered); `job` is None then, as the provider never ran it."""

    custom_id: str
    body: Any
    done_at: float
    job: Job | None = None
    error: dict[str, Any] | None = None

    @property
    def fails(self) -> bool:
        return self.error is not None or (self.job is not None and self.job.outcome != "succeeded")


@dataclass(slots=True)
class Batch:
    """One batch. Times are absolute (the simulator's clock); `meta` keeps the provider's own fields (endpoint,
    input file, metadata) for rendering."""

    id: str
    family: str
    created: float
    lines: list[Line]
    in_progress_at: float
    run_end: float  # when the last line finishes, if nothing stops the batch first
    expires_at: float
    finalize_seconds: float
    cancel_seconds: float
    meta: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, Any]] | None = None  # validation errors: the batch failed before it ran
    cancel_at: float | None = None  # asked by the client, or set at create (`batches.cancel_after`)
    outputs: dict[str, str | None] = field(default_factory=dict)  # OpenAI: output/error file ids, once ended

    def stop_at(self) -> float | None:
        """When the batch stopped before its last line finished (a cancel or its expiry), else None."""
        stops = [t for t in (self.cancel_at, self.expires_at) if t is not None and t < self.run_end]
        return min(stops) if stops else None

    def cancelled(self) -> bool:
        stop = self.stop_at()
        return stop is not None and stop == self.cancel_at

    def cancel_asked(self, now: float) -> float | None:
        """When the cancel was asked, once that time has come (a provider's own cancel is set in advance)."""
        return self.cancel_at if self.cancel_at is not None and self.cancel_at <= now else None

    def ended_at(self) -> float:
        if self.errors is not None:
            return self.in_progress_at
        stop = self.stop_at()
        if stop is None:
            return self.run_end + self.finalize_seconds
        return stop + self.cancel_seconds if self.cancelled() else stop

    def stage(self, now: float) -> Stage:
        """OpenAI's status words; Anthropic's three are derived from them (`processing_status`)."""
        if now < self.in_progress_at:
            return "validating"
        if self.errors is not None:
            return "failed"
        if self.cancelled():
            if self.cancel_asked(now) is not None:
                return "cancelled" if now >= self.ended_at() else "cancelling"
            return "in_progress"
        if self.stop_at() is not None:  # expiry
            return "expired" if now >= self.ended_at() else "in_progress"
        if now < self.run_end:
            return "in_progress"
        return "completed" if now >= self.ended_at() else "finalizing"

    def line_state(self, line: Line, now: float) -> LineState:
        """A line's fate as seen at `now`: its own outcome once it finished (before any stop), else processing
        until the batch ends, then canceled or expired."""
        stop = self.stop_at()
        if line.done_at <= now and (stop is None or line.done_at <= stop):
            return "errored" if line.fails else "succeeded"
        if now < self.ended_at():
            return "processing"
        return "canceled" if self.cancelled() else "expired"

    def counts(self, now: float) -> dict[LineState, int]:
        out: dict[LineState, int] = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        for line in self.lines:
            out[self.line_state(line, now)] += 1
        return out

    def cancel(self, now: float) -> list[Job]:
        """Ask for a cancel: the jobs of the lines it stops (their jobs are cancelled too), or [] when every line
        had finished, the batch had ended, or a cancel was asked before."""
        if self.cancel_asked(now) is not None or now >= min(self.ended_at(), self.run_end) or self.errors is not None:
            return []
        self.cancel_at = now
        return [line.job for line in self.lines if line.job is not None and line.done_at > now]


def timeline(created: float, count: int, config: BatchSim, *, validating: bool) -> tuple[float, list[float]]:
    """When the batch starts running and when each of its `count` lines finishes (evenly spread)."""
    start = created + (config.validate_seconds if validating else 0.0)
    return start, [start + config.seconds * (i + 1) / count for i in range(count)]


def line_job(call: Call, target: str, payload: Any, key: str, started: float, finished: float) -> Job:
    """A job that answers one line of a batch: on the batch's timeline, counted as a submission of `key` (the
    line's custom_id), failed when the family's fail_rate or `batches.fail_rate` says so, aborted if the batch
    expires (cancelled if the provider cancels it) before it finishes."""
    sim, config = call.sim, call.sim.config.batches
    meta = {"custom_id": key}
    job = sim.new_job(
        call.dialect.family,
        target,
        payload,
        call.behaviour,
        call.now,
        job_id=None,
        meta=meta,
        run_timeout=None,
        hard_ttl=None,
        key=key,
    )
    job.started, job.finished = started, finished
    if sim.chance(config.fail_rate):
        job.outcome, job.error = "failed", call.behaviour.error_message
    expiry = call.now + config.expire_after
    cancel = None if config.cancel_after is None else call.now + config.cancel_after
    if cancel is not None and finished > cancel and cancel < expiry:
        job.stopped, job.stop_phase = cancel, "cancelled"
    elif finished > expiry:
        job.stopped, job.stop_phase = expiry, "aborted"
    sim.store.rescheduled(job)
    return job


@dataclass(slots=True)
class StoredFile:
    """An uploaded or generated file (OpenAI's Files API)."""

    id: str
    purpose: str
    filename: str
    data: bytes
    created: float

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.data),
            "created_at": int(self.created),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


class BatchStore:
    """Every batch and file by id, in creation order (the lists page newest first). Single-threaded, as the
    job store is."""

    def __init__(self) -> None:
        self.batches: dict[str, Batch] = {}
        self.files: dict[str, StoredFile] = {}

    def add(self, batch: Batch) -> None:
        self.batches[batch.id] = batch

    def get(self, batch_id: str, family: str) -> Batch | None:
        batch = self.batches.get(batch_id)
        return batch if batch is not None and batch.family == family else None

    def newest_first(self, family: str) -> list[Batch]:
        return [b for b in reversed(self.batches.values()) if b.family == family]

    def clear(self) -> None:
        self.batches.clear()
        self.files.clear()


def page(items: list[Batch], after: str | None, before: str | None, limit: int) -> tuple[list[Batch], bool]:
    """A cursor page of a newest-first list: the items after `after` (or before `before`), and whether more
    follow in that direction."""
    ids = [b.id for b in items]
    if after is not None and after in ids:
        items = items[ids.index(after) + 1 :]
    elif before is not None and before in ids:
        items = items[: ids.index(before)]
        return items[-limit:], len(items) > limit
    return items[:limit], len(items) > limit
