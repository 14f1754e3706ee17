"""Spend on a mixed workload, with and without routing: one queue per setup, all setups in one run, side by side.

    python bench/routing_spend.py [--jobs 2000] [--small] [--setups single,routed,batch] [--out DIR] [--keep]

The workload: N jobs enqueued at once through the real `AsyncClient`, every other one with `deadline_in` 24 h (a
job that may wait), the rest with no deadline (wanted now). Each setup (SETUPS below) runs it on a fresh store
(the database flushed, the simulator reset) with one `offload worker` process, all against one simulator:

- `single`: one interactive backend (`kind: openai`, the simulator's chat completions, `--fast` s per job) at the
  interactive price P per job;
- `routed`: the same, plus a cheaper, slower lane (`kind: http-job`, `--slow` s per job) at P/2, `route:
  fallback` with the interactive one first: a job without a deadline goes first in order, a job with one to the
  cheapest backend expected to finish in time (docs/how-to/routing.md);
- `batch`: the interactive backend plus an `openai-batch` lane at P/2 (the simulator's Batch API, batches of
  `--batch-s` s).

Per setup: the spend (the sum of the job records' `cost`), what the simulator was asked to run priced at each
lane's price (an independent count: a duplicate submission shows there), jobs per backend, the share of deadline
jobs on the cheap lane, time to finish (enqueue to `finished_at`) p50/p95 per half, and whether every job
succeeded, submitted exactly once. Markdown goes to stderr (and DIR/routing_spend.md with --out), the JSON is
the last line printed (and DIR/routing_spend.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make `bench` importable
from bench import web
from bench.processes import HOST, Processes, free_port, run_in_workdir, start_valkey, wait_until
from bench.webhooks import percentile
from offload.client import AsyncClient
from offload.config import problems
from offload.connection import connect
from offload.models import Job, JobState
from offload.queue.store import QueueStore

QUEUE = "mix"
DAY_S = 86_400
PRICE = 0.002  # P: the interactive price per job, USD; the cheap lanes cost P/2
MODEL = "bench-model"


@dataclass(frozen=True)
class Params:
    """What a setup's backends are built from."""

    sim_url: str
    fast_s: float
    slow_s: float
    batch_s: float


@dataclass(frozen=True)
class Setup:
    """A named set of backends for the one queue. `cheap`: the lane deadline jobs should go to (None: there is
    none)."""

    name: str
    what: str
    backends: Callable[[Params], dict[str, dict[str, Any]]]
    cheap: str | None = None
    route: str = "fallback"


def live(p: Params) -> dict[str, Any]:
    """The interactive backend: synchronous chat completions at the full price."""
    return {
        "kind": "openai",
        "base_url": f"{p.sim_url}/v1",
        "api_key": "bench",
        "model": MODEL,
        "price_per_job": PRICE,
        "expected_run_s": p.fast_s,
        "max_connections": 1024,
    }


def slow(p: Params) -> dict[str, Any]:
    """A cheaper, slower lane (the tutorial's job API: submit, then poll) at half the price."""
    return {
        "kind": "http-job",
        "base_url": p.sim_url,
        "api_key": "bench",
        "price_per_job": PRICE / 2,
        "expected_run_s": p.slow_s,
    }


def openai_batch(p: Params) -> dict[str, Any]:
    """OpenAI's Batch API at half the price (docs/how-to/batch-apis.md once `kind: openai-batch` is a backend):
    packs go out after 2 s, the router assumes a batch takes `batch_s` until one is measured."""
    return {
        "kind": "openai-batch",
        "base_url": f"{p.sim_url}/v1",
        "api_key": "bench",
        "model": MODEL,
        "price_per_job": PRICE / 2,
        "max_wait_s": 2,
        "batch_poll_interval_s": 1,
        "expected_duration_s": p.batch_s,
    }


SETUPS: dict[str, Setup] = {
    s.name: s
    for s in (
        Setup("single", "one interactive backend", lambda p: {"live": live(p)}),
        Setup(
            "routed",
            "interactive + a slower lane at half price, by deadline",
            lambda p: {"live": live(p), "slow": slow(p)},
            cheap="slow",
        ),
        Setup(
            "batch",
            "interactive + OpenAI's Batch API at half price, by deadline",
            lambda p: {"live": live(p), "batch": openai_batch(p)},
            cheap="batch",
        ),
    )
}


