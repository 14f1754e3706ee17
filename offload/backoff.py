"""Backoff: the one formula every retry and reconnect loop in offload uses.

`compute_backoff` is exponential and capped, in whatever unit `base` and `cap` are given (seconds or ms), with
optional "equal jitter" (half fixed, half random) so the retries of a burst spread out instead of arriving
together. `Backoff` is the same formula as a small stateful helper for loops that wait, retry and reset.
"""

from __future__ import annotations

import random

# Past this many doublings any base is past any cap; 2.0 ** 1024 overflows a float (an idle worker's claim loop
# counts its empty rounds without end: it reached that after 8.5 idle minutes and died of it).
MAX_DOUBLINGS = 64


def compute_backoff(attempt: int, *, base: float, cap: float, jitter: bool = False) -> float:
    """The wait before retry number `attempt` (1 for the first retry): `base * 2^(attempt-1)`, at most `cap`.
    With `jitter`, a uniform draw in [half, whole] of that wait."""
    ceiling = min(cap, base * 2.0 ** min(max(attempt - 1, 0), MAX_DOUBLINGS))
    return ceiling / 2 + random.random() * ceiling / 2 if jitter else ceiling


class Backoff:
    """Doubling waits for a loop: `next()` gives the wait before the next try, `reset()` after a success."""

    def __init__(self, base: float, cap: float, *, jitter: bool = False) -> None:
        self.base, self.cap, self.jitter = base, cap, jitter
        self.attempt = 0

    def next(self) -> float:
        self.attempt += 1
        return compute_backoff(self.attempt, base=self.base, cap=self.cap, jitter=self.jitter)

    def reset(self) -> None:
        self.attempt = 0


def retry_delay_ms(attempt: int, base_ms: int = 1_000, cap_ms: int = 300_000) -> int:
    """A job's retry delay in ms (the queue's default policy): exponential with equal jitter."""
    return int(compute_backoff(attempt, base=base_ms, cap=cap_ms, jitter=True))
