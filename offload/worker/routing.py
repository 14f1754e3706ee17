"""Which backend a submission goes to, for a queue with several (`backends:` and `route:`, docs/how-to/routing.md).

A `Lane` is one backend as a worker uses it: the client, its shared limits and health, its prices, its webhook
settings and its input mapping. The `Router` picks a lane per submission: `fallback` the first usable in the
configured order, `weighted` one of the usable by share, `cheapest` the usable one expected to cost least
(price_per_job, or price_per_second x its measured mean run time; unknown prices last). A backend cooling down is
skipped; one whose cool-down ran out is half-open and is tried only by the job that wins its probe; with every
backend cooling, the job waits (it does not fail) until the earliest reopens.

Never paid twice across providers: a job whose last submission's outcome is unknown (its intent open: a lost
answer, a timeout, a gateway 5xx, a worker killed inside the call) is pinned to the backend that intent was
recorded with (`ClaimedJob.backend`, written by begin.lua with the intent): it is adopted there, or sent there
again under the same Idempotency-Key, never to another, even while that one cools down. begin.lua holds the same
rule in the store (MOVED). Only a submission settled as not running (answered with an error, cancelled, expired)
leaves the job free to go elsewhere.

`Constraints` is the hook for a job's own limits, on for every routed queue (worker/job_limits.py): its max_cost
skips the backends that may cost more, its deadline orders the rest by expected finish (cheapest in time first),
after the route kind's own order.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from offload.backends.base import Backend, BackendError, Fatal, NotFound, RemoteResult, Throttled, WebhookBackend
from offload.backends.settings import AnthropicBatchSettings, AnyBackendSettings, OpenAIBatchSettings
from offload.config import Settings
from offload.models import ClaimedJob
from offload.queue.backend_health import BackendHealth, Health, HealthPolicy
from offload.queue.backend_limits import BackendLimits
from offload.redis_client import RedisClient
from offload.route_settings import RouteKind
from offload.worker.budget import PriceModel, none_fits
from offload.worker.job_limits import JobLimits, Ranked

log = logging.getLogger("offload.worker")
WAIT_MAX_S = 5.0  # with every backend cooling, the job looks again at least this often
PROBE_LEASE_EXTRA_S = 10.0  # a probe's lease: its call's timeout and this much more, then another job probes


@dataclass(eq=False)
class Lane:
    """One backend of the worker's queue, with what a submission to it needs."""

    name: str
    backend: Backend
    limits: BackendLimits
    hooks: WebhookBackend | None = None  # the backend, when its submissions carry webhook URLs
    health: BackendHealth | None = None  # a routed queue's backends only
    mapping: Callable[[Any], Any] | None = None  # the job input as this backend takes it
    price_per_job: float | None = None
    price_per_second: float | None = None
    max_job_cost: float | None = None
    expected_run_s: float | None = None  # the configured prior of a job's duration here, before any measurement
    turnaround_s: float | None = None  # set: a job's whole expected duration here (a batch lane's)
    hook_base: str | None = None
    hook_grace_s: float = 0.0
    hook_poll_interval: float = 60.0
    not_found_grace_s: float = 30.0
    resubmit_on_timeout: bool = False
    timeout: float = 30.0

    def cost(self, result: RemoteResult) -> float | None:
        """What a finished remote run cost: as reported, else billed seconds times the price, else the price per
        job; None when unknown (its reservation then stands as its cost)."""
        if result.cost is not None:
            return result.cost
        if self.price_per_second is not None and result.duration_s is not None:
            return self.price_per_second * result.duration_s
        return self.price_per_job

    def expected_cost(self, seen: Health | None) -> float | None:
        """`route: cheapest`'s price model: per job, else per second x the measured mean run time (None: unknown)."""
        if self.price_per_job is not None:
            return self.price_per_job
        if self.price_per_second is not None and seen is not None and seen.mean_run_s is not None:
            return self.price_per_second * seen.mean_run_s
        return None

    def expected_duration_s(self, seen: Health | None) -> float | None:
        """How long a job sent here now is expected to take until its result: `turnaround_s` when set, else the
        measured mean queue delay (0 until measured) plus the measured mean run time, or `expected_run_s` before
        any run was measured; None: unknown."""
        if self.turnaround_s is not None:
            return self.turnaround_s
        measured = seen.mean_run_s if seen is not None else None
        run_s = measured if measured is not None else self.expected_run_s
        if run_s is None:
            return None
        queued = seen.mean_queue_s if seen is not None else None
        return run_s + (queued or 0.0)

    def job_input(self, job_input: Any) -> Any:
        return self.mapping(job_input) if self.mapping is not None else job_input

    async def failed(self, exc: BackendError) -> None:
        """A call's error, noted against the backend's health when it says the backend is unwell (5xx, timeout,
        429); an error naming the job's input (a Fatal) says nothing of the backend."""
        if self.health is None:
            return
        if not unwell(exc):  # the backend answered (bad input, say): alive, and a probe's answer
            await self.health.succeeded()
            return
        retry = exc.retry_after if isinstance(exc, Throttled) else None
        seen = await self.health.failed(retry)
        if seen.granted:
            until = _clock(time.time() + seen.cool_ms / 1000)
            log.warning("backend %s: cooling down until %s after %s", self.name, until, type(exc).__name__)
            self.limits.note("route:opened")

    async def answered(self, run_s: float | None = None, queue_s: float | None = None) -> None:
        """A call answered: a half-open backend closes; `run_s` feeds the mean run time, `queue_s` the mean queue
        delay."""
        if self.health is not None:
            await self.health.succeeded(run_s, queue_s)


