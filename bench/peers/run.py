"""offload beside Celery, RQ, arq, Dramatiq, taskiq and SAQ: the same workloads, the same machine, one run.

    python -m bench.peers [--quick] [--systems offload,celery,...] [--reps 3] [--out docs]

Installs each peer into its own venv under .bench-venvs/ (cached), starts one Valkey, then runs for every
system, alternating systems within each repetition: (a) no-op jobs and (b) jobs that wait 50 ms, enqueued and
processed by one worker process with 100 in flight; (c) 2,000 jobs of 30 s, counting how many one worker process
holds in flight; and a SIGKILL test (lost, re-run, duplicated jobs, time until every job is done). Writes
OUT/benchmarks.md, OUT/img/peers-*.png and OUT/benchmarks.json; the last line printed is a JSON summary.

--quick shrinks every size (300 jobs, 200 x 2 s, 60 x 3 s with a 20 s watch, one repetition) and writes to
bench/out/peers/ unless --out is given: a smoke run in under two minutes once the venvs exist.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench.peers` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from bench.peers import crash, harness, page, plots, report, sessions
from bench.peers.systems import (
    ALL,
    BY_NAME,
    OFFLOAD_WEBHOOKS,
    ROOT,
    System,
    base_interpreter,
    ensure_venv,
    installed_versions,
)
from offload.local.embedded import allocator


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    _sizes(args)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown systems: {', '.join(unknown)}")
    args.system_list = [BY_NAME[n] for n in names]
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = set(args.workload_list) - {"noop", "io", "gpu", "durability"}
    if bad:
        parser.error(f"unknown workloads: {', '.join(sorted(bad))}")
    if min(args.reps, args.noop_jobs, args.io_jobs, args.gpu_jobs, args.crash_jobs, args.concurrency) < 1:
        parser.error("sizes and repetitions must be >= 1")
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition (under 2 minutes)")
    parser.add_argument(
        "--systems",
        default=",".join(s.name for s in ALL),
        help=f"comma-separated, from: {', '.join(s.name for s in ALL)}",
    )
    parser.add_argument("--workloads", default="noop,io,gpu,durability", help="comma-separated subset")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of (a) and (b) (3; quick 1)")
    parser.add_argument("--concurrency", type=int, default=100, help="jobs in flight per worker process")
    parser.add_argument("--noop-jobs", type=int, default=None, help="(a) jobs per run (3000; quick 300)")
    parser.add_argument("--io-jobs", type=int, default=None, help="(b) jobs per run (3000; quick 300)")
    parser.add_argument("--cap", type=float, default=None, help="seconds before an (a)/(b) run is cut (12; quick 4)")
    parser.add_argument("--gpu-jobs", type=int, default=None, help="(c) jobs (2000; quick 200)")
    parser.add_argument("--gpu-seconds", type=float, default=None, help="(c) seconds per job (30; quick 2)")
    parser.add_argument("--gpu-reps", type=int, default=1, help="repetitions of (c)")
    parser.add_argument(
        "--no-offload-webhooks",
        dest="offload_webhooks",
        action="store_false",
        help="run offload's (c) only polling, not also with provider webhooks on",
    )
    parser.add_argument("--crash-jobs", type=int, default=None, help="SIGKILL test jobs (200; quick 60)")
    parser.add_argument("--crash-seconds", type=float, default=None, help="SIGKILL test seconds per job (5; quick 3)")
    parser.add_argument("--crash-cap", type=float, default=None, help="SIGKILL test watch, seconds (120; quick 20)")
    parser.add_argument(
        "--offload-lease-ms",
        type=int,
        default=None,
        help="offload worker's lease for (c) and the SIGKILL test (default: offload's, 10 s)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory (docs; quick bench/out/peers)")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="run nothing: rebuild the page and plots from a benchmarks.json an earlier run wrote",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs of every process)")
    return parser


def _sizes(args: argparse.Namespace) -> None:
    """Every size not given: the full run's, or with --quick the smoke run's."""
    q = args.quick

    def pick(value: Any, full: Any, quick: Any) -> Any:
        return value if value is not None else quick if q else full

    args.out_given = args.out is not None
    args.reps = pick(args.reps, 3, 1)
    args.noop_jobs = pick(args.noop_jobs, 3000, 300)
    args.io_jobs = pick(args.io_jobs, 3000, 300)
    args.cap = pick(args.cap, 12.0, 4.0)
    args.gpu_jobs = pick(args.gpu_jobs, 2000, 200)
    args.gpu_seconds = pick(args.gpu_seconds, 30.0, 2.0)
    args.crash_jobs = pick(args.crash_jobs, 200, 60)
    args.crash_seconds = pick(args.crash_seconds, 5.0, 3.0)
    args.crash_cap = pick(args.crash_cap, 120.0, 20.0)
    args.out = pick(args.out, ROOT / "docs", ROOT / "bench" / "out" / "peers")


def machine(valkey: str) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError, AttributeError):
        mem = 0
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gb": mem,
        "os": f"{platform.system()} {platform.release()}",
        # the interpreter every system's venv is made from (systems.ensure_venv): its build moves every figure
        "python": f"{platform.python_version()} ({os.path.realpath(base_interpreter())})",
        "valkey": valkey,
        "valkey_allocator": allocator(),  # what offload.local.embedded.server_env preloads (glibc's without jemalloc)
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def rotate(systems: list[System], k: int) -> list[System]:
    k %= max(len(systems), 1)
    return systems[k:] + systems[:k]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def write(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    images = plots.plots(results, out / "img")
    (out / "benchmarks.md").write_text(page.markdown(results, images, "img"))
    (out / "benchmarks.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {out / 'benchmarks.md'}, {len(images)} plots, {out / 'benchmarks.json'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.from_json is not None:
        loaded: dict[str, Any] = json.loads(args.from_json.read_text())
        write(loaded, args.out if args.out_given else args.from_json.parent)
        print(json.dumps(summarize(loaded)))
        return summarize(loaded)
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.time()
    systems: list[System] = args.system_list
    bench = harness.Bench(offload_lease_ms=args.offload_lease_ms)
    results: dict[str, Any] = {
        "command": "python -m bench.peers"
        + (" --quick" if args.quick else "")
        + ("" if len(systems) == len(ALL) else f" --systems {','.join(s.name for s in systems)}"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "systems": [s.name for s in systems],
        "runs": [],
        "crashes": [],
        "versions": {},
        "venv_install_s": {},
    }
    try:
        _prepare(args, bench, results)
        _run_throughput(args, bench, results)
        _run_gpu(args, bench, results)
        _run_crashes(args, bench, results)
    except KeyboardInterrupt:
        log("interrupted: stopping every process the bench started")
        raise SystemExit(130) from None
    finally:
        bench.close()
        if args.keep:
            log(f"work directory kept: {bench.workdir}")
        else:
            shutil.rmtree(bench.workdir, ignore_errors=True)

    results["wall_s"] = round(time.time() - started, 1)
    write(results, args.out)
    log(f"done in {results['wall_s']:.0f} s")
    summary = summarize(results)
    print("\n".join(report.headline(results)))
    print(json.dumps(summary))
    return summary


DB = {s.name: i + 1 for i, s in enumerate(ALL)}  # each system's own Valkey database


def _prepare(args: argparse.Namespace, bench: harness.Bench, results: dict[str, Any]) -> None:
    """Every system's venv (made once, reused while its pins stay the same), then Valkey; the machine and the
    parameters go into `results`."""
    for s in args.system_list:
        if s.requirements:
            spent = ensure_venv(s, bench.logs / f"venv-{s.name}.log")
            results["venv_install_s"][s.name] = round(spent, 1)
            if spent:
                log(f"installed {s.name}'s venv in {spent:.0f} s")
        results["versions"][s.name] = installed_versions(s)
    valkey = bench.start_valkey()
    results["machine"] = machine(valkey)
    results["params"] = {
        "quick": args.quick,
        "reps": args.reps,
        "concurrency": args.concurrency,
        "noop_jobs": args.noop_jobs,
        "io_jobs": args.io_jobs,
        "io_ceiling": args.concurrency / 0.05,
        "cap": args.cap,
        "gpu_jobs": args.gpu_jobs,
        "gpu_seconds": args.gpu_seconds,
        "gpu_reps": args.gpu_reps,
        "gpu_cap": _gpu_cap(args),
        "crash_jobs": args.crash_jobs,
        "crash_seconds": args.crash_seconds,
        "crash_cap": args.crash_cap,
        "kill_after": _kill_after(args),
        "offload_lease_ms": args.offload_lease_ms or 10_000,
    }
    log(f"valkey {valkey} on port {bench.port}; logs in {bench.logs}")


def _gpu_cap(args: argparse.Namespace) -> float:
    return float(args.gpu_seconds + max(5.0, args.gpu_seconds / 2))


def _kill_after(args: argparse.Namespace) -> float:
    return float(round(args.crash_seconds * 0.4, 2))


def _outcome(error: str | None, ok: str) -> str:
    return f"FAILED {error.splitlines()[0]}" if error else ok


def _run_throughput(args: argparse.Namespace, bench: harness.Bench, results: dict[str, Any]) -> None:
    """(a) and (b): every repetition runs each system in turn, starting with another system each time."""
    workloads = (("noop", args.noop_jobs, 0.0), ("io", args.io_jobs, 0.05))
    tp = [(w, n, s) for w, n, s in workloads if w in args.workload_list]
    if not tp:
        return
    for rep in range(args.reps):
        for s in rotate(args.system_list, rep):
            todo = [t for t in tp if t[0] in s.workloads]
            if not todo:
                continue
            for run in sessions.throughput_session(bench, s, DB[s.name], rep, todo, args.concurrency, args.cap):
                results["runs"].append(run.to_dict())
                ok = (
                    f"{run.jobs_per_s:8,.0f} jobs/s ({run.done}/{run.n} in {run.seconds:.2f} s"
                    f"{', capped' if run.capped else ''})"
                )
                log(f"rep {rep + 1}/{args.reps} {s.name:>13} {run.workload:>4}: " + _outcome(run.error, ok))


def _run_gpu(args: argparse.Namespace, bench: harness.Bench, results: dict[str, Any]) -> None:
    """(c): offload polling, then with provider webhooks on (offload_hooks.py); each peer once per repetition."""
    if "gpu" not in args.workload_list:
        return
    gpu_cap = _gpu_cap(args)
    for rep in range(args.gpu_reps):
        for s in rotate([s for s in args.system_list if "gpu" in s.workloads], rep):
            if s.name == "offload":
                gpu_runs = [
                    sessions.offload_gpu_session(
                        bench, DB[s.name], rep, args.gpu_jobs, args.gpu_seconds, args.gpu_jobs, gpu_cap,
                        webhooks=hooks,
                    )
                    for hooks in (False, *([True] if args.offload_webhooks else []))
                ]  # fmt: skip
            else:
                gpu_runs = [
                    sessions.gpu_session(
                        bench, s, DB[s.name], rep, args.gpu_jobs, args.gpu_seconds, args.gpu_jobs, gpu_cap
                    )
                ]
            for run in gpu_runs:
                results["runs"].append(run.to_dict())
                ok = f"peak in flight {run.peak_in_flight}, {run.done}/{run.n} done in {run.seconds:.1f} s"
                log(f"gpu {run.system:>16}: " + _outcome(run.error, ok))


def _run_crashes(args: argparse.Namespace, bench: harness.Bench, results: dict[str, Any]) -> None:
    """The SIGKILL test, every system at once."""
    if "durability" not in args.workload_list:
        return
    crash_systems = [s for s in args.system_list if "durability" in s.workloads]
    log(f"SIGKILL test: {', '.join(s.name for s in crash_systems)} at once, watching {args.crash_cap:g} s")
    kill_after = _kill_after(args)

    def run_crash(s: System) -> crash.Crash:
        c = crash.Crash(s.name, args.crash_jobs, args.crash_seconds, args.concurrency, args.crash_cap)
        if s.name == "offload":
            return crash.crash_offload(bench, DB[s.name], c, kill_after)
        return crash.crash_peer(bench, s, DB[s.name], c, kill_after)

    with ThreadPoolExecutor(max_workers=max(len(crash_systems), 1)) as pool:
        for c in pool.map(run_crash, crash_systems):
            results["crashes"].append(c.to_dict())
            ok = (
                f"{c.in_flight_at_kill} in flight, lost {c.lost}, re-run {c.rerun}, duplicated {c.duplicated}, "
                f"all done: {report.crash_time(c.to_dict())}"
            )
            log(f"SIGKILL {c.system:>13}: " + _outcome(c.error, ok))


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The headline per system: median jobs/s of (a) and (b), peak in flight of (c) and when all its jobs were
    done (None: not all within the cap; offload's also with webhooks on), the SIGKILL counts."""
    out: dict[str, Any] = {}
    for name in results["systems"]:
        row: dict[str, Any] = {}
        for workload in ("noop", "io"):
            rates = [
                r["jobs_per_s"]
                for r in results["runs"]
                if r["system"] == name and r["workload"] == workload and not r["error"]
            ]
            if rates:
                row[f"{workload}_jobs_per_s"] = round(statistics.median(rates), 1)
        for run_of, key in ((name, "gpu"), *([(OFFLOAD_WEBHOOKS, "gpu_webhooks")] if name == "offload" else [])):
            gpu = [r for r in results["runs"] if r["system"] == run_of and r["workload"] == "gpu" and not r["error"]]
            if gpu:
                row[f"{key}_peak_in_flight"] = max(r["peak_in_flight"] for r in gpu)
                done = [r["seconds"] for r in gpu if not r["capped"]]
                row[f"{key}_all_done_s"] = round(statistics.median(done), 1) if len(done) == len(gpu) else None
        for c in results["crashes"]:
            if c["system"] == name and not c["error"]:
                row["crash"] = {
                    "lost": c["lost"],
                    "rerun": c["rerun"],
                    "duplicated": c["duplicated"],
                    "all_done_s": None if c["all_done_s"] is None else round(c["all_done_s"], 1),
                }
        out[name] = row
    return {"wall_s": results["wall_s"], "systems": out}


if __name__ == "__main__":
    main()
