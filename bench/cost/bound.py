"""The clairvoyant bound: what a fleet that knows every arrival in advance would rent, at the same max_workers.

`clairvoyant(jobs, boot, k, defer)` plays a fleet of at most k machines. Each job goes, in arrival order, to
1. a machine already running jobs that frees within the job's allowance (arrival + `defer`): it queues there and
   costs nothing but its run;
2. else the idle machine that freed last, if it freed less than a boot ago: kept through the gap (paying the gap);
3. else a machine rented a boot-time ahead so that it starts at arrival + `defer` (paying a boot; a machine idle
   for longer than a boot is released when its last job ends and counts as one of these);
4. else, all k machines busy past the allowance, the machine that frees first (the job waits longer).
With `defer` 0 this is the least-waiting fleet: every job starts on arrival while k allows. With a `defer`,
jobs arriving while a fresh machine boots queue behind it, which is how a fleet buys fewer boots with waiting.

Why it bounds the policies' bill: every fleet pays each job's run time once and, for each stretch between two
jobs on one machine, at least min(gap, boot): keeping the machine costs the gap, releasing it costs a boot to
rent again. This fleet pays exactly that, with the shortest boot the hosts take (the most favourable) and no
machine that never boots. `cheapest` then takes, over every fleet size up to max_workers and the deferrals up to
the policy's own peak wait, the cheapest fleet whose longest wait is no longer than the policy's: a policy
cannot claim to beat it by making jobs wait longer. It is greedy, not a proof over every schedule; the report
test checks that no policy rents fewer GPU-hours than it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Bound:
    gpu_h: float
    boot_gpu_h: float
    rentals: int
    waits: list[float] = field(default_factory=list)  # seconds, per job
    machines: int = 0  # the fleet's size


def clairvoyant(jobs: list[tuple[float, float]], boot: float, max_workers: int, defer: float = 0.0) -> Bound:
    """`jobs`: (arrival s, run s) sorted by arrival; `boot`: seconds from rent to serving."""
    frees = [0.0] * max_workers  # when each machine's last job ends
    used = [False] * max_workers
    paid = boots = 0.0
    rentals = 0
    waits: list[float] = []
    for arrival, run in jobs:
        allowed = arrival + defer
        busy = [(frees[m], m) for m in range(max_workers) if used[m] and arrival < frees[m] <= allowed]
        idle = [(frees[m], m) for m in range(max_workers) if used[m] and frees[m] <= arrival]
        if busy:
            start, m = min(busy)
        elif idle and arrival - max(idle)[0] <= boot:
            freed, m = max(idle)
            start, paid = arrival, paid + arrival - freed
        elif idle or not all(used):
            m = max(idle)[1] if idle else used.index(False)
            used[m] = True
            start, paid, boots, rentals = allowed, paid + boot, boots + boot, rentals + 1
        else:
            start, m = min((frees[m], m) for m in range(max_workers))
        paid += run
        waits.append(start - arrival)
        frees[m] = start + run
    return Bound(gpu_h=paid / 3600, boot_gpu_h=boots / 3600, rentals=rentals, waits=waits, machines=sum(used))


def cheapest(jobs: list[tuple[float, float]], boot: float, max_workers: int, peak_wait: float) -> Bound:
    """The cheapest clairvoyant fleet of at most `max_workers` machines whose longest wait is at most `peak_wait`
    seconds (the least-waiting fleet at max_workers if none waits so little)."""
    steps = 8
    fleets = [
        clairvoyant(jobs, boot, k, peak_wait * i / steps) for k in range(1, max_workers + 1) for i in range(steps + 1)
    ]
    fits = [b for b in fleets if max(b.waits, default=0.0) <= peak_wait]
    return min(fits, key=lambda b: b.gpu_h) if fits else clairvoyant(jobs, boot, max_workers)