@dataclass
class Outcome:
    """One setup's figures."""

    setup: str
    report: dict[str, Any] = field(default_factory=dict)


def write_config(workdir: Path, setup: Setup, params: Params, redis_url: str, concurrency: int) -> Path:
    backends = setup.backends(params)
    queue: dict[str, Any] = {"concurrency": concurrency, "poll_interval": 1.0, "poll_timeout": 600}
    if len(backends) == 1:
        queue["backend"] = next(iter(backends))
    else:
        queue |= {"backends": list(backends), "route": setup.route}
    config = {
        "redis_url": redis_url,
        "storage": {"kind": "local", "path": str(workdir / f"results-{setup.name}")},
        "backends": backends,
        "queues": {QUEUE: queue},
    }
    path = workdir / f"{setup.name}.yaml"
    path.write_text(json.dumps(config, indent=2))
    return path


def config_problem(path: Path) -> str | None:
    """The first problem the build's config check finds in `path` (None: it is valid), read without the
    environment so no OFFLOAD_* variable of the shell changes what is measured."""
    found = problems(path, env={})
    return str(found[0]) if found else None


def sim_config(workdir: Path, params: Params) -> Path:
    """The simulator: the interactive API answers in `fast_s`, the job API runs `slow_s`, a batch `batch_s`."""
    config = {
        "seed": 1,
        "families": {"openai": {"latency": params.fast_s}, "jobs": {"latency": params.slow_s}},
        "batches": {"seconds": params.batch_s},
    }
    path = workdir / "sim.json"
    path.write_text(json.dumps(config))
    return path


def workload(setup: str, jobs: int) -> list[dict[str, Any]]:
    """Every other job may wait a day; the rest have no deadline. `metadata.id` is what the simulator counts
    submissions by (offload/testing/sim/store.py's `input_key`)."""
    items = []
    for i in range(jobs):
        body = {"messages": [{"role": "user", "content": f"job {i}"}], "metadata": {"id": f"{setup}-{i}"}}
        item: dict[str, Any] = {"input": body, "retention": 3600}
        if i % 2 == 0:
            item["deadline_in"] = DAY_S
        items.append(item)
    return items


async def run_setup(
    procs: Processes, workdir: Path, setup: Setup, params: Params, redis_url: str, jobs: int, concurrency: int
) -> Outcome:
    config = write_config(workdir, setup, params, redis_url, concurrency)
    if (problem := config_problem(config)) is not None:
        raise SystemExit(f"{setup.name}: the config is refused: {problem}")
    sim = web.async_client(base_url=params.sim_url, timeout=60)
    redis = await connect(redis_url)
    await cast(Redis, redis).flushdb()  # a fresh store: no jobs, no measured run times from the last setup
    (await sim.post("/_sim/reset")).raise_for_status()
    worker = procs.start(
        f"worker-{setup.name}",
        [sys.executable, "-m", "offload", "worker", "--queue", QUEUE, "--config", str(config),
         "--concurrency", str(concurrency), "--grace", "2", "--log-level", "warning"],
    )  # fmt: skip
    store = QueueStore(redis)
    try:
        await _until_worker(store, worker, procs, setup.name)
        started = time.monotonic()
        async with AsyncClient(redis_url) as client:
            ids = await client.enqueue_many(QUEUE, workload(setup.name, jobs))
        await _until_done(store, worker, procs, setup.name, jobs)
        seconds = time.monotonic() - started
        records = [await store.get(job_id) for job_id in ids]
        remote = (await sim.get("/_sim/jobs", params={"limit": jobs * 4})).json()["jobs"]
        stats = (await sim.get("/_sim/stats")).json()
        report = summarise(setup, params, records, remote, stats)
        report["seconds"] = round(seconds, 1)
        return Outcome(setup.name, report=report)
    finally:
        procs.stop(worker)
        await redis.aclose()
        await sim.aclose()


async def _until_worker(store: QueueStore, worker: Any, procs: Processes, name: str) -> None:
    deadline = time.monotonic() + 60
    while (await store.stats(QUEUE)).workers < 1:
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name}: the worker did not start:\n{procs.log_tail(f'worker-{name}')}")
        await asyncio.sleep(0.05)


