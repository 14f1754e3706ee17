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
  that lasts keeps justifying them; the arrivals it brings also raise the base. Each waiting job counts against
  its own deadline (`burst_for_ages`, its age read off the arrival samples by `waiting_ages`), and the last
  machine is held to its share unless the recent arrivals (`recent_load`) would keep one more busy.
- `keep_machines`: how many machines that base keeps busy enough to beat overflow's price, a job waiting up to
  `after` before it overflows (`overflowed`: the delay model; Erlang's loss formula when nothing waits).
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


def recent_load(samples: Sequence[Sample], now: float, run_s: float, span: float) -> float:
    """The offered load (machines' worth) of the last `span`, or of what the samples cover of it: its arrivals x
    the mean run time / its length. Nothing covered yet (a new queue, a new leader's first look): unbounded."""
    start = max(now - span, samples[0][0]) if samples else now
    if now - start <= 0 or run_s <= 0:
        return math.inf
    return (samples[-1][1] - _enqueued_by(samples, start)) * run_s / (now - start)


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


@dataclass(frozen=True)
class BurstCost:
    """What a machine rented for a burst bills besides its work, and what it must beat."""

    boot: float  # seconds before it serves (the measured boot)
    keep_busy: float  # the rented price over overflow's
    tail: float  # seconds it bills idle once the burst is done (how long scale-in keeps it)
    lasting: bool = True  # the arrivals would keep one more machine busy (`machines_for`)


def burst_machines(pending: int, capacity: float, rate: float, after: float, cost: BurstCost) -> int:
    """Machines to rent for the `pending` jobs beyond `capacity` (what the fleet starts within `after`): each
    new one starts (after - boot) x rate of them, and is rented only when that work on it costs less than on
    overflow with its boot and its idle tail paid."""
    excess = pending - capacity
    if excess <= 0 or rate <= 0 or after <= cost.boot:
        return 0
    per_machine, overhead = (after - cost.boot) * rate / 60, cost.boot + cost.tail
    return machines_for(excess, per_machine, 60 / rate, cost.keep_busy, overhead, cost.lasting)


def waiting_ages(samples: Sequence[Sample], now: float, pending: int, oldest: float | None) -> list[tuple[float, int]]:
    """(age in seconds, jobs) for the `pending` waiting jobs, oldest first, read off the arrival samples: the
    queue is served oldest first, so what waits is the newest `pending` arrivals. Jobs counted first at a sample
    are taken to have arrived at it (up to a poll late: a new burst has all of `after`, as counted from now);
    none is older than the queue's `oldest` age."""
    groups: list[tuple[float, int]] = []
    left = pending
    for k in range(len(samples) - 1, 0, -1):
        if left <= 0:
            break
        (_, before), (at, total) = samples[k - 1], samples[k]
        if (take := min(left, total - before)) > 0:
            groups.append((now - at, take))
            left -= take
    if left > 0:
        groups.append((now - samples[0][0] if samples else 0.0, left))
    cap = math.inf if oldest is None else oldest
    return [(min(max(age, 0.0), cap), n) for age, n in reversed(groups)]


def burst_for_ages(
    ages: Sequence[tuple[float, int]],
    idle: int,
    serving: int,
    rate: float,
    booting: Sequence[float],
    after: float,
    cost: BurstCost,
) -> int:
    """`burst_machines` held to each waiting job's own deadline (its arrival + `after`, as the router holds it):
    for the first i jobs (oldest first), the machines that start those the fleet would not within the i-th one's
    time left; the most any deadline needs. A burst that has waited has less of `after` left than a new one."""
    need, count = 0, 0
    for age, n in ages:
        count += n
        left = after - age
        if left > cost.boot:
            have = capacity(idle, serving, rate, booting, left)
            need = max(need, burst_machines(count, have, rate, left, cost))
    return need


def pays(work_s: float, overhead_s: float, keep_busy: float) -> bool:
    """Whether a machine that works `work_s` and bills `overhead_s` besides (its boot, a wait for the work, its
    idle tail) costs less than that work on overflow: `keep_busy` is the rented price over the serverless one."""
    return work_s > 0 and work_s * (1 / keep_busy - 1) >= overhead_s


def machines_for(
    jobs: float, per_machine: float, run_s: float, keep_busy: float, overhead_s: float, lasting: bool = True
) -> int:
    """Machines for `jobs` when one that starts `per_machine` of them in time, billing `overhead_s` besides its
    work, pays for itself: enough to start them all. While the arrivals would keep one more machine busy
    (`lasting`: a diurnal rise, a burst still landing) the last is not held to its share: it is busy after;
    else it is rented only if its share pays (a lone job of a trickle does not pay for a boot)."""
    if jobs <= 0 or per_machine <= 0 or not pays(per_machine * run_s, overhead_s, keep_busy):
        return 0
    n = math.ceil(jobs / per_machine - 1e-9)
    if not lasting and not pays((jobs - (n - 1) * per_machine) * run_s, overhead_s, keep_busy):
        n -= 1
    return n


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


def overflowed(n: int, load: float, patience: float) -> float:
    """The share of jobs that go to overflow from `n` machines under an offered `load` (machines' worth of work),
    a job going when it would wait longer than `patience` (in run times: `after` / the mean run time).

    The delay model: Poisson arrivals, exponential runs, n machines, and a job that would wait past `patience`
    leaves as it arrives (the router sends it on at once). With p_k (k < n busy) ~ A^k / k!, the wait of an
    arrival that finds all n busy has density A q e^-(n - A)v (q = A^(n-1) / (n-1)!, v in run times) up to the
    patience and a tail of A q e^-(n - A)p / n beyond it, so the share is that tail over the whole:
        E / n / (1 / (A B(n-1)) + (1 - E) / (n - A) + E / n),  E = e^-(n - A)p,  B Erlang's loss formula.
    Patience 0 is Erlang's loss formula B(n); a long one is Erlang C's tail, 0 for n > A and 1 - n / A below."""
    if n <= 0:
        return 1.0
    if load <= 0:
        return 0.0
    b = 1.0  # Erlang B(n - 1), by the recursion B(k) = A B(k-1) / (k + A B(k-1))
    for k in range(1, n):
        b = load * b / (k + load * b)
    x = (n - load) * max(patience, 0.0)
    head = 1 / (load * b)
    if x >= 0:  # E <= 1: as written
        e = math.exp(-x)
        mid = -math.expm1(-x) / (n - load) if abs(n - load) > 1e-12 else max(patience, 0.0)
        return e / n / (head + mid + e / n)
    r = math.exp(x)  # E > 1: divide through by E (r = 1 / E), so a long patience does not overflow the float
    return (1 / n) / (head * r + (r - 1) / (n - load) + 1 / n)


def keep_machines(load: float, busy: float, limit: int, patience: float = 0.0) -> int:
    """How many machines to keep for an offered `load` (machines' worth of work) whose jobs overflow when they
    would wait longer than `patience` run times: the n-th is kept while it would be busy at least `busy` of the
    time. Its share is the work it takes from overflow, load x (O(n-1) - O(n)), O `overflowed` (the delay model;
    at patience 0 Erlang's loss formula, where a job that finds every machine busy goes elsewhere)."""
    n, lost = 0, 1.0
    while n < limit and load > 0:
        nxt = overflowed(n + 1, load, patience)
        if load * (lost - nxt) < busy:
            break
        n, lost = n + 1, nxt
    return n


def size(base: float, buckets: int, burst: int, active: int, limit: int, cfg: Overflow, run_s: float) -> Sizing:
    """The fleet's count: the base's machines (a job waits up to `after`, `run_s` a run) and the burst's."""
    keep = keep_machines(base, cfg.keep_busy, limit, cfg.after / run_s if run_s > 0 else 0.0)
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
