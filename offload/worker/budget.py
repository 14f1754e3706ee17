"""A job's `max_cost` against a backend's price model: whether one submission there may cost more than the job
allows. One small function, so a router can ask it per candidate backend as the dispatch worker asks it of its
one backend before each fresh submission (jobpath.py)."""

from __future__ import annotations

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


def fits(job: Budgeted, backend: PriceModel, *, poll_timeout: float) -> str | None:
    """None when a submission of `job` to `backend` cannot cost more than the job's `max_cost`, else the reason
    it may. The most a submission may cost is what the spend cap reserves for it (caps.reservation:
    `max_job_cost`, else `price_per_job`, else `price_per_second` times `poll_timeout`). A backend with no price
    model at all cannot be judged and is let through."""
    if job.max_cost is None:
        return None
    if backend.max_job_cost is None and backend.price_per_job is None and backend.price_per_second is None:
        return None
    most = reservation(
        max_job_cost=backend.max_job_cost,
        price_per_job=backend.price_per_job,
        price_per_second=backend.price_per_second,
        poll_timeout=poll_timeout,
    )
    if most <= job.max_cost:
        return None
    return f"{OVER_MAX_COST}: a submission may cost ${most:.4g}, over the job's max_cost ${job.max_cost:.4g}"
