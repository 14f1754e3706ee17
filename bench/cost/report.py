"""What one run cost and how long its jobs waited, and the markdown page of every run."""

from __future__ import annotations

from typing import Any

from bench.cost.bound import Bound
from bench.cost.traces import Trace
from bench.cost.world import START, Served


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def waits(values: list[float]) -> dict[str, float]:
    """Minutes, rounded to a tenth."""
    return {k: round(percentile(values, q) / 60, 1) for k, q in (("p50", 0.5), ("p95", 0.95), ("max", 1.0))}


def measured(trace: Trace, served: Served) -> dict[str, Any]:
    work = sum(run for _, run in trace.jobs) / 3600
    rented = boot = 0.0
    for r in served.rentals:
        gone = r.gone if r.gone is not None else served.end
        rented += gone - r.created
        boot += (min(r.boot_at, gone) if r.boot_at is not None else gone) - r.created
    rented /= 3600
    wait = [served.started[i] - START - a for i, (a, _) in enumerate(trace.jobs) if i in served.started]
    return {
        "gpu_h_rented": round(rented, 2),
        "gpu_h_work": round(work, 2),
        "utilisation": round(work / rented, 3) if rented else 0.0,
        "boot_gpu_h": round(boot / 3600, 2),
        "rentals": len(served.rentals),
        "never_served": sum(1 for r in served.rentals if r.jobs == 0),
        "wait_min": waits(wait),
        "usd_per_1000_jobs": round(rented * trace.hosts.price / len(trace.jobs) * 1000, 2),
        "jobs": len(trace.jobs),
        "jobs_served": len(served.started),
        "jobs_done": served.done,
    }


def bounded(trace: Trace, bound: Bound) -> dict[str, Any]:
    work = sum(run for _, run in trace.jobs) / 3600
    return {
        "gpu_h_rented": round(bound.gpu_h, 2),
        "gpu_h_work": round(work, 2),
        "utilisation": round(work / bound.gpu_h, 3),
        "boot_gpu_h": round(bound.boot_gpu_h, 2),
        "rentals": bound.rentals,
        "never_served": 0,
        "wait_min": waits(bound.waits),
        "usd_per_1000_jobs": round(bound.gpu_h * trace.hosts.price / len(trace.jobs) * 1000, 2),
        "jobs": len(trace.jobs),
        "jobs_served": len(trace.jobs),
        "jobs_done": len(trace.jobs),
        "machines": bound.machines,
    }