def unwell(exc: BackendError) -> bool:
    """A 5xx, a timeout or broken connection (no status), or a 429: what counts against a backend's health."""
    if isinstance(exc, Throttled):
        return True
    if isinstance(exc, Fatal | NotFound):
        return False
    return exc.status is None or exc.status >= 500


@dataclass(frozen=True, slots=True)
class Candidate:
    """A lane a submission may go to, and what the router knows of it (for `Constraints`)."""

    lane: Lane
    health: Health | None
    expected_cost: float | None
    expected_s: float | None = None  # its expected duration (Lane.expected_duration_s)

    @property
    def name(self) -> str:
        return self.lane.name

    @property
    def prices(self) -> PriceModel:
        return self.lane


# A job's own constraints (worker/job_limits.py): given the job, the usable candidates in the route kind's order and
# the store's time (ms), the ones it may use, best first, each with what it says of it.
Constraints = Callable[[ClaimedJob, list[Candidate], float], list[Ranked[Candidate]]]


@dataclass(frozen=True, slots=True)
class Choice:
    lane: Lane
    why: str  # the reason, for the job's events and record ("" for a single-backend queue: nothing to say)
    reason: str  # its kind, for the metrics: first, fallback, weighted, cheapest, probe, deadline, late, max_cost


@dataclass(eq=False)
class Router:
    """Chooses a lane per submission (see the module's docstring)."""

    lanes: list[Lane]
    kind: RouteKind = "fallback"
    weights: dict[str, float] = field(default_factory=dict)
    constraints: Constraints | None = None
    poll_timeout: float = 600.0  # what a backend priced per second may cost: for `over_budget`

    def __post_init__(self) -> None:
        self.by_name = {lane.name: lane for lane in self.lanes}

    @property
    def routed(self) -> bool:
        return len(self.lanes) > 1

    @property
    def first(self) -> Lane:
        return self.lanes[0]

    def pinned(self, job: ClaimedJob) -> Lane | None:
        """The lane a job is bound to: where its recorded remote job runs, or where its submission of unknown
        outcome went. None: free to route (also when that backend is no longer one of the queue's)."""
        if job.backend and (job.remote_id or job.intent_open):
            return self.by_name.get(job.backend)
        return None

    def over_budget(self, job: ClaimedJob) -> str | None:
        """A routed job's max_cost refusal: the reason when no backend of the queue fits it, naming each one's price;
        None when one does (the route skips those that do not)."""
        return none_fits(job, {lane.name: lane for lane in self.lanes}, poll_timeout=self.poll_timeout)

    def resumed(self, job: ClaimedJob) -> Lane:
        """The lane a claimed job starts on: its pinned one, else the first (routing happens at the submit)."""
        return self.pinned(job) or self.first

    async def choose(self, job: ClaimedJob, wait: Callable[[float], Any]) -> Choice:
        """A lane for the job's next submission; with none usable, waits (`wait(seconds)`, which a drain cuts)
        until one reopens."""
        if not self.routed:
            return Choice(self.first, "", "first")
        while True:
            seen = await asyncio.gather(*(self._seen(lane) for lane in self.lanes))
            choice = await self._pick(job, list(seen))
            if choice is not None:
                return choice
            soonest = min((h.cool_ms for h in seen if h is not None and h.cool_ms > 0), default=100) / 1000
            log.info("job %s: every backend is cooling down; waiting %.1fs", job.id, min(soonest, WAIT_MAX_S))
            await wait(min(max(soonest, 0.05), WAIT_MAX_S))

    async def _seen(self, lane: Lane) -> Health | None:
        return await lane.health.read() if lane.health is not None else None

    async def _pick(self, job: ClaimedJob, seen: list[Health | None]) -> Choice | None:
        usable = [
            Candidate(lane, h, lane.expected_cost(h), lane.expected_duration_s(h))
            for lane, h in zip(self.lanes, seen, strict=True)
        ]
        skipped = [c for c in usable if c.health is not None and not c.health.usable]
        order = self._order([c for c in usable if c not in skipped or (c.health and c.health.probe_free)])
        ranked = [Ranked(c) for c in order]
        if self.constraints is not None:
            now_ms = next((h.store_now_ms() for h in seen if h is not None), time.time() * 1000)
            ranked = self.constraints(job, order, now_ms)
        for r in ranked:
            c = r.option
            probe = c.health is not None and c.health.probe_free
            if probe and not await self._probe(c.lane):
                skipped.append(c)
                continue
            reason = "probe" if probe else r.reason or self._reason(c)
            return Choice(c.lane, self._why(c, skipped, probe, r), reason)
        return None

    def _order(self, candidates: list[Candidate]) -> list[Candidate]:
        if self.kind == "cheapest":  # unknown prices last, then the configured order
            return sorted(candidates, key=lambda c: (c.expected_cost is None, c.expected_cost or 0.0))
        if self.kind == "weighted" and candidates:
            shares = [self.weights.get(c.lane.name, 1.0) for c in candidates]
            first = random.choices(range(len(candidates)), weights=shares)[0]
            return [candidates[first], *(c for i, c in enumerate(candidates) if i != first)]
        return candidates

    async def _probe(self, lane: Lane) -> bool:
        assert lane.health is not None
        granted = await lane.health.probe(lane.timeout + PROBE_LEASE_EXTRA_S)
        if granted:
            log.info("backend %s: half-open, this job is its probe", lane.name)
        return granted

    def _reason(self, c: Candidate) -> str:
        if self.kind != "fallback":
            return self.kind
        return "first" if c.lane is self.first else "fallback"

    def _why(self, c: Candidate, skipped: Sequence[Candidate], probe: bool, r: Ranked[Candidate]) -> str:
        """What the job's events say, e.g. `fallback: replicate cooling down until 12:04:05Z, sent to fal`, or led
        by the job's deadline: `deadline: fal ~40s in time, cheapest; replicate cooling down until ...`."""
        past = [f"{s.lane.name} {_state(s.health)}" for s in skipped if s.health is not None]
        if r.lead:
            return "; ".join([r.lead, *past, *(["its probe"] if probe else []), *([r.note] if r.note else [])])
        head: str = "probe" if probe else self.kind
        if self.kind == "cheapest" and not probe:
            price = "unknown price" if c.expected_cost is None else f"~${c.expected_cost:.4g}"
            head = f"cheapest ({price})"
        why = f"{head}: {', '.join(past)}, sent to {c.lane.name}" if past else f"{head}: sent to {c.lane.name}"
        return f"{why}; {r.note}" if r.note else why


