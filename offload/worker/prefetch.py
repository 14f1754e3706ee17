"""How many jobs a dispatch worker leases ahead of its slots (see docs/explanation/architecture.md, *Slots*).

The jobs claimed ahead keep every slot busy while the next claim is on its way. A fixed share of `concurrency`
fits one pace only: long jobs (a GPU's seconds to minutes) leave a slot a few times a second and need few ahead,
while jobs of milliseconds leave thousands of slots a second and a quarter of `concurrency` runs out while each
claim is out. So, by default, as many jobs are leased ahead as leave their slots during two claim round trips at
the current pace: never fewer than the floor (`WorkerOptions.leased_max`: a quarter of `concurrency`), never more
than `concurrency` or `claim_batch`. A `prefetch` given, and a daily cap (nothing ahead: a job claimed ahead of a
reached cap is held), are kept as they are.

A pace is an average, and jobs do not leave evenly: jobs started together with the same remote duration stay in
step and leave their slots in bursts. Every job that leaves between two claim replies is replaced from the jobs
ahead or waits for the next reply, so the most that left between two replies (a peak that halves every
`BURST_HALF_LIFE_S`) is also covered, where the jobs are short enough for that wait to matter: where one round
trip is at least `BURST_SHARE` of a job's time in its slot. GPU jobs keep the floor, however they leave. The
measurements behind both are in docs/explanation/performance.md, *Jobs leased ahead*.
"""

from __future__ import annotations

import math

from offload.worker.options import WorkerOptions

ALPHA = 0.3  # weight of the newest sample in the moving averages
MIN_WINDOW_S = 0.05  # the pace is sampled over at least this long (claims can follow each other within a ms)
ROUND_TRIPS = 2.0  # jobs ahead to cover this many claim round trips at the current pace
BURST_SHARE = 0.005  # bursts are covered where one claim round trip is at least this share of a job's slot time
BURST_HALF_LIFE_S = 5.0  # the peak of jobs leaving between two claim replies halves in this time


class Prefetch:
    """The pace at which jobs leave their slots and the claims' round trip, and what they ask to lease."""

    __slots__ = ("_between", "_burst", "_left", "_pace", "_replied", "_rtt", "_since", "options")

    def __init__(self, options: WorkerOptions, now: float) -> None:
        self.options = options  # read at each claim: the worker's options may be tuned after it was made
        self._left = 0
        self._since = now
        self._pace = 0.0  # jobs leaving their slots per second
        self._rtt = 0.0  # seconds from a claim's send to its reply
        self._between = 0  # jobs that left since the last claim reply
        self._burst = 0.0  # the (decaying) peak of `_between` at a reply
        self._replied = now

    def left(self) -> None:
        """A job left its slot (its remote work ended)."""
        self._left += 1
        self._between += 1

    def claimed(self, sent: float, now: float) -> None:
        """A claim sent at `sent` was answered at `now` (monotonic seconds)."""
        self._rtt = _average(self._rtt, now - sent)
        decay = 0.5 ** (max(0.0, now - self._replied) / BURST_HALF_LIFE_S)
        self._burst = max(float(self._between), self._burst * decay)
        self._between, self._replied = 0, now
        if now - self._since >= MIN_WINDOW_S:
            self._pace = _average(self._pace, self._left / (now - self._since))
            self._left, self._since = 0, now

    def ahead(self) -> int:
        """Jobs to lease beyond `concurrency` now."""
        o = self.options
        floor = o.leased_max - o.concurrency
        if o.prefetch is not None or o.capped:
            return floor
        per_trip = self._pace * self._rtt  # jobs leaving during one round trip, on average
        need = math.ceil(ROUND_TRIPS * per_trip)
        if per_trip >= BURST_SHARE * o.concurrency:  # short jobs: a burst waiting for a claim costs throughput
            need = max(need, math.ceil(self._burst))
        return min(max(need, floor), max(floor, min(o.concurrency, o.claim_batch)))

    def leased_max(self) -> int:
        """Jobs before or in their remote work this worker may hold now."""
        return self.options.concurrency + self.ahead()


def _average(old: float, sample: float) -> float:
    return sample if old == 0.0 else old + ALPHA * (sample - old)
