"""Sizing a fleet that has serverless overflow: pure functions of the queue's load, the fleet and the clock.

A queue whose `autoscale` block names `overflow` backends is served by two kinds of capacity: rented machines
(cheap per hour, minutes to boot) and serverless backends (seconds to start, several times the GPU-second). The
rule that makes the mix pay: rent for the load that stays, send the burst to overflow.

- `predicted_wait`: when the fleet would start the job at a given place in the queue, from the machines serving,
  their measured rate and the machines booting with their expected ready time. A job goes to overflow when this
  exceeds `overflow.after` (the dispatch worker and bench.cost both ask it).
- `base_load`: machines the recent arrivals keep busy, taken as a low quantile of the offered load (arrivals x
  mean run time) over `span`-long buckets of the last `window`. A burst fills one bucket and leaves the quantile
  alone; a load that stays fills them all.
- `burst_machines`: more machines while the queue holds work the fleet will not start within `after`, but only
  as many as pay: a machine rented now starts (after - boot) x rate of it in time, and that work on it must cost
  less than on overflow with its boot and its idle tail (how long scale-in keeps it after) paid (`pays`). A burst
  that lasts keeps justifying them; the arrivals it brings also raise the base.
- `keep_machines`: how many machines that base keeps busy enough to beat overflow's price (Erlang's loss formula).
- `size`: the count and its floor (the base is kept through idle gaps; burst machines go by the idle rules).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from offload.autoscale.settings import Overflow

Sample = tuple[float, int]  # (seconds, the queue's total jobs enqueued by then)


def predicted_wait(position: int, idle: int, serving: int, rate: float, booting: Sequence[float]) -> float | None:
    """Seconds until the fleet starts the job with `position` jobs ahead of it (None: it never will).

    `serving`: machines with a worker taking jobs, `idle` of them free now; `rate`: jobs a serving machine finishes
    a minute (measured: 60 / mean run time); `booting`: seconds until each booting machine is expected to serve
    (<= 0: any moment). A freed or newly ready machine takes the next job at once, so by time t the fleet has
    started idle + rate x t x serving + sum over ready boots of (1 + rate x (t - ready)) jobs."""
    need = position + 1 - idle
    if need <= 0:
        return 0.0
    per_s = max(rate, 0.0) / 60
    ready = sorted(max(0.0, b) for b in booting)
    t, have, slope = 0.0, 0.0, per_s * serving
    for at in [*ready, math.inf]:
        if slope > 0 and t + (need - have) / slope <= at:
            return t + (need - have) / slope
        if at == math.inf:
            return None
        have, t, slope = have + slope * (at - t) + 1, at, slope + per_s
        if have >= need:
            return t
    return None  # not reached: the loop returns at inf


def base_load(samples: Sequence[Sample], now: float, run_s: float, cfg: Overflow) -> tuple[float, int]:
    """(machines, buckets): the `cfg.quantile` of the offered load over the last window's whole buckets. Offered
    load of a bucket: jobs enqueued in it x the mean run time / the bucket's length. No whole bucket yet: 0."""
    if not samples or run_s <= 0:
        return 0.0, 0
    first = samples[0][0]
    loads = []
    for k in range(int(cfg.window // cfg.span)):
        end, start = now - k * cfg.span, now - (k + 1) * cfg.span
        if start < first:
            break
        loads.append((_enqueued_by(samples, end) - _enqueued_by(samples, start)) * run_s / cfg.span)
    if not loads:
        return 0.0, 0
    loads.sort()
    return loads[int(cfg.quantile * (len(loads) - 1))], len(loads)


def _enqueued_by(samples: Sequence[Sample], t: float) -> int:
    """The total at the last sample at or before t (the first sample's if t precedes it)."""
    got = samples[0][1]
    for at, total in samples:
        if at > t:
            break
        got = total
    return got


def keep_samples(samples: Sequence[Sample], now: float, enqueued: int, window: float) -> list[Sample]:
    """The samples with (now, enqueued) added, those older than one window before the oldest still needed
    dropped. A total that went down (the store was reset) starts over."""
    if samples and (enqueued < samples[-1][1] or now < samples[-1][0]):
        samples = []
    kept = [s for s in samples if s[0] >= now - window]
    older = [s for s in samples if s[0] < now - window]
    return [*older[-1:], *kept, (now, enqueued)]


def burst_machines(
    pending: int, capacity: float, rate: float, boot: float, after: float, keep_busy: float, tail: float
) -> int:
    """Machines to rent for the `pending` jobs beyond `capacity` (what the fleet starts within `after`): each
    new one starts (after - boot) x rate of them, and is rented only when that work on it costs less than on
    overflow with its boot and its idle `tail` (how long scale-in keeps it once the burst is done) paid."""
    excess = pending - capacity
    if excess <= 0 or rate <= 0 or after <= boot:
        return 0
    return machines_for(excess, (after - boot) * rate / 60, 60 / rate, keep_busy, boot + tail)


def pays(work_s: float, overhead_s: float, keep_busy: float) -> bool:
    """Whether a machine that works `work_s` and bills `overhead_s` besides (its boot, a wait for the work, its
    idle tail) costs less than that work on overflow: `keep_busy` is the rented price over the serverless one."""
    return work_s > 0 and work_s * (1 / keep_busy - 1) >= overhead_s


def machines_for(jobs: float, per_machine: float, run_s: float, keep_busy: float, overhead_s: float) -> int:
    """Machines for `jobs` when one that starts `per_machine` of them in time, billing `overhead_s` besides its
    work, pays for itself: enough to start them all. The last is not held to its share: a load that lasts
    keeps it busy after (a diurnal rise), and a burst's last machine serves the others' tails."""
    if jobs <= 0 or per_machine <= 0 or not pays(per_machine * run_s, overhead_s, keep_busy):
        return 0
    return math.ceil(jobs / per_machine - 1e-9)


def capacity(idle: int, serving: int, rate: float, booting: Sequence[float], within: float) -> float:
    """Jobs the fleet starts within `within` seconds (the inverse of predicted_wait)."""
    per_s = max(rate, 0.0) / 60
    ready = sum(1 + per_s * (within - max(0.0, b)) for b in booting if b <= within)
    return idle + per_s * within * serving + ready


@dataclass
class Sizing:
    target: int
    floor: int  # the base: kept through idle gaps
    burst: int  # machines the waiting work justifies beyond the fleet
    why: str


def keep_machines(load: float, busy: float, limit: int) -> int:
    """How many machines to keep for an offered `load` (machines' worth of work) that overflows what they cannot
    start: the n-th is kept while it would be busy at least `busy` of the time. The n-th machine's share is
    load x (B(n-1) - B(n)), B Erlang's loss formula (jobs that find every machine busy go elsewhere): a job that
    may wait `after` only makes the machines busier, so this never keeps one that does not pay."""
    n, lost = 0, 1.0
    while n < limit and load > 0:
        nxt = load * lost / (n + 1 + load * lost)
        if load * (lost - nxt) < busy:
            break
        n, lost = n + 1, nxt
    return n


def size(base: float, buckets: int, burst: int, active: int, limit: int, cfg: Overflow) -> Sizing:
    keep = keep_machines(base, cfg.keep_busy, limit)
    target = min(max(keep, active + burst if burst else keep), limit)
    why = (
        f"base load {base:.1f} machines (q{cfg.quantile:g} of {buckets} bucket(s) of {cfg.span / 60:g} min): "
        f"keep {keep}, each busy >= {cfg.keep_busy:.0%}"
    )
    if burst:
        why += f"; waiting work justifies {burst} more"
    else:
        why += "; burst carried by overflow"
    return Sizing(target=target, floor=keep, burst=burst, why=why)
