"""The shipped traces, generated from a fixed seed, and a user's own from CSV (arrival seconds, run seconds).

Each trace is jobs as (arrival s after the start, run s), sorted by arrival, plus how its hosts behave. `small`
scales a trace down (fewer bursts or hours, fewer jobs) so CI runs it in well under a minute.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from bench.cost.world import Hosts

HOUR = 3600.0
DAY = 24 * HOUR


@dataclass(frozen=True)
class Trace:
    name: str
    about: str
    jobs: list[tuple[float, float]]
    hosts: Hosts = field(default_factory=Hosts)
    run_time: float | None = None  # the nominal job length a user would state (`overflow.run_time`): the middle
    # of the run times the trace is defined with, never measured from its jobs; a CSV trace has none


def burst_day(small: bool = False) -> Trace:
    """24 bursts of 200 jobs x 60 s, one an hour (80 GPU-h of work); boot 2-4 min."""
    bursts, size = (2, 30) if small else (24, 200)
    jobs = [(h * HOUR, 60.0) for h in range(bursts) for _ in range(size)]
    return Trace("burst-day", f"{bursts} hourly bursts of {size} jobs x 60 s", jobs, run_time=60.0)


def diurnal(small: bool = False, seed: int = 1) -> Trace:
    """A day whose arrival rate follows the sun: near zero at 04:00, ~4 jobs a minute at 16:00; jobs 30-150 s."""
    rng = random.Random(seed)
    hours = 3 if small else 24
    peak = 1.0 if small else 4.0  # jobs per minute
    jobs, t = [], 0.0
    while True:
        rate = peak * (0.05 + 0.95 * (1 - math.cos(2 * math.pi * ((t / HOUR + (12 if small else 0)) - 4) / 24)) / 2)
        t += rng.expovariate(rate / 60)
        if t >= hours * HOUR:
            break
        jobs.append((t, rng.uniform(30, 150)))
    about = f"{hours} h of Poisson arrivals peaking at {peak:g} jobs/min, jobs 30-150 s"
    return Trace("diurnal", about, jobs, run_time=90.0)


def quiet_night_spike(small: bool = False, seed: int = 2) -> Trace:
    """A trickle (one job every ~20 min) through a night, and one spike of 300 jobs x 90 s at 03:00."""
    rng = random.Random(seed)
    hours, spike, at = (1.5, 40, 0.75) if small else (8.0, 300, 3.0)
    jobs, t = [], 0.0
    while (t := t + rng.expovariate(1 / 1200)) < hours * HOUR:
        jobs.append((t, rng.uniform(30, 120)))
    jobs += [(at * HOUR + rng.uniform(0, 60), 90.0) for _ in range(spike)]
    about = f"a trickle over {hours:g} h and a spike of {spike} jobs x 90 s"
    return Trace("night-spike", about, sorted(jobs), run_time=75.0)  # jobs of 30-120 s


def faulty_week(small: bool = False, seed: int = 3) -> Trace:
    """A week of working-hours bursts (9-17 h, 40 jobs x 2-6 min every hour on weekdays) on hosts 15 % of which
    never boot, and a third of those that boot pre-empted within 4 h."""
    rng = random.Random(seed)
    days, size = (1, 12) if small else (7, 40)
    jobs = [
        (d * DAY + h * HOUR + rng.uniform(0, 300), rng.uniform(120, 360))
        for d in range(days)
        if d % 7 < 5
        for h in (range(9, 11) if small else range(9, 17))
        for _ in range(size)
    ]
    start = jobs[0][0] - HOUR if small else 0.0  # the small one skips the empty night before
    jobs = sorted((a - start, r) for a, r in jobs)
    hosts = Hosts(p_never_boot=0.15, p_preempt=0.33)
    about = f"{days} day(s) of working-hours bursts; 15 % of hosts never boot"
    return Trace("faulty-week", about, jobs, hosts, run_time=240.0)


def diurnal_spikes(small: bool = False, seed: int = 4) -> Trace:
    """The diurnal day (a base load that rises and falls with the sun) with bursts on top: 8 spikes of 80-150 jobs
    x 60-120 s, each arriving within two minutes, at random hours of the day (small: 3 h, 2 spikes of 30)."""
    base = diurnal(small, seed)
    rng = random.Random(seed + 100)
    hours, spikes, size = (3, 2, (30, 30)) if small else (24, 8, (80, 150))
    jobs = list(base.jobs)
    for _ in range(spikes):
        at = rng.uniform(0.5, hours - 1) * HOUR
        jobs += [(at + rng.uniform(0, 120), rng.uniform(60, 120)) for _ in range(rng.randint(*size))]
    about = f"{base.about.split(',')[0]}, and {spikes} spikes of {size[0]}-{size[1]} jobs x 60-120 s"
    return Trace("diurnal-spikes", about, sorted(jobs), run_time=90.0)  # jobs of 30-150 s


SHIPPED = {
    "burst-day": burst_day,
    "diurnal": diurnal,
    "night-spike": quiet_night_spike,
    "faulty-week": faulty_week,
    "diurnal-spikes": diurnal_spikes,
}


def from_csv(path: Path) -> Trace:
    """A user's trace: one job a row, `arrival seconds, run seconds` (a header row is skipped)."""
    jobs = []
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if not row or row[0].strip().startswith("#"):
                continue
            try:
                jobs.append((float(row[0]), float(row[1])))
            except ValueError:
                if jobs:
                    raise ValueError(f"{path}: not `arrival seconds, run seconds`: {row}") from None
    if not jobs:
        raise ValueError(f"{path}: no jobs")
    t0 = min(a for a, _ in jobs)
    return Trace(path.stem, f"{len(jobs)} jobs from {path.name}", sorted((a - t0, r) for a, r in jobs))
