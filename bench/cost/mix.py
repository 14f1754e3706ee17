"""What serverless alone costs, and the offline bound for the mix of rented and serverless capacity.

`serverless_only`: every job starts after a cold start and is billed its cold start and run by the second; no
machine is rented. It meets any wait target above the cold start (20 s at most by default).

`mix_bound(jobs, boot, k, target, prices)`: the arrivals known in advance, a fleet of at most k machines and a
serverless backend. Each job goes, in arrival order, to
1. a fleet machine already running jobs that frees within the job's allowance (arrival + target): it queues there
   and costs its run at the rented price;
2. else the idle machine that freed last, if less than a boot ago: kept through the gap (paying the gap);
3. else a free slot of the k: a machine rented a boot-time ahead so that it serves on arrival (paying a boot);
4. else (all k busy past the allowance) serverless, at its price, after the shortest cold start; up to 5 % of
   the jobs may instead wait on the fleet past the target (the target is a p95), the first such come first.
Why it bounds the hybrid: a job on the fleet costs its run, plus for each stretch between two jobs on one
machine at least min(gap, boot) (keeping costs the gap, re-renting a boot), and this fleet pays exactly that,
with the shortest boot and no failed host; a job on serverless costs its run and cold start at the serverless
price, and this pays the shortest cold start. It never rents a machine after the work it serves has arrived (the
online hybrid must: it cannot rent for a burst it has not seen). `best_mix` takes the cheapest over k = 0
(serverless alone) .. max_workers. Like bound.py it is greedy, not a proof over every schedule: the report test
checks that no policy meeting the target costs less than it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.cost.hybrid import Prices

P95_SLACK = 0.05


@dataclass
class Mix:
    cost: float  # $
    fleet_gpu_h: float
    serverless_gpu_h: float
    machines: int
    waits: list[float] = field(default_factory=list)  # seconds, per job
    kinds: list[str] = field(default_factory=list)  # "fleet" | "serverless", per job
    boot_h: float = 0.0  # the fleet's GPU-h: boots...
    idle_h: float = 0.0  # ...and gaps kept between jobs (the rest is work)


def serverless_only(jobs: list[tuple[float, float]], prices: Prices, colds: list[float]) -> Mix:
    """`colds`: each job's cold start, seconds (drawn by the caller from prices.cold)."""
    billed = sum(run + c for (_, run), c in zip(jobs, colds, strict=True)) / 3600
    return Mix(billed * prices.serverless, 0.0, billed, 0, list(colds), ["serverless"] * len(jobs))


def mix_bound(jobs: list[tuple[float, float]], boot: float, k: int, target: float, prices: Prices) -> Mix:
    frees, used = [0.0] * k, [False] * k
    paid = sls = boots = gaps = 0.0
    late = max(0, len(jobs) - int((1 - P95_SLACK) * len(jobs)) - 1)  # report.percentile's p95 stays in target
    waits: list[float] = []
    kinds: list[str] = []
    for arrival, run in jobs:
        allowed = arrival + target
        busy = [(frees[m], m) for m in range(k) if used[m] and arrival < frees[m] <= allowed]
        idle = [(frees[m], m) for m in range(k) if used[m] and frees[m] <= arrival]
        m = -1
        if busy:
            start, m = min(busy)
        elif idle and arrival - max(idle)[0] <= boot:
            freed, m = max(idle)
            start, paid, gaps = arrival, paid + arrival - freed, gaps + arrival - freed
        elif idle or not all(used):
            m = max(idle)[1] if idle else used.index(False)
            used[m] = True
            start, paid, boots = arrival, paid + boot, boots + boot
        elif k and late > 0:
            start, m = min((frees[m], m) for m in range(k))
            late -= 1
        if m < 0:
            sls += prices.cold[0] + run
            waits.append(prices.cold[0])
            kinds.append("serverless")
            continue
        paid += run
        frees[m] = start + run
        waits.append(start - arrival)
        kinds.append("fleet")
    cost = paid / 3600 * prices.rented + sls / 3600 * prices.serverless
    return Mix(cost, paid / 3600, sls / 3600, sum(used), waits, kinds, boots / 3600, gaps / 3600)


def best_mix(jobs: list[tuple[float, float]], boot: float, max_workers: int, target: float, prices: Prices) -> Mix:
    return min((mix_bound(jobs, boot, k, target, prices) for k in range(max_workers + 1)), key=lambda m: m.cost)