def _state(h: Health | None) -> str:
    if h is None:
        return "unknown"
    if h.cool_ms > 0:
        return f"cooling down until {_clock(time.time() + h.cool_ms / 1000)}"
    return "half-open, its probe out" if h.state != "closed" else "busy"


def _clock(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%H:%M:%SZ")


def turnaround(bs: AnyBackendSettings) -> float | None:
    """A batch backend's expected time from pack open to results; None for the per-job kinds."""
    if isinstance(bs, OpenAIBatchSettings | AnthropicBatchSettings):
        return bs.max_wait_s + bs.expected_duration_s
    return None


def build_router(
    settings: Settings,
    queue: str,
    backends: Mapping[str, Backend],
    limits: Mapping[str, BackendLimits],
    redis: RedisClient,
) -> Router:
    """The router of `queue` as configured: one lane per backend it names (with its health in the store when there
    are several), its input mappings imported."""
    q = settings.queue(queue)
    maps = settings.input_maps(queue)
    named = settings.backends_for(queue)
    lanes = []
    for name, bs in named:
        backend = backends[name]
        hook_base = settings.hook_base(name)
        h = settings.health_for(queue, name)
        policy = HealthPolicy(h.failures, h.window_s, h.cool_down_s, h.max_cool_down_s)
        lanes.append(
            Lane(
                name=name,
                backend=backend,
                limits=limits[name],
                hooks=backend if hook_base and isinstance(backend, WebhookBackend) else None,
                health=BackendHealth(redis, name, policy) if len(named) > 1 else None,
                mapping=maps.get(name),
                price_per_job=bs.price_per_job,
                price_per_second=bs.price_per_second,
                max_job_cost=bs.max_job_cost,
                expected_run_s=bs.expected_run_s,
                hook_base=hook_base,
                hook_grace_s=settings.hook_grace_s(name),
                hook_poll_interval=bs.webhook_poll_interval_s,
                not_found_grace_s=bs.not_found_grace_s,
                resubmit_on_timeout=bs.resubmit_on_timeout,
                timeout=bs.timeout,
                turnaround_s=turnaround(bs),
            )
        )
    own = JobLimits(q.poll_timeout) if len(lanes) > 1 else None  # a job's deadline and max_cost, in the route
    return Router(lanes, q.route, dict(q.weights or {}), own, q.poll_timeout)