async def _until_done(store: QueueStore, worker: Any, procs: Processes, name: str, jobs: int) -> None:
    """Until every job is terminal (succeeded, dead or cancelled): the report then says which were not succeeded."""
    deadline = time.monotonic() + 600
    while True:
        counts = (await store.stats(QUEUE)).counts
        if sum(counts.get(state, 0) for state in ("succeeded", "dead", "cancelled")) >= jobs:
            return
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name}: jobs did not finish ({counts}):\n{procs.log_tail(f'worker-{name}')}")
        await asyncio.sleep(0.1)


def lane_of(remote: dict[str, Any], setup: Setup) -> str:
    """Which backend of the setup a simulator job belongs to: a batch line carries its custom_id; the chat API is
    the interactive backend; the job API the slow lane."""
    if "custom_id" in (remote.get("meta") or {}):
        return "batch"
    return "live" if remote["family"] == "openai" else "slow"


def summarise(
    setup: Setup, params: Params, records: list[Job], remote: list[dict[str, Any]], stats: dict[str, Any]
) -> dict[str, Any]:
    """The figures of one setup from its job records and what the simulator saw."""
    prices = {name: b["price_per_job"] for name, b in setup.backends(params).items()}
    halves: dict[str, list[Job]] = {"deadline": [], "none": []}
    for job in records:
        halves["deadline" if job.deadline is not None else "none"].append(job)
    by_backend = Counter(job.backend or "?" for job in records)
    spend_by: dict[str, float] = defaultdict(float)
    for job in records:
        spend_by[job.backend or "?"] += job.cost or 0.0
    ran = Counter(lane_of(r, setup) for r in remote)
    cheap = setup.cheap
    return {
        "what": setup.what,
        "jobs": len(records),
        "succeeded": sum(job.state == JobState.SUCCEEDED for job in records),
        "without_cost": sum(job.cost is None for job in records),
        "duplicate_submissions": len(stats.get("duplicate_input_ids", [])),
        "possible_duplicates": sum(job.possible_duplicates for job in records),
        "submissions": stats.get("submissions", 0),
        "spend": round(sum(job.cost or 0.0 for job in records), 6),
        "spend_by_backend": {k: round(v, 6) for k, v in sorted(spend_by.items())},
        "billed": round(sum(n * prices.get(lane, 0.0) for lane, n in ran.items()), 6),
        "ran_by_backend": dict(sorted(ran.items())),
        "jobs_by_backend": dict(sorted(by_backend.items())),
        "deadline_on_cheap": _share(halves["deadline"], cheap),
        "none_on_live": _share(halves["none"], "live"),
        **{f"{half}_finish_{q}_s": _finish(jobs, q) for half, jobs in halves.items() for q in ("p50", "p95")},
    }


def _share(jobs: list[Job], backend: str | None) -> float | None:
    if backend is None or not jobs:
        return None
    return round(sum(job.backend == backend for job in jobs) / len(jobs), 4)


def _finish(jobs: list[Job], q: str) -> float | None:
    """Seconds from enqueue to the stored result, at percentile `q` (p50, p95)."""
    times = [(job.finished_at - job.created_at) / 1000 for job in jobs if job.finished_at is not None]
    return round(percentile(times, int(q[1:]) / 100), 2) if times else None


def ratios(outcomes: list[Outcome]) -> dict[str, float | None]:
    """Each setup's spend over `single`'s."""
    spend = {o.setup: o.report.get("spend") for o in outcomes}
    base = spend.get("single")
    return {
        f"{name}_vs_single": round(value / base, 4) if base and value is not None else None
        for name, value in spend.items()
        if name != "single"
    }


