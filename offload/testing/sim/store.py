"""Remote jobs as fixed timelines: a job's phase is a pure function of the clock.

At submit the job gets `created <= started <= finished` and an outcome; cancel only records a stop time.
Nothing runs per job (no task, no timer, no sleep), so 10k jobs in flight cost 10k small objects and a poll is
one dict lookup. Expiry is lazy: a heap of deadlines is drained on each store access, and a job past its
deadline is treated as absent even before it is drained.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Phase = Literal["queued", "running", "succeeded", "failed", "timed_out", "cancelled", "aborted"]
Outcome = Literal["succeeded", "failed", "timed_out"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "timed_out", "cancelled", "aborted"})


def input_key(payload: Any) -> str:
    """Which client-side job a submission belongs to, for "submitted exactly once" checks.

    `id` or `job_id` in the input (or in its `metadata` object) when present, else a hash of the canonical JSON,
    so resubmitting the same input counts against the same key.
    """
    if isinstance(payload, dict):
        for source in (payload, payload.get("metadata")):
            if isinstance(source, dict):
                for name in ("id", "job_id"):
                    value = source.get(name)
                    if isinstance(value, str | int) and not isinstance(value, bool):
                        return str(value)
    try:
        blob = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        blob = repr(payload).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]


@dataclass(slots=True)
class Job:
    """One remote job. `meta` keeps what the client sent besides the input (webhook, metadata, model, ...)
    so tests can find an orphan by its tag."""

    id: str
    family: str
    target: str  # endpoint id, model, app: what the job was submitted to
    input: Any
    input_key: str
    created: float
    started: float
    finished: float
    outcome: Outcome
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    stopped: float | None = None  # cancel time, or a deadline that ends the job early
    stop_phase: Literal["cancelled", "aborted"] = "cancelled"
    result_ttl: float | None = None
    hard_ttl_at: float | None = None  # absolute: RunPod policy.ttl removes the job even while running
    keep_after_expiry: bool = False  # Replicate-style: expired data is nulled, the object stays

    def phase(self, now: float) -> Phase:
        if self.stopped is not None and self.stopped < self.finished and now >= self.stopped:
            return "aborted" if self.stop_phase == "aborted" else "cancelled"
        if now < self.started:
            return "queued"
        if now < self.finished:
            return "running"
        return self.outcome

    def ended_at(self) -> float:
        """When the job became (or will become) terminal."""
        if self.stopped is not None and self.stopped < self.finished:
            return self.stopped
        return self.finished

    def expires_at(self) -> float | None:
        ttl_end = None if self.result_ttl is None else self.ended_at() + self.result_ttl
        ends = [t for t in (ttl_end, self.hard_ttl_at) if t is not None]
        return min(ends) if ends else None

    def expired(self, now: float) -> bool:
        at = self.expires_at()
        return at is not None and now >= at

    def ran_for(self, now: float) -> float:
        """Seconds of (simulated) GPU time so far: what a provider bills and reports as predict/execution time."""
        end = min(now, self.ended_at())
        return max(0.0, end - self.started)

    def cancel(self, now: float) -> bool:
        """Stop a job that has not ended. False when it already had (the caller reports the terminal state)."""
        if self.phase(now) in TERMINAL:
            return False
        self.stopped = now
        self.stop_phase = "cancelled"
        return True

    def summary(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "family": self.family,
            "target": self.target,
            "status": self.phase(now),
            "input_id": self.input_key,
            "input": self.input,
            "meta": self.meta,
            "created": self.created,
            "started": self.started,
            "finished": self.ended_at(),
            "expired": self.expired(now),
        }


class JobStore:
    """All remote jobs by id, plus the expiry heap. Single-threaded: only the event loop touches it."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._deadlines: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: Job) -> None:
        self._jobs[job.id] = job
        self._schedule(job)

    def _schedule(self, job: Job) -> None:
        at = job.expires_at()
        if at is not None and not job.keep_after_expiry:
            heapq.heappush(self._deadlines, (at, job.id))

    def get(self, job_id: str, now: float, family: str | None = None) -> Job | None:
        """The job if it exists, belongs to `family` and has not expired (unless it is kept after expiry)."""
        self.purge(now)
        job = self._jobs.get(job_id)
        if job is None or (family is not None and job.family != family):
            return None
        if job.expired(now) and not job.keep_after_expiry:
            return None
        return job

    def cancel(self, job: Job, now: float) -> bool:
        changed = job.cancel(now)
        if changed:
            self._schedule(job)  # the end moved earlier, so may the expiry
        return changed

    def rescheduled(self, job: Job) -> None:
        """Call after changing a job's timeline (RunPod retry)."""
        self._schedule(job)

    def remove(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def purge(self, now: float) -> int:
        """Drop jobs whose deadline passed; stale heap entries (deadline moved) are rechecked, not trusted."""
        removed = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, job_id = heapq.heappop(heap)
            job = self._jobs.get(job_id)
            if job is not None and job.expired(now):
                del self._jobs[job_id]
                removed += 1
        return removed

    def clear(self) -> None:
        self._jobs.clear()
        self._deadlines.clear()

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))
