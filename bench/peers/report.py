"""What one run of the peer benchmark found (the dict run.py builds), as the headline and the tables of
docs/benchmarks.md; the page itself is assembled in page.py, its plots drawn in plots.py."""

from __future__ import annotations

import statistics
from typing import Any

from bench.peers.systems import LABELS, OFFLOAD_WEBHOOKS

WORKLOAD_TITLES = {"noop": "no-op jobs/s", "io": "50 ms I/O jobs/s"}
X = "\u00d7"  # multiplication sign
DASH = "\u2013"  # en dash, for ranges
DAGGER = "\u2020"


def label(name: str) -> str:
    return LABELS.get(name, name)


def rate_stats(results: dict[str, Any], workload: str) -> dict[str, dict[str, Any]]:
    """Per system: median, min, max of jobs/s over the repetitions, and whether any run hit the cap."""
    out: dict[str, dict[str, Any]] = {}
    for run in results["runs"]:
        if run["workload"] != workload:
            continue
        row = out.setdefault(
            run["system"],
            {"rates": [], "capped": False, "errors": [], "enqueue": [], "cpu": [], "rss": [], "peak": [], "valkey": []},
        )
        if run["error"]:
            row["errors"].append(run["error"])
            continue
        row["rates"].append(run["jobs_per_s"])
        row["capped"] = row["capped"] or run["capped"]
        row["peak"].append(run["peak_in_flight"])
        if run["enqueue_s"] is not None:
            row["enqueue"].append(run["enqueue_s"])
        if run["worker_cpu_s"] is not None:
            row["cpu"].append(run["worker_cpu_s"] / max(run["seconds"], 1e-9))
        if run["worker_rss_mb"] is not None:
            row["rss"].append(run["worker_rss_mb"])
        if run.get("valkey_cpu_us_per_job") is not None:
            row["valkey"].append(run["valkey_cpu_us_per_job"])
    for row in out.values():
        rates = row["rates"]
        row["median"] = statistics.median(rates) if rates else None
        row["min"] = min(rates) if rates else None
        row["max"] = max(rates) if rates else None
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _int(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _num(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _ratio(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "n/a"
    r = x / base
    return f"{r:.2f}{X}" if r < 10 else f"{r:.0f}{X}"


def _rate_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "not run"
    if row["median"] is None:
        return "failed"
    mark = f" {DAGGER}" if row["capped"] else ""
    if row["min"] == row["max"]:
        return f"{_num(row['median'])}{mark}"
    return f"{_num(row['median'])} ({_num(row['min'])}{DASH}{_num(row['max'])}){mark}"


def gpu_runs(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for run in results["runs"]:
        if run["workload"] == "gpu":
            out.setdefault(run["system"], []).append(run)
    return out


def _peak_cell(runs: list[dict[str, Any]] | None) -> str:
    if not runs:
        return "not run"
    ok = [r for r in runs if not r["error"]]
    if not ok:
        return "failed"
    peaks = sorted(r["peak_in_flight"] for r in ok)
    med = statistics.median(peaks)
    return f"{med:,.0f}" if peaks[0] == peaks[-1] else f"{med:,.0f} ({peaks[0]:,}{DASH}{peaks[-1]:,})"


def _done_cell(runs: list[dict[str, Any]] | None) -> str:
    """When the last of (c)'s jobs was done (the median over the repetitions), or why there is no figure."""
    if not runs:
        return "—"
    ok = [r for r in runs if not r["error"]]
    if not ok:
        return "failed"
    if any(r["capped"] for r in ok):
        return f"not within {max(r['seconds'] for r in ok):.0f} s"
    return f"{statistics.median(r['seconds'] for r in ok):.1f} s"


def _gpu_done(gpu: dict[str, list[dict[str, Any]]], name: str) -> str:
    """offload's cell carries the run with webhooks on beside the polling one."""
    cell = _done_cell(gpu.get(name))
    if name == "offload" and OFFLOAD_WEBHOOKS in gpu:
        cell += f" (webhooks: {_done_cell(gpu[OFFLOAD_WEBHOOKS])})"
    return cell


def with_variants(systems: list[str]) -> list[str]:
    """The systems, with offload's webhook run of (c) right after offload."""
    return [v for name in systems for v in ((name, OFFLOAD_WEBHOOKS) if name == "offload" else (name,))]


def crash_time(c: dict[str, Any]) -> str:
    if c["error"]:
        return "failed"
    if c["all_done_s"] is None:
        return f"not within {c['cap']:g} s"
    return f"{c['all_done_s']:.1f} s"


def headline(results: dict[str, Any]) -> list[str]:
    systems = results["systems"]
    noop, io = rate_stats(results, "noop"), rate_stats(results, "io")
    gpu = gpu_runs(results)
    crashes = {c["system"]: c for c in results["crashes"]}
    base_noop = (noop.get("offload") or {}).get("median")
    base_io = (io.get("offload") or {}).get("median")
    lines = [
        f"| system | no-op jobs/s | {X} offload | 50 ms I/O jobs/s | {X} offload | peak in flight, 30 s jobs "
        "| 30 s jobs all done after | SIGKILL: lost | re-run | duplicated | all done after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in systems:
        n, i = noop.get(name), io.get(name)
        c = crashes.get(name)
        crash = (
            "| " + " | ".join([str(c["lost"]), str(c["rerun"]), str(c["duplicated"]), crash_time(c)])
            if c and not c["error"]
            else "| " + " | ".join(["failed" if c else "—"] * 3 + [crash_time(c) if c else "—"])
        )
        lines.append(
            f"| {label(name)} | {_rate_cell(n)} | {_ratio((n or {}).get('median'), base_noop)} "
            f"| {_rate_cell(i)} | {_ratio((i or {}).get('median'), base_io)} | "
            f"{_peak_cell(gpu.get(name)) if name in gpu else '—'} | {_gpu_done(gpu, name)} {crash} |"
        )
    return lines


def throughput_table(results: dict[str, Any], workload: str) -> list[str]:
    stats = rate_stats(results, workload)
    base = (stats.get("offload") or {}).get("median")
    lines = [
        f"| system | jobs/s median | min | max | runs | {X} offload | enqueue s | worker CPU cores "
        "| worker peak RSS MB | Valkey CPU µs per job | peak in flight |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in results["systems"]:
        row = stats.get(name)
        if row is None:
            continue
        cap = f" {DAGGER}" if row["capped"] else ""
        errors = f" ({len(row['errors'])} failed)" if row["errors"] else ""
        lines.append(
            f"| {label(name)} | {_num(row['median'])}{cap} | {_num(row['min'])} | {_num(row['max'])} "
            f"| {len(row['rates'])}{errors} | {_ratio(row['median'], base)} | {_num(_median(row['enqueue']))} "
            f"| {_num(_median(row['cpu']))} | {_num(_median(row['rss']))} | {_num(_median(row['valkey']))} "
            f"| {_int(_median(row['peak']))} |"
        )
    return lines


def gpu_notes(results: dict[str, Any]) -> list[str]:
    """What the data says about offload's (c) run beyond the table, if anything."""
    notes: list[str] = []
    gpu = gpu_runs(results)
    for r in gpu.get("offload", []) + gpu.get(OFFLOAD_WEBHOOKS, []):
        lost = sum(n for line, n in r.get("log_problems", []) if "lease of" in line and "lost" in line)
        if lost:
            notes.append(
                f"offload's worker logged {lost:,} lost leases in this run: while it submitted, its event "
                "loop fell behind its heartbeat (a lease lasts "
                f"{results['params'].get('offload_lease_ms', 10_000) / 1000:g} s), so its jobs went back "
                "to the queue with their remote ids and were claimed again; a dip of the offload line in "
                "the plot is that moment."
            )
        if r["capped"] and not r["error"]:
            notes.append(
                f"offload finished {r['done']:,} of {r['n']:,} jobs within the {r['seconds']:.0f} s cap; its "
                f"worker used {_num(r['worker_cpu_s'])} CPU seconds in that time (the simulator "
                f"{_num(r.get('sim_cpu_s'))}), on a machine whose load average was "
                f"{results['machine']['load_before']} when the run began."
            )
    return notes


def gpu_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| system | concurrency setting | peak in flight | done | all done after | worker CPU s | "
        "worker peak RSS MB | simulator CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in gpu_runs(results).items():
        for r in runs:
            if r["error"]:
                lines.append(
                    f"| {label(name)} | {r['concurrency']:,} | failed: {r['error'].splitlines()[0][:80]} | | | | | |"
                )
                continue
            after = f"not within {r['seconds']:.0f} s" if r["capped"] else f"{r['seconds']:.1f} s"
            claimed = f" ({r['peak_claimed']:,} claimed)" if r.get("peak_claimed") is not None else ""
            lines.append(
                f"| {label(name)} | {r['concurrency']:,} | {r['peak_in_flight']:,}{claimed} | {r['done']:,} "
                f"of {r['n']:,} | {after} | {_num(r['worker_cpu_s'])} | {_num(r['worker_rss_mb'])} "
                f"| {_num(r.get('sim_cpu_s'))} |"
            )
    return lines


def crash_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| system | in flight at the kill | done before it | lost | re-run | duplicated | unfinished at the cap "
        "| every job done after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in results["crashes"]:
        if c["error"]:
            lines.append(f"| {label(c['system'])} | failed: {c['error'].splitlines()[0][:80]} | | | | | | |")
            continue
        lines.append(
            f"| {label(c['system'])} | {c['in_flight_at_kill']} | {c['done_at_kill']} | {c['lost']} "
            f"| {c['rerun']} | {c['duplicated']} | {c['unfinished']} | {crash_time(c)} |"
        )
    return lines


def log_table(results: dict[str, Any]) -> list[str]:
    """Warnings and errors the workers logged, summed per system and workload."""
    found: dict[tuple[str, str], dict[str, int]] = {}
    for run in results["runs"]:
        for line, n in run.get("log_problems", []):
            row = found.setdefault((run["system"], run["workload"]), {})
            row[line] = row.get(line, 0) + n
    for c in results["crashes"]:
        for line, n in c.get("log_problems", []):
            row = found.setdefault((c["system"], "SIGKILL"), {})
            row[line] = row.get(line, 0) + n
    if not found:
        return ["No worker logged a warning or an error."]
    lines = ["| system | workload | lines | the line (numbers and ids masked as #) |", "|---|---|---:|---|"]
    for (system, workload), rows in found.items():
        for line, n in sorted(rows.items(), key=lambda kv: -kv[1])[:3]:
            text = line.replace("|", "\\|").replace("`", "'")
            lines.append(f"| {label(system)} | {workload} | {n} | `{text}` |")
    return lines
