"""One clock: the job store's. Everything that must agree across machines (cap windows, lease deadlines, retry and
delay times, the autoscaler's spend days and instance times, GPU workers' heartbeat stamps) reads Valkey's TIME,
never the clock of the process that happens to act: a worker host whose clock is a day ahead must not open a cap
window of its own, nor a server whose clock is behind hold back a leadership or miss a heartbeat.

The queue's scripts read TIME themselves (lua/includes/clock.lua: `now_ms`, `window_of`), and move the times they
scheduled back when the store's clock steps back (`shift_back` in outages.lua). Python code that needs the store's time
between calls (the autoscaler's tick, the server's GPU-worker registry) reads it through `StoreClock`: the store's
TIME read at each `sync`, carried forward by this process's monotonic clock, so a step of the local wall clock
changes nothing and a step of the store's is followed at the next sync. See docs/explanation/architecture.md, *Caps*.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from offload.clock import span_text
from offload.redis_client import RedisClient

log = logging.getLogger("offload.queue")


class HeldRelease(NamedTuple):
    """What a release of held jobs did (release_window.lua): how many went back, the store's cap window (its UTC
    day, digits) and the seconds until its next one begins."""

    released: int
    window: str
    next_window_s: float


def log_clock_step(queue: str, stepped_ms: int) -> None:
    """The one line a process logs when one of its calls found the store's clock stepped back (and moved the
    queue's times back with it): the queue's events stream has it too, as `clock_stepped_back`."""
    log.warning(
        "queue %s: the job store's clock stepped back %.1f s; lease deadlines, retry and delay times moved back "
        "with it, held jobs of a later window released",
        queue,
        stepped_ms / 1000,
    )


HOST_SKEW_WARN_S = 60.0  # a host kept in time is milliseconds off: a minute is a clock nobody keeps


def warn_host_skew(store_now: float, host_now: float) -> None:
    """The one line a process logs at start when its host's clock and the job store's differ by more than a
    minute. Nothing offload decides reads the host's clock, but S3 refuses a request signed more than 15 minutes
    off its server's clock (the worker's outputs then wait), and presigned URLs and log times are off as much."""
    skew = host_now - store_now
    if abs(skew) <= HOST_SKEW_WARN_S:
        return
    log.warning(
        "this host's clock is %s %s the job store's (Valkey's TIME): queues, caps and leases keep the store's, "
        "but S3 refuses requests signed more than 15 minutes off, and presigned URLs and log times are off as "
        "much; fix the time sync (NTP, chrony) of whichever host is wrong",
        span_text(skew),
        "ahead of" if skew > 0 else "behind",
    )


class StoreClock:
    """The job store's time, in epoch seconds, callable like `time.time`. Before the first `sync` it is this
    process's clock (nothing better is known yet)."""

    def __init__(self) -> None:
        self._base: float | None = None  # the store's time at `_mono`
        self._mono = 0.0

    def __call__(self) -> float:
        if self._base is None:
            return time.time()
        return self._base + (time.monotonic() - self._mono)

    async def sync(self, redis: RedisClient) -> float:
        """Read the store's TIME (the middle of the round trip stands for the moment it was read); returns it."""
        sent = time.monotonic()
        seconds, micros = await redis.time()
        got = time.monotonic()
        self._base, self._mono = int(seconds) + int(micros) / 1e6, (sent + got) / 2
        return self._base