def markdown(outcomes: list[Outcome], doc: dict[str, Any]) -> str:
    """The side-by-side table for people."""

    def cell(value: Any, fmt: str = "{}") -> str:
        return "—" if value is None else fmt.format(value)

    lines = [
        f"{doc['jobs']:,} jobs, half with a 24 h deadline; interactive {doc['fast_s']:g} s at ${PRICE:g}/job, "
        f"cheap lanes at ${PRICE / 2:g}/job (slow lane {doc['slow_s']:g} s, batches {doc['batch_s']:g} s)",
        "",
        "| setup | spend $ | ratio to single | billed $ | jobs by backend | deadline jobs on the cheap lane | "
        "finish p50 / p95 s, 24 h half | finish p50 / p95 s, no deadline | succeeded | duplicates | run s |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        r = o.report
        lines.append(
            f"| {o.setup} | {r['spend']:.3f} | {cell(doc['ratios'].get(f'{o.setup}_vs_single', 1.0), '{:.2f}')} | "
            f"{r['billed']:.3f} | {', '.join(f'{k} {v:,}' for k, v in r['jobs_by_backend'].items())} | "
            f"{cell(r['deadline_on_cheap'], '{:.0%}')} | "
            f"{cell(r['deadline_finish_p50_s'])} / {cell(r['deadline_finish_p95_s'])} | "
            f"{cell(r['none_finish_p50_s'])} / {cell(r['none_finish_p95_s'])} | "
            f"{r['succeeded']:,} of {r['jobs']:,} | {r['duplicate_submissions']} | {r['seconds']} |"
        )
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace, workdir: Path) -> list[Outcome]:
    procs = Processes(workdir)
    try:
        redis_url = start_valkey(procs)
        port = free_port()
        params = Params(f"http://{HOST}:{port}", args.fast, args.slow, args.batch_s)
        sim = procs.start(
            "sim",
            [sys.executable, "-m", "offload", "sim", "serve", "--host", HOST, "--port", str(port),
             "--config", str(sim_config(workdir, params)), "--log-level", "warning"],
        )  # fmt: skip
        ready = lambda: web.get(f"{params.sim_url}/_sim/health", timeout=1).status_code == 200  # noqa: E731
        wait_until(ready, sim, "simulator", procs, "sim")
        outcomes = []
        for name in args.setups:
            outcome = await run_setup(procs, workdir, SETUPS[name], params, redis_url, args.jobs, args.concurrency)
            print(f"{name}: done", file=sys.stderr, flush=True)
            outcomes.append(outcome)
        return outcomes
    finally:
        procs.stop_all()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help="jobs per setup (2,000; --small 200)")
    parser.add_argument("--small", action="store_true", help="200 jobs, shorter run times: a test-sized run")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"a comma-separated subset of {', '.join(SETUPS)}")
    parser.add_argument("--fast", type=float, default=None, help="the interactive backend's seconds per job (1)")
    parser.add_argument("--slow", type=float, default=None, help="the slow lane's seconds per job (10; small 2)")
    parser.add_argument("--batch-s", type=float, default=None, help="a simulated batch's seconds (5; small 2)")
    parser.add_argument("--concurrency", type=int, default=500, help="the queue's concurrency (one worker)")
    parser.add_argument("--out", type=Path, default=None, help="write routing_spend.json and .md there")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs)")
    args = parser.parse_args(argv)
    args.jobs = args.jobs if args.jobs is not None else 200 if args.small else 2000
    args.fast = args.fast if args.fast is not None else 0.5 if args.small else 1.0
    args.slow = args.slow if args.slow is not None else 2.0 if args.small else 10.0
    args.batch_s = args.batch_s if args.batch_s is not None else 2.0 if args.small else 5.0
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if unknown := [s for s in args.setups if s not in SETUPS]:
        parser.error(f"--setups: unknown {', '.join(unknown)} (one of {', '.join(SETUPS)})")
    if args.jobs < 2 or args.concurrency < 1 or min(args.fast, args.slow, args.batch_s) <= 0:
        parser.error("--jobs must be at least 2, --concurrency at least 1, the seconds above 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    outcomes = run_in_workdir("offload-bench-routing-", args.keep, lambda workdir: main_async(args, workdir))
    doc: dict[str, Any] = {"jobs": args.jobs, "fast_s": args.fast, "slow_s": args.slow, "batch_s": args.batch_s}
    doc["price_per_job"] = PRICE
    doc["setups"] = {o.setup: o.report for o in outcomes}
    doc["ratios"] = ratios(outcomes)
    page = markdown(outcomes, doc)
    print(page, file=sys.stderr)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "routing_spend.json").write_text(json.dumps(doc, indent=1))
        (args.out / "routing_spend.md").write_text(page)
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