HEAD = (
    "| policy | GPU-h rented | GPU-h work | utilisation | boot GPU-h | rentals | never served "
    "| wait p50 / p95 / max (min) | $ / 1,000 jobs | bound at its peak wait: GPU-h, machines, utilisation |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def row(name: str, m: dict[str, Any]) -> str:
    w = m["wait_min"]
    return (
        f"| {name} | {m['gpu_h_rented']:.2f} | {m['gpu_h_work']:.2f} | {m['utilisation']:.0%} | "
        f"{m['boot_gpu_h']:.2f} | {m['rentals']} | {m['never_served']} | {w['p50']:g} / {w['p95']:g} / {w['max']:g} "
        f"| {m['usd_per_1000_jobs']:.2f} | {_bound(m.get('bound'))} |"
    )


def _bound(b: dict[str, Any] | None) -> str:
    if b is None:
        return ""
    return f"{b['gpu_h_rented']:.2f}, {b['machines']}, {b['utilisation']:.0%}"


def markdown(doc: dict[str, Any]) -> str:
    out = [
        f"Size: `{doc['size']}`, price ${doc['price']:g}/GPU-h, poll {doc['poll']:g} s, idle timeout "
        f"{doc['idle_timeout'] / 60:g} min.\n"
    ]
    for trace in doc["traces"]:
        out.append(f"### {trace['name']}\n\n{trace['about']}; boot {trace['boot']}.\n\n{HEAD}")
        out += [row(run["policy"], run) for run in trace["runs"]]
        out += [row(f"clairvoyant, max {n} (least wait)", b) for n, b in trace["bounds"].items()]
        out += _against_healthy(trace["runs"])
        out += sweep_table(trace)
        out.append("")
    return "\n".join(out)


def _against_healthy(runs: list[dict[str, Any]]) -> list[str]:
    """For a trace with faulty hosts: each policy's waits and rent beside the same arrivals on healthy hosts."""
    if not any("healthy" in run for run in runs):
        return []
    out = [
        "\nThe same arrivals on healthy hosts (every machine boots, none is pre-empted):\n",
        "| policy | peak wait, faulty / healthy (min) | ratio | GPU-h rented, faulty / healthy |",
        "|---|---|---|---|",
    ]
    for run in runs:
        h = run["healthy"]
        out.append(
            f"| {run['policy']} | {run['wait_min']['max']:g} / {h['wait_min']['max']:g} | "
            f"{run['peak_wait_vs_healthy']:g}x | {run['gpu_h_rented']:.2f} / {h['gpu_h_rented']:.2f} |"
        )
    return out


SWEEP_HEAD = (
    "| p95 target | serverless-only | fleet-only (best setting) | hybrid (best setting) | offline mix bound "
    "| hybrid / cheaper single kind | hybrid / bound |\n|---|---|---|---|---|---|---|"
)


def _cell(row: dict[str, Any] | None, named: bool = True) -> str:
    if row is None:
        return "none meets it"
    text = f"${row['cost']:.2f} (p95 {row['p95_min']:g} min)"
    return f"{text}: {row['policy']}" if named else text


def sweep_table(trace: dict[str, Any]) -> list[str]:
    """The policy sweep (bench/cost/sweep.py): each policy's cheapest setting meeting each p95 wait target."""
    if "sweep" not in trace:
        return []
    out = ["\nThe cheapest setting of each policy that meets each p95 wait target:\n", SWEEP_HEAD]
    for target, row in trace["sweep"].items():
        h = row["hybrid"]
        singles = [x["cost"] for x in (row["serverless"], row["fleet"]) if x is not None]
        vs_single = f"{h['cost'] / min(singles):.2f}" if h and singles else "-"
        vs_bound = f"{h['cost'] / row['bound']['cost']:.2f}" if h and row["bound"]["cost"] > 0 else "-"
        out.append(
            f"| {target} min | {_cell(row['serverless'], False)} | {_cell(row['fleet'])} | {_cell(h)} "
            f"| {_cell(row['bound'], False)}, {row['bound']['machines']} machines | {vs_single} | {vs_bound} |"
        )
    fails = [f"{t} min: {'; '.join(n)}" for t, n in trace.get("verdicts", {}).items() if n]
    out.append("\nTargets missed: " + (" · ".join(fails) if fails else "none") + ".")
    return out + parts_table(trace)


PARTS_HEAD = (
    "| p95 target | hybrid: boot / idle / serverless premium $ | bound: boot / idle / serverless premium $ "
    "| hybrid - bound: boot / idle / premium $ |\n|---|---|---|---|"
)


def parts_table(trace: dict[str, Any]) -> list[str]:
    """Where the hybrid's dollars go against the bound's (sweep.parts: cost = the trace's work at the rented
    price + boot + idle + serverless premium)."""
    out = ["\nWhere the dollars go beyond the work at the rented price (hybrid's best setting and the bound):\n"]
    out.append(PARTS_HEAD)
    keys = ("boot_usd", "idle_usd", "premium_usd")
    for target, row in trace["sweep"].items():
        h, b = row["hybrid"], row["bound"]
        if h is None or "boot_usd" not in h:
            continue
        diff = " / ".join(f"{h[k] - b[k]:+.2f}" for k in keys)
        out.append(
            f"| {target} min | {' / '.join(f'{h[k]:.2f}' for k in keys)} "
            f"| {' / '.join(f'{b[k]:.2f}' for k in keys)} | {diff} |"
        )
    return out
