"""`python -m bench.cost [--small] [--trace FILE] [--only NAME] [--out DIR] [--plots]`: what a GPU-hour buys.

Plays each trace through the real autoscaler and queue store on a simulated clock (bench/cost/world.py) under
each policy (the guide's triggers and the `jobs_per_worker` ramp, at max_workers 8 and 16), beside the clairvoyant
bound (bench/cost/bound.py). Writes cost.json, cost.md (and with --plots a PNG a trace) to --out (default: a
temporary directory), and prints the JSON as its last line. A private Valkey (bench/processes.py) is started and
stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cost import sweep
from bench.cost.bound import cheapest, clairvoyant
from bench.cost.hybrid import HybridWorld, Prices
from bench.cost.plots import plots
from bench.cost.report import bounded, markdown, measured
from bench.cost.traces import SHIPPED, Trace, from_csv
from bench.cost.world import CostWorld, Hosts, Policy
from bench.processes import Processes, start_valkey
from offload.connection import connect

MAX_WORKERS = (8, 16)
RAMP = 25  # jobs per worker: a 200-job burst asks for 8 machines
LIMIT = 9 * 24 * 3600.0  # simulated seconds a run may take: the longest trace and its drain


def policies(poll: float, idle: float) -> list[Policy]:
    out = []
    for n in MAX_WORKERS:
        out.append(Policy(f"guide triggers, max {n}", n, idle_timeout=idle, poll=poll))
        out.append(Policy(f"ramp ({RAMP} jobs/worker), max {n}", n, RAMP, idle_timeout=idle, poll=poll))
        out.append(Policy(f"ramp, scale-in by cost, max {n}", n, RAMP, idle_timeout=idle, poll=poll, by_cost=True))
    return out


async def world(url: str, trace: Trace, policy: Policy, hosts: Hosts, seed: int) -> dict[str, Any]:
    r: Any = await connect(url)  # the concrete client: FLUSHDB is no part of the store's protocol
    try:
        await r.flushdb()
        served = await CostWorld(r, trace.jobs, policy, hosts, seed).run(LIMIT)
    finally:
        await r.aclose()
    return measured(trace, served)


async def play_hybrid(url: str, trace: Trace, policy: Policy, prices: Prices, seed: int) -> dict[str, Any]:
    r: Any = await connect(url)
    try:
        await r.flushdb()
        served = await HybridWorld(r, trace.jobs, policy, trace.hosts, prices, seed).run(LIMIT)
    finally:
        await r.aclose()
    return sweep.hybrid_measured(trace, policy, served, prices)


async def play(url: str, trace: Trace, policy: Policy, seed: int) -> dict[str, Any]:
    got = await world(url, trace, policy, trace.hosts, seed)
    peak = got["wait_min"]["max"] * 60 + 3  # the report rounds waits to a tenth of a minute (6 s)
    bound = bounded(trace, cheapest(trace.jobs, trace.hosts.boot[0], policy.max_workers, peak))
    run = {"policy": policy.name, "max_workers": policy.max_workers, **got, "bound": bound}
    if faulty(trace.hosts):  # the same arrivals on hosts that all boot and stay: what the faults cost
        healthy = await world(url, trace, policy, Hosts(boot=trace.hosts.boot, price=trace.hosts.price), seed)
        run["healthy"] = healthy
        run["peak_wait_vs_healthy"] = round(got["wait_min"]["max"] / max(healthy["wait_min"]["max"], 0.1), 2)
    return run


def faulty(hosts: Hosts) -> bool:
    return bool(hosts.p_never_boot or hosts.p_preempt)


async def measure(
    url: str,
    traces: list[Trace],
    poll: float,
    idle: float,
    seed: int,
    prices: Prices,
    small: bool,
    grid: sweep.Grid = sweep.Grid(),
) -> list[dict[str, Any]]:
    out = []
    for trace in traces:
        t0 = time.monotonic()
        runs = [await play(url, trace, p, seed) for p in policies(poll, idle)] if grid.fleet else []
        settings = sweep.hybrid_policies(poll, idle, small, grid, trace.run_time)
        hybrid = [await play_hybrid(url, trace, p, prices, seed) for p in settings]
        targets = sweep.choose(trace, sweep.fleet_rows(runs, prices), hybrid, prices, seed, grid.targets)
        bounds = {n: bounded(trace, clairvoyant(trace.jobs, trace.hosts.boot[0], n)) for n in MAX_WORKERS}
        boot = f"{trace.hosts.boot[0] / 60:g}-{trace.hosts.boot[1] / 60:g} min"
        if faulty(trace.hosts):
            boot += f", {trace.hosts.p_never_boot:.0%} never boot, {trace.hosts.p_preempt:.0%} pre-empted"
        out.append(
            {
                "name": trace.name,
                "about": trace.about,
                "boot": boot,
                "runs": runs,
                "bounds": bounds,
                "hybrid_runs": hybrid,
                "sweep": targets,
                "verdicts": sweep.verdicts(targets),
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
        print(f"{trace.name}: {out[-1]['seconds']} s", file=sys.stderr)
    return out


def grid(args: argparse.Namespace) -> sweep.Grid:
    afters = tuple(args.after) if args.after else None
    return sweep.Grid(tuple(args.targets), afters, tuple(args.quantiles), args.predict, not args.no_fleet)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="small traces (CI: well under a minute)")
    p.add_argument("--trace", type=Path, help="your own CSV: arrival seconds, run seconds (one job a row)")
    p.add_argument("--only", action="append", choices=sorted(SHIPPED), help="only this shipped trace (repeatable)")
    p.add_argument("--out", type=Path, help="where cost.json and cost.md go (default: a temporary directory)")
    p.add_argument("--poll", type=float, default=30.0, help="the policies' poll interval, seconds")
    p.add_argument("--idle", type=float, default=600.0, help="the policies' idle timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rented", type=float, default=1.0, help="a rented GPU, $ per hour")
    p.add_argument("--serverless", type=float, default=2.5, help="the same GPU serverless, $ per hour (per second)")
    p.add_argument("--cold", type=float, nargs=2, default=(5.0, 20.0), help="serverless cold start, s (min max)")
    p.add_argument("--boot", type=float, nargs=2, default=(2.0, 4.0), help="a rented machine's boot, min (min max)")
    p.add_argument("--quantiles", type=float, nargs="+", default=sweep.QUANTILES, help="the hybrid's base quantiles")
    p.add_argument("--targets", type=float, nargs="+", default=sweep.TARGETS, help="the p95 targets swept, min")
    p.add_argument(
        "--after", type=float, nargs="+", help="the hybrid's `after` values, min (default: 1 and 1.5 x each target)"
    )
    p.add_argument(
        "--predict",
        metavar="PERIOD",
        help="also play each hybrid setting with this pre-rent period (`overflow.predict`), e.g. 1h",
    )
    p.add_argument("--no-fleet", action="store_true", help="play the hybrid only (no fleet-only column)")
    p.add_argument("--plots", action="store_true", help="also a PNG a trace in --out (needs matplotlib)")
    args = p.parse_args()
    if args.trace:
        traces = [from_csv(args.trace)]
    else:
        traces = [make(args.small) for name, make in SHIPPED.items() if not args.only or name in args.only]
    prices = Prices(args.rented, args.serverless, (args.cold[0], args.cold[1]))
    boot = (args.boot[0] * 60, args.boot[1] * 60)
    traces = [dataclasses.replace(t, hosts=dataclasses.replace(t.hosts, price=args.rented, boot=boot)) for t in traces]
    out = args.out or Path(tempfile.mkdtemp(prefix="offload-bench-cost-"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        procs = Processes(Path(workdir))
        try:
            url = start_valkey(procs)
            measured_traces = asyncio.run(
                measure(url, traces, args.poll, args.idle, args.seed, prices, args.small, grid(args))
            )
        finally:
            procs.stop_all()
    doc = {
        "size": "small" if args.small else "full",
        "price": traces[0].hosts.price,
        "prices": dataclasses.asdict(prices),
        "poll": args.poll,
        "idle_timeout": args.idle,
        "traces": measured_traces,
    }
    (out / "cost.json").write_text(json.dumps(doc, indent=1))
    (out / "cost.md").write_text(markdown(doc))
    if args.plots:
        doc["plots"] = plots(doc, out)
    print(markdown(doc), file=sys.stderr)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
