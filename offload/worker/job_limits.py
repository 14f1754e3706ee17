"""A job's own limits in a routed queue (worker/routing.py's `Constraints`, on for every routed queue): its
`max_cost` and its `deadline` (docs/how-to/deadlines-and-budgets.md, *With several backends*).

- `max_cost`: a backend whose price model may cost more than it is skipped (worker/budget.py's `fits`); the job
  fails only when no backend of the queue fits (`budget.none_fits`, checked before the route).
- `deadline`: each backend's expected finish is the store's now plus its expected duration (its measured mean
  queue delay and mean run time, its `expected_run_s` before any measurement, or a batch lane's `turnaround_s`).
  The cheapest backend expected to finish by the deadline goes first; then those whose duration is unknown (in
  the route's order: they may be in time); then the late ones, soonest first, so that with none expected in time
  the job goes to the one expected to finish first (it still starts before its deadline, which is what fails a
  job: a deadline is the latest start). The expected finish chooses among backends; it never fails a job.

Every time here is on the store's clock (`now_ms` is read with the backends' health), so a worker whose clock is
skewed routes as any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from offload.worker.budget import Budgeted, PriceModel, fits


class Option(Protocol):
    """A backend a submission may go to, as the router sees it (routing.Candidate)."""

    @property
    def name(self) -> str: ...
    @property
    def prices(self) -> PriceModel: ...
    @property
    def expected_s(self) -> float | None: ...  # its expected duration: queue delay and run time (None: unknown)
    @property
    def expected_cost(self) -> float | None: ...


class Limited(Budgeted, Protocol):
    @property
    def deadline(self) -> int | None: ...  # epoch ms, the store's clock


T = TypeVar("T", bound=Option)


@dataclass(frozen=True, slots=True)
class Ranked(Generic[T]):
    """An option in the job's order, and what its limits say of it: `lead`, the reason's head when the deadline
    ranked it (`deadline: fal ~40s in time, cheapest`); `note`, what the budget skipped; `reason`, the metrics'
    kind (deadline, late, max_cost; "": the route kind's own, also for a backend whose duration is unknown)."""

    option: T
    lead: str = ""
    note: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class JobLimits:
    """The `Constraints` of a routed queue: `poll_timeout` bounds what a backend priced per second may cost."""

    poll_timeout: float

    def __call__(self, job: Limited, options: list[T], now_ms: float) -> list[Ranked[T]]:
        fitting = [o for o in options if fits(job, o.prices, poll_timeout=self.poll_timeout) is None]
        dear = [o.name for o in options if o not in fitting]
        note = f"max_cost ${job.max_cost:.4g}: {', '.join(dear)} may cost more" if dear else ""
        if job.deadline is None:
            return [Ranked(o, note=note, reason="max_cost" if note else "") for o in fitting]
        return by_deadline(fitting, (job.deadline - now_ms) / 1000, note)


def by_deadline(options: list[T], left_s: float, note: str = "") -> list[Ranked[T]]:
    """`options` ordered for a deadline `left_s` seconds away: in time (cheapest first, unknown prices last), then
    of unknown duration, then late (soonest first)."""
    timed = [o for o in options if o.expected_s is not None]
    in_time = sorted(
        (o for o in timed if _s(o) <= left_s), key=lambda o: (o.expected_cost is None, o.expected_cost or 0.0)
    )
    late = sorted((o for o in timed if _s(o) > left_s), key=_s)
    unknown = [o for o in options if o.expected_s is None]
    ranked = [
        Ranked(o, f"deadline: {o.name} {_about(_s(o))} in time{', cheapest' if i == 0 else ''}", note, "deadline")
        for i, o in enumerate(in_time)
    ]
    # (not ranked by the deadline: the route's own order, and its reason in the metrics)
    ranked += [Ranked(o, f"deadline: {o.name}'s duration not known yet", note) for o in unknown]
    ranked += [
        Ranked(
            o,
            f"deadline: none expected in time ({_about(max(left_s, 0.0))} left), {o.name} {_about(_s(o))}"
            f"{', the soonest' if i == 0 else ''}",
            note,
            "late",
        )
        for i, o in enumerate(late)
    ]
    return ranked


def _s(option: Option) -> float:
    assert option.expected_s is not None
    return option.expected_s


def _about(seconds: float) -> str:
    return f"~{seconds:.0f}s" if seconds >= 10 else f"~{seconds:.1f}s"
