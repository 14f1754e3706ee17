"""The clock types: what a component that reads the time takes, so a test can hand it a virtual clock.

One unit per name: `Clock` gives epoch seconds (a float, like `time.time`), `ClockMs` epoch milliseconds (an int,
what the queue's scripts take as `now`). A value or a name holding milliseconds ends in `_ms`. Which clock
to trust across machines (the job store's TIME) is offload/queue/store_clock.py's `StoreClock`, a `Clock`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]
ClockMs = Callable[[], int]


def now_s() -> float:
    """This process's wall clock in epoch seconds (the default `Clock`)."""
    return time.time()


def now_ms() -> int:
    """This process's wall clock in epoch milliseconds."""
    return time.time_ns() // 1_000_000


def in_ms(clock: Clock) -> ClockMs:
    """A `Clock` read in whole milliseconds: how an injected clock is passed on to the queue's scripts."""
    return lambda: int(clock() * 1000)


def span_text(seconds: float) -> str:
    """A clock difference as a person reads it: minutes under an hour and a half, hours past it."""
    size = abs(seconds)
    return f"{size / 3600:.1f} h" if size >= 5400 else f"{size / 60:.0f} min"
