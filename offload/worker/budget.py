"""A job's `max_cost` against a backend's price model: whether one submission there may cost more than the job
allows. One small function, so a router asks it per candidate backend (worker/job_limits.py) as the dispatch
worker asks it of its one backend before each fresh submission (jobpath.py); `none_fits` fails a routed job only
when no backend of its queue fits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from offload.caps import reservation


class PriceModel(Protocol):
    """A backend's prices as offload.yaml gives them (backends.settings, WorkerOptions)."""

    @property
    def price_per_job(self) -> float | None: ...
    @property
    def price_per_second(self) -> float | None: ...
    @property
    def max_job_cost(self) -> float | None: ...


class Budgeted(Protocol):
    @property
    def max_cost(self) -> float | None: ...


OVER_MAX_COST = "over max_cost"  # the reason's prefix: its kind in events and metrics (fail.lua)


def most(backend: PriceModel, *, poll_timeout: float) -> float | None:
    """The most one submission to `backend` may cost: what the spend cap reserves for it (caps.reservation:
    `max_job_cost`, else `price_per_job`, else `price_per_second` times `poll_timeout`); None: no price model."""
    if backend.max_job_cost is None and backend.price_per_job is None and backend.price_per_second is None:
        return None
    return reservation(
        max_job_cost=backend.max_job_cost,
        price_per_job=backend.price_per_job,
        price_per_second=backend.price_per_second,
        poll_timeout=poll_timeout,
    )


def fits(job: Budgeted, backend: PriceModel, *, poll_timeout: float) -> str | None:
    """None when a submission of `job` to `backend` cannot cost more than the job's `max_cost`, else the reason
    it may. A backend with no price model at all cannot be judged and is let through."""
    if job.max_cost is None:
        return None
    at_most = most(backend, poll_timeout=poll_timeout)
    if at_most is None or at_most <= job.max_cost:
        return None
    return f"{OVER_MAX_COST}: a submission may cost ${at_most:.4g}, over the job's max_cost ${job.max_cost:.4g}"


def none_fits(job: Budgeted, backends: Mapping[str, PriceModel], *, poll_timeout: float) -> str | None:
    """For a queue with several backends: None when a submission to at least one of them fits the job's
    `max_cost`, else the reason, naming what each may cost."""
    if job.max_cost is None or any(fits(job, b, poll_timeout=poll_timeout) is None for b in backends.values()):
        return None
    prices = ", ".join(f"{name} ${most(b, poll_timeout=poll_timeout):.4g}" for name, b in backends.items())
    return f"{OVER_MAX_COST}: every backend may cost more than the job's max_cost ${job.max_cost:.4g} ({prices})"
