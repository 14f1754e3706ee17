"""The arithmetic of a job's limits in a routed queue (worker/job_limits.py, Lane.expected_duration_s, and what a
finished run measures: jobpath.measured), without a worker: the order for a deadline (in time by price, then
unknown, then late by expected finish), max_cost's filter, a batch lane's `turnaround_s`, and the run time and
queue delay a result yields. The worker-level behaviour is in test_routing_limits.py."""

from __future__ import annotations

from dataclasses import dataclass

from offload.backends.base import RemoteResult
from offload.queue.backend_health import Health
from offload.worker.job_limits import JobLimits, Ranked, by_deadline
from offload.worker.jobpath import measured
from offload.worker.routing import Lane


@dataclass(frozen=True)
class Prices:
    price_per_job: float | None = None
    price_per_second: float | None = None
    max_job_cost: float | None = None


@dataclass(frozen=True)
class Option:
    name: str
    expected_s: float | None
    expected_cost: float | None
    prices: Prices = Prices()


@dataclass(frozen=True)
class Job:
    deadline: int | None = None
    max_cost: float | None = None


def names(ranked: list[Ranked[Option]]) -> list[str]:
    return [r.option.name for r in ranked]


def test_a_deadline_orders_in_time_by_price_then_unknown_then_late_by_finish() -> None:
    options = [
        Option("late-cheap", 90.0, 0.001),
        Option("unknown", None, 0.01),
        Option("dear", 5.0, 0.5),
        Option("cheap", 20.0, 0.01),
        Option("late-soon", 70.0, 1.0),
        Option("unpriced", 1.0, None),
    ]
    ranked = by_deadline(options, left_s=60.0)
    assert names(ranked) == ["cheap", "dear", "unpriced", "unknown", "late-soon", "late-cheap"]
    assert [r.reason for r in ranked] == ["deadline"] * 3 + [""] + ["late"] * 2  # unknown: the route's reason
    assert ranked[0].lead == "deadline: cheap ~20s in time, cheapest"
    assert ranked[1].lead == "deadline: dear ~5.0s in time"
    assert ranked[3].lead == "deadline: unknown's duration not known yet"
    assert ranked[4].lead == "deadline: none expected in time (~60s left), late-soon ~70s, the soonest"


def test_a_deadline_already_past_by_the_store_clock_sends_the_job_to_the_soonest() -> None:
    ranked = by_deadline([Option("slow", 30.0, 0.01), Option("fast", 2.0, 0.5)], left_s=-3.0)
    assert names(ranked) == ["fast", "slow"]
    assert ranked[0].lead == "deadline: none expected in time (~0.0s left), fast ~2.0s, the soonest"


def test_max_cost_filters_and_the_deadline_is_read_against_the_given_now() -> None:
    limits = JobLimits(poll_timeout=100.0)
    options = [
        Option("dear", 1.0, 0.5, Prices(price_per_job=0.5)),
        Option("per-second", 1.0, 0.05, Prices(price_per_second=0.001)),  # may cost 0.1 over poll_timeout
        Option("cheap", 50.0, 0.01, Prices(price_per_job=0.01)),
        Option("unpriced", 1.0, None),
    ]
    bounded = limits(Job(max_cost=0.1), options, now_ms=0)
    assert names(bounded) == ["per-second", "cheap", "unpriced"]
    assert {r.note for r in bounded} == {"max_cost $0.1: dear may cost more"}
    assert {r.reason for r in bounded} == {"max_cost"}
    assert [r.reason for r in limits(Job(), options, now_ms=0)] == [""] * 4
    # due 100 s after the store's now of 1,000,000 ms: `cheap` (50 s) is in time and cheapest
    timed = limits(Job(deadline=1_100_000, max_cost=0.1), options, now_ms=1_000_000)
    assert names(timed)[0] == "cheap" and timed[0].note == "max_cost $0.1: dear may cost more"
    # due 10 s after it: only the fast ones are
    assert names(limits(Job(deadline=1_010_000), options, now_ms=1_000_000))[:2] == ["per-second", "dear"]


def test_a_lanes_expected_duration_is_measured_else_its_prior_or_its_turnaround() -> None:
    lane = Lane(name="x", backend=None, limits=None, expected_run_s=12.0)  # type: ignore[arg-type]
    assert lane.expected_duration_s(None) == 12.0
    unmeasured = Health("closed", 0, None)
    assert lane.expected_duration_s(unmeasured) == 12.0
    seen = Health("closed", 0, 3.0, mean_queue_s=4.5)
    assert lane.expected_duration_s(seen) == 7.5
    assert Lane(name="y", backend=None, limits=None).expected_duration_s(unmeasured) is None  # type: ignore[arg-type]
    lane.turnaround_s = 3600.0  # a batch lane's whole expected duration wins
    assert lane.expected_duration_s(seen) == 3600.0


def test_a_finished_run_measures_its_run_time_and_queue_delay() -> None:
    reported = RemoteResult("succeeded", duration_s=2.0, queue_s=5.0)
    assert measured(reported, waited_s=9.0, submitted=True) == (2.0, 5.0)
    assert measured(reported, waited_s=1.0, submitted=False) == (2.0, 5.0)  # reported: whoever waited
    billed = RemoteResult("succeeded", duration_s=2.0)
    assert measured(billed, waited_s=9.0, submitted=True) == (2.0, 7.0)  # the rest of the wait was the queue
    assert measured(billed, waited_s=9.0, submitted=False) == (2.0, None)  # resumed: part of the wait unseen
    assert measured(billed, waited_s=1.0, submitted=True) == (2.0, 0.0)
    assert measured(RemoteResult("succeeded"), waited_s=9.0, submitted=True) == (9.0, None)
