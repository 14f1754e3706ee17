"""Whether a queue is capped: its daily job or spend cap reached in the store's cap window (its UTC day).

The cap window is the UTC day of the store's clock: `window_of` here for Python (the autoscaler's spend days, the
harness), `window_of` / `window_left` in lua/includes/clock.lua for the queue's scripts, the same rule twice
because scripts cannot import Python (tests/jobstore/test_clock.py holds them equal).

The caps are offload.yaml's (`queues.<name>.daily_job_cap` / `daily_spend_cap`), the counts the store's
(`QueueStore.usage`). The rule is the one the claim and begin scripts apply (`cap_reached` in caps.lua): the
job cap is reached at `jobs >= cap`, the spend cap once one more submission at its reservation would pass it. A
capped queue takes no fresh job until the window rolls over, so its queued jobs wait: every view says `capped`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, Protocol

CapKind = Literal["jobs", "spend"]
CAPPED_WAIT = "queued jobs wait for the next cap window (the job store's UTC day)"
QueueStatus = Literal["running", "paused", "capped"]
DAY_S = 86_400


def window_of(now_s: float) -> str:
    """The cap window holding `now_s` (epoch seconds): its UTC day as digits, `20261130`."""
    return datetime.fromtimestamp(now_s, UTC).strftime("%Y%m%d")


def window_start_s(now_s: float) -> float:
    """When the cap window holding `now_s` began (its UTC midnight), in epoch seconds."""
    return now_s // DAY_S * DAY_S


def next_window_s(now_s: float) -> float:
    """When the next cap window begins (the next UTC midnight), in epoch seconds."""
    return window_start_s(now_s) + DAY_S


def reservation(
    *, max_job_cost: float | None, price_per_job: float | None, price_per_second: float | None, poll_timeout: float
) -> float:
    """What one submission is reserved at against the spend cap before it is sent: the most it may cost.
    `max_job_cost` when set; else `price_per_job`; else `price_per_second` times `poll_timeout` (a remote job
    still running then is cancelled)."""
    if max_job_cost is not None:
        return max_job_cost
    if price_per_job is not None:
        return price_per_job
    if price_per_second is not None:
        return price_per_second * poll_timeout
    return 0.0


@dataclass(frozen=True)
class CapLimits:
    """A queue's daily caps, and what its next submission would reserve against the spend cap."""

    jobs_cap: int | None = None
    spend_cap: float | None = None
    reserve: float = 0.0


def reached(limits: CapLimits, jobs_used: int, spend_used: float) -> CapKind | None:
    """Which cap stops fresh jobs now, if any (the job cap first, as the scripts check it)."""
    if limits.jobs_cap is not None and jobs_used >= limits.jobs_cap:
        return "jobs"
    if limits.spend_cap is not None and spend_used + limits.reserve > limits.spend_cap:
        return "spend"
    return None


class UsageSource(Protocol):
    """What `cap_reached` reads: a queue's (window, jobs counted, spend) in the current cap window, as
    `QueueStore.usage` answers it (a protocol, so this module stays below the job store)."""

    async def usage(self, queue: str) -> tuple[str, int, float]: ...


async def cap_reached(store: UsageSource, queue: str, limits: CapLimits | None) -> CapKind | None:
    """`reached` for the store's current window; None without caps (no store call then)."""
    if limits is None or (limits.jobs_cap is None and limits.spend_cap is None):
        return None
    _, jobs_used, spend_used = await store.usage(queue)
    return reached(limits, jobs_used, spend_used)


def queue_status(paused: bool, capped: CapKind | None) -> QueueStatus:
    """What a queue is doing, in one word: a pause says more than a cap (resuming would not start it)."""
    if paused:
        return "paused"
    return "capped" if capped else "running"
