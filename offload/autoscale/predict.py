"""The learned pre-rent of a queue with overflow (`overflow.predict`): pure functions of the arrivals it saw.

An online fleet sees a burst when it lands and pays a boot before any machine serves it, so at a wait target near
a boot the burst is overflow's. When bursts recur (a batch every hour on the hour, a workday's morning) a machine
rented a boot ahead is ready as one lands. The profile counts the queue's arrivals per `bin` of absolute time for
the last `recur` periods (bounded: at most (recur + 1) x period / bin counts, and only the bins that saw a job);
the forecast for the next `lead` seconds is the fewest arrivals the same stretch of each of the last `recur`
periods saw, so one burst never predicts the next: it must have come every time. A forecast that does not come
only holds the machines until its stretch has passed; then the scale-in rules release them like any idle machine.

Arrivals are counted in the bin of the evaluation that saw them (up to one poll after they came), so `lead` is a
boot and a poll.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from offload.autoscale.settings import Predict

Profile = dict[int, int]  # absolute bin (seconds since the epoch // bin) -> jobs that arrived in it


def parse(text: str) -> Profile:
    out: Profile = {}
    for part in filter(None, text.split(",")):
        k, _, n = part.partition(":")
        try:
            out[int(k)] = int(n)
        except ValueError:
            return {}  # a damaged record: learn afresh rather than fail the evaluation
    return out


def dump(profile: Profile) -> str:
    return ",".join(f"{k}:{n}" for k, n in sorted(profile.items()))


def record(profile: Profile, now: float, arrived: int, cfg: Predict) -> Profile:
    """The profile with `arrived` jobs counted at `now`, bins older than `recur` periods (and a lead) dropped."""
    oldest = math.floor((now - (cfg.recur + 1) * cfg.period) / cfg.bin)
    kept = {k: n for k, n in profile.items() if k >= oldest}
    if arrived > 0:
        k = math.floor(now / cfg.bin)
        kept[k] = kept.get(k, 0) + arrived
    return kept


@dataclass(frozen=True)
class Forecast:
    jobs: int  # the fewest arrivals the next `lead` seconds saw in each of the last `recur` periods
    at: float  # when, within the period, most of them came in the last period (seconds into it)


def forecast(profile: Profile, now: float, lead: float, cfg: Predict) -> Forecast | None:
    """What the next `lead` seconds (now's bin, so a burst a little late still finds its machines, up to now +
    lead) brought in each of the last `recur` periods: None unless every one of them saw a job there."""
    counts: list[int] = []
    first = None
    for j in range(1, cfg.recur + 1):
        lo = math.floor((now - j * cfg.period) / cfg.bin)
        hi = math.floor((now - j * cfg.period + lead) / cfg.bin)
        seen = [(k, profile.get(k, 0)) for k in range(lo, hi + 1)]
        counts.append(sum(n for _, n in seen))
        if j == 1 and counts[0] > 0:
            first = max(seen, key=lambda kn: kn[1])[0]
    jobs = min(counts, default=0)
    if jobs <= 0 or first is None:
        return None
    return Forecast(jobs, (first * cfg.bin) % cfg.period)


def phase_text(at: float, period: float) -> str:
    """Where in the period a burst came: ':05' within an hour, '14:05' within a day, else seconds into it."""
    clock = datetime.fromtimestamp(at, UTC)
    if period == 3600:
        return f":{clock.minute:02d}"
    if period == 86400:
        return f"{clock.hour:02d}:{clock.minute:02d}"
    return f"{at:g}s into the period"
