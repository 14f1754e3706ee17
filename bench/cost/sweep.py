"""The policy sweep: for each trace and each p95 wait target, the cheapest setting of each policy that meets it.

- serverless-only (bench/cost/mix.py): every job on the serverless backend after its cold start;
- fleet-only: the cheapest of the fleet policies already played (bench/cost/__main__.py: the guide's triggers,
  the ramp, the ramp with scale-in by cost, at max_workers 8 and 16), at the rented price;
- hybrid (bench/cost/hybrid.py): the fleet with `overflow`, max_workers 16, swept over `after` and the base
  load's quantile; its cost is the fleet's rent plus the serverless bill;
- bound: the offline mix (mix.py's best_mix, at most 16 machines), the arrivals known.
A policy none of whose settings meets a target is reported as such (None), not stretched to meet it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bench.cost.hybrid import Prices, colds
from bench.cost.mix import Mix, best_mix, serverless_only
from bench.cost.report import percentile
from bench.cost.traces import Trace
from bench.cost.world import START, Policy, Served

TARGETS = (1, 5, 15, 30)  # p95 wait targets, minutes
SMALL_TARGETS = (1, 15)
HYBRID_MAX = 16
AFTER_SHARES = (1.0, 1.5)  # `after` as a share of each target: a p95 leaves room past `after` for 5 % of jobs
QUANTILES = (0.25, 0.5)


@dataclass(frozen=True)
class Grid:
    """What the sweep plays: the p95 targets, the hybrid's `after` values (minutes; None: AFTER_SHARES of each
    target), its base quantiles, an `overflow.predict.period` (each setting is then also played with it), and
    whether the fleet policies are played too (without them the fleet-only column is empty)."""

    targets: tuple[float, ...] = TARGETS
    afters: tuple[float, ...] | None = None
    quantiles: tuple[float, ...] = QUANTILES
    predict: str | None = None
    fleet: bool = True


def hybrid_policies(
    poll: float, idle: float, small: bool, grid: Grid = Grid(), run_time: float | None = None
) -> list[Policy]:
    """The hybrid's settings swept: `after` at each share of each target (or the grid's) x the base load's
    quantile (small: the first of each, at two targets, so CI stays within about a minute); `run_time` the prior
    (the trace's nominal job length, Trace.run_time), the same in every setting."""
    if grid.afters is not None:
        afters = sorted({round(a * 60) for a in grid.afters})
    else:
        targets = SMALL_TARGETS if small else grid.targets
        afters = [round(s * t * 60) for s in (AFTER_SHARES[:1] if small else AFTER_SHARES) for t in targets]
    out = []
    for period in [None] if grid.predict is None else [None, grid.predict]:
        for q in grid.quantiles[:1] if small else grid.quantiles:
            for after in afters:
                flow: dict[str, Any] = {"backends": ["serverless"], "after": f"{after}s", "quantile": q}
                if run_time is not None:
                    flow["run_time"] = f"{run_time:g}s"
                name = f"hybrid, after {after / 60:g} min, base q{q:g}"
                if period is not None:
                    flow["predict"] = {"period": period}
                    name += f", pre-rent {period}"
                out.append(Policy(name, HYBRID_MAX, idle_timeout=idle, poll=poll, by_cost=True, overflow=flow))
    return out


def hybrid_measured(trace: Trace, policy: Policy, served: Served, prices: Prices) -> dict[str, Any]:
    rented = sum(((r.gone or served.end) - r.created) for r in served.rentals) / 3600
    boot = sum((min(r.boot_at or math.inf, r.gone or served.end) - r.created) for r in served.rentals) / 3600
    wait = [served.started[i] - START - a for i, (a, _) in enumerate(trace.jobs) if i in served.started]
    kinds = [served.done_by.get(i, []) for i in range(len(trace.jobs))]
    on_fleet = sum(1 for k in kinds if k == ["fleet"])
    sls_work = sum(run for (_, run), k in zip(trace.jobs, kinds, strict=True) if k == ["serverless"]) / 3600
    fleet_work = sum(run for (_, run), k in zip(trace.jobs, kinds, strict=True) if "fleet" in k) / 3600
    return {
        "policy": policy.name,
        "overflow": policy.overflow,
        "cost": round(rented * prices.rented + served.serverless_s / 3600 * prices.serverless, 2),
        "fleet_gpu_h": round(rented, 2),
        "serverless_gpu_h": round(served.serverless_s / 3600, 2),
        "p95_min": round(percentile(wait, 0.95) / 60, 2),
        "max_min": round(max(wait, default=0.0) / 60, 2),
        "jobs": len(trace.jobs),
        "jobs_served": len(served.started),
        "done_once": sum(1 for k in kinds if len(k) == 1),
        "on_fleet": on_fleet,
        "on_serverless": sum(1 for k in kinds if k == ["serverless"]),
        "rentals": len(served.rentals),
        **parts(prices, boot, rented - boot - fleet_work, served.serverless_s / 3600, sls_work),
    }


def parts(prices: Prices, boot: float, idle: float, sls_billed: float, sls_work: float) -> dict[str, float]:
    """Where the dollars go beyond the trace's work at the rented price (GPU-h in, $ out): cost = work x rented
    + `boot` (the fleet's boots) + `idle` (its rent with no job: waits, gaps and tails) + `premium` (serverless's
    bill less its jobs' runs at the rented price). Two ways of serving a trace differ only in these three."""
    return {
        "boot_usd": round(boot * prices.rented, 2),
        "idle_usd": round(idle * prices.rented, 2),
        "premium_usd": round(sls_billed * prices.serverless - sls_work * prices.rented, 2),
    }


def summary(m: Mix, name: str, jobs: list[tuple[float, float]], prices: Prices) -> dict[str, Any]:
    sls_work = sum(run for (_, run), k in zip(jobs, m.kinds, strict=True) if k == "serverless") / 3600
    return {
        "policy": name,
        "cost": round(m.cost, 2),
        "fleet_gpu_h": round(m.fleet_gpu_h, 2),
        "serverless_gpu_h": round(m.serverless_gpu_h, 2),
        "p95_min": round(percentile(m.waits, 0.95) / 60, 2),
        "max_min": round(max(m.waits, default=0.0) / 60, 2),
        "on_fleet": m.kinds.count("fleet"),
        "on_serverless": m.kinds.count("serverless"),
        "machines": m.machines,
        **parts(prices, m.boot_h, m.idle_h, m.serverless_gpu_h, sls_work),
    }


def fleet_rows(runs: list[dict[str, Any]], prices: Prices) -> list[dict[str, Any]]:
    return [
        {
            "policy": r["policy"],
            "cost": round(r["gpu_h_rented"] * prices.rented, 2),
            "fleet_gpu_h": r["gpu_h_rented"],
            "p95_min": r["wait_min"]["p95"],
            "max_min": r["wait_min"]["max"],
        }
        for r in runs
    ]


def cheapest(rows: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    fits = [r for r in rows if r["p95_min"] <= target]
    return min(fits, key=lambda r: r["cost"]) if fits else None


def choose(
    trace: Trace,
    fleet: list[dict[str, Any]],
    hybrid: list[dict[str, Any]],
    prices: Prices,
    seed: int,
    targets: tuple[float, ...] = TARGETS,
) -> dict[str, Any]:
    sls = summary(
        serverless_only(trace.jobs, prices, colds(trace.jobs, prices, seed)), "serverless-only", trace.jobs, prices
    )
    out: dict[str, Any] = {}
    for target in targets:
        mix = best_mix(trace.jobs, trace.hosts.boot[0], HYBRID_MAX, target * 60, prices)
        bound = summary(mix, "offline mix", trace.jobs, prices)
        out[f"{target:g}"] = {
            "serverless": sls if sls["p95_min"] <= target else None,
            "fleet": cheapest(fleet, target),
            "hybrid": cheapest(hybrid, target),
            "bound": bound,
        }
    return out


def verdicts(targets: dict[str, Any]) -> dict[str, list[str]]:
    """The issue's targets, per wait target: which hold and which fail."""
    out: dict[str, list[str]] = {}
    for t, row in targets.items():
        h, s, f, b = row["hybrid"], row["serverless"], row["fleet"], row["bound"]
        notes = []
        if h is None:
            notes.append("no hybrid setting meets it")
        else:
            others = [x["cost"] for x in (s, f) if x is not None]
            if others and h["cost"] > min(others):
                notes.append(f"hybrid {h['cost']:.2f} > cheaper single kind {min(others):.2f}")
            if h["cost"] > 1.15 * b["cost"]:
                notes.append(f"hybrid {h['cost']:.2f} > 1.15 x bound {b['cost']:.2f}")
        out[t] = notes
    return out
