"""How soon offload stores a result after the remote job ends: polling against webhooks, side by side in one run.

    python bench/webhooks.py [--jobs 1000] [--latency 10] [--quick] [--keep]

Everything runs as its own process: a private Valkey (AOF everysec), the simulator (`offload sim serve`, the
Replicate API, jobs of fixed remote duration `--latency`), the offload server (`offload server`: it receives the
webhooks) and one dispatch worker (`offload worker`, local-directory storage). The same N jobs are run twice,
enqueued at an even rate over one remote duration, so up to N are in flight at once: first with polling (no
public URL: the worker polls, doubling from 0.25 s to `poll_interval` 5 s), then with webhooks
(`server.public_url` set: each submission carries its webhook URL; the simulator signs with Standard Webhooks,
the server verifies and wakes the worker; the fallback poll is 60 s away).

Latency is measured per job from the remote job's end (the simulator's `finished`) to the stored result (the
job record's `finished_at`), on one machine's clock. Provider calls per job are the simulator's request counts
(create + get) over N. `--quick` is 200 jobs of 3 s. The last line printed is JSON: {"poll_p50_ms",
"poll_p99_ms", "webhook_p50_ms", "webhook_p99_ms", "poll_calls_per_job", "webhook_calls_per_job",
"server_cpu_ms_per_delivery"} (the last: the offload server's CPU over the webhook run, per delivery it
received, starts and completions alike).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

import httpx
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make `bench` importable
from bench import web
from bench.processes import HOST, Processes, ProcStats, free_port, run_in_workdir, start_valkey, wait_until
from offload.connection import connect
from offload.models import JobState
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

QUEUE = "hooks"
SECRET = "whsec_" + "YmVuY2gtd2ViaG9vay1zaWduaW5nLXNlY3JldA=="
ADMIN = "bench-admin-" + "0" * 40
ROUTES = ("replicate.create", "replicate.get")
TICK_S = 0.05


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def write_config(workdir: Path, name: str, redis_url: str, sim_url: str, public_url: str | None, n: int) -> Path:
    config: dict[str, Any] = {
        "redis_url": redis_url,
        "storage": {"kind": "local", "path": str(workdir / f"results-{name}")},
        "backends": {
            "rep": {"kind": "replicate", "base_url": sim_url, "version": "bench", "api_key": "bench"}
            | ({"webhook_secret": SECRET} if public_url else {})
        },
        "queues": {QUEUE: {"backend": "rep", "concurrency": max(n, 1), "poll_interval": 5.0, "poll_timeout": 600}},
    }
    if public_url:
        config["server"] = {"public_url": public_url}
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=2))
    return path


def offload(*args: str) -> list[str]:
    return [sys.executable, "-m", "offload", *args]


async def enqueue_steadily(store: QueueStore, name: str, jobs: int, latency: float) -> list[str]:
    """`jobs` jobs over one remote duration, at an even rate: the jobs in flight ramp up to `jobs` and the remote
    jobs end at that same even rate (all ending in one instant would measure a burst's queueing instead)."""
    specs = [JobSpec(input={"id": f"{name}-{i}", "prompt": "bench"}, retention=3600) for i in range(jobs)]
    ids: list[str] = []
    start = time.monotonic()
    per_tick = max(1, round(jobs * TICK_S / latency))
    for i in range(0, jobs, per_tick):
        ids += await store.enqueue_many(QUEUE, specs[i : i + per_tick])
        await asyncio.sleep(max(0.0, start + (i // per_tick + 1) * TICK_S - time.monotonic()))
    return ids


async def run_once(
    procs: Processes,
    workdir: Path,
    name: str,
    redis_url: str,
    sim_url: str,
    public: str | None,
    jobs: int,
    latency: float,
) -> tuple[list[float], float, float | None]:
    """(latencies in ms, provider calls per job, the server's CPU ms per delivery or None without a server) of
    one run of `jobs` jobs all in flight."""
    sim = web.async_client(base_url=sim_url, timeout=60)
    (await sim.post("/_sim/reset")).raise_for_status()
    (await sim.post("/_sim/webhooks", json={"replicate_secret": SECRET})).raise_for_status()
    config = write_config(workdir, name, redis_url, sim_url, public, jobs)
    r = await connect(redis_url)
    await cast(Redis, r).flushdb()  # a single-node bench server
    store = QueueStore(r)
    server = None
    if public:
        port = public.rsplit(":", 1)[1]
        server = procs.start(
            f"server-{name}",
            offload("server", "--config", str(config), "--host", HOST, "--port", port, "--no-access-log",
                    "--log-level", "warning"),
        )  # fmt: skip
        wait_until(lambda: web.get(f"{public}/healthz").status_code == 200, server, "server", procs, f"server-{name}")
    worker = procs.start(
        f"worker-{name}",
        offload("worker", "--queue", QUEUE, "--config", str(config), "--concurrency", str(jobs), "--grace", "2",
                "--log-level", "warning"),
    )  # fmt: skip
    try:
        server_stats = ProcStats(server.pid) if server is not None else None
        server_cpu0 = server_stats.cpu_seconds() if server_stats is not None else 0.0
        deadline = time.monotonic() + 30
        while (await store.stats(QUEUE)).workers < 1:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"worker did not start:\n{procs.log_tail(f'worker-{name}')}")
            await asyncio.sleep(0.05)
        ids = await enqueue_steadily(store, name, jobs, latency)
        deadline = time.monotonic() + 600
        while (await store.stats(QUEUE)).counts.get("succeeded", 0) < jobs:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name}: jobs did not finish:\n{procs.log_tail(f'worker-{name}')}")
            await asyncio.sleep(0.1)
        server_cpu = server_stats.cpu_seconds() - server_cpu0 if server_stats is not None else None
        latencies = await _latencies(name, r, store, sim, ids, jobs)
        per_delivery = await _server_cost(name, sim, server_cpu)
        requests = (await sim.get("/_sim/stats")).json()["requests"]
        calls = sum(requests.get(route, 0) for route in ROUTES) / jobs
        return latencies, calls, per_delivery
    finally:
        procs.stop(worker)
        if server is not None:
            procs.stop(server)
        await r.aclose()
        await sim.aclose()


async def _latencies(
    name: str, r: Any, store: QueueStore, sim: httpx.AsyncClient, ids: list[str], jobs: int
) -> list[float]:
    """Each job's time from its remote job's end to its stored result (ms); where the server kept a webhook,
    how that splits before and after it is printed."""
    finished, kept = {}, {}
    for job_id in ids:
        job = await store.get(job_id)
        assert job.state == JobState.SUCCEEDED and job.finished_at is not None
        finished[job.input["id"]] = job.finished_at / 1000
        if at := await r.hget(f"offload:{{{QUEUE}}}:job:{job_id}", "hook_at"):  # when the server kept it
            kept[job.input["id"]] = int(at) / 1000
    remote = (await sim.get("/_sim/jobs", params={"limit": jobs * 2})).json()["jobs"]
    ends = {j["input_id"]: j["finished"] for j in remote}
    latencies = [(finished[k] - ends[k]) * 1000 for k in finished]
    if kept:  # where a tail comes from: before the server kept the webhook (simulator, server), or after
        server_ms = [(kept[k] - ends[k]) * 1000 for k in kept]
        worker_ms = [(finished[k] - kept[k]) * 1000 for k in kept]
        print(
            f"{name}: kept by the server p50 {percentile(server_ms, 0.5):.0f} / p99 "
            f"{percentile(server_ms, 0.99):.0f} ms after the end, "
            f"stored p50 {percentile(worker_ms, 0.5):.0f} / p99 "
            f"{percentile(worker_ms, 0.99):.0f} ms later"
        )
    return latencies


async def _server_cost(name: str, sim: httpx.AsyncClient, server_cpu: float | None) -> float | None:
    """The server's CPU ms per webhook delivery (None without a server), and how soon it answered completions."""
    every = (await sim.get("/_sim/webhooks")).json()["deliveries"]
    per_delivery = None
    if server_cpu is not None and every:  # starts and completions alike: each is one verified delivery
        per_delivery = server_cpu * 1000 / len(every)
        print(f"{name}: the server spent {per_delivery:.2f} ms of CPU per delivery ({len(every)} deliveries)")
    # the completions only: a Replicate `start` goes out the moment the prediction exists
    sent = [d for d in every if d.get("event") == "completed"]
    if sent:
        answered = [(d["sent_at"] - d["ended"]) * 1000 for d in sent]
        print(
            f"{name}: webhook answered by the server p50 {percentile(answered, 0.5):.0f} / p99 "
            f"{percentile(answered, 0.99):.0f} ms after the end"
        )
    return per_delivery


async def main_async(args: argparse.Namespace, workdir: Path) -> dict[str, float | None]:
    procs = Processes(workdir)
    try:
        redis_url = start_valkey(procs)
        port = free_port()
        sim = procs.start(
            "sim",
            offload("sim", "serve", "--host", HOST, "--port", str(port), "--latency", f"{args.latency:g}",
                    "--log-level", "warning"),
        )  # fmt: skip
        sim_url = f"http://{HOST}:{port}"
        wait_until(lambda: web.get(f"{sim_url}/_sim/health").status_code == 200, sim, "simulator", procs, "sim")
        public = f"http://{HOST}:{free_port()}"
        poll, poll_calls, _ = await run_once(procs, workdir, "poll", redis_url, sim_url, None, args.jobs, args.latency)
        hook, hook_calls, server_ms = await run_once(
            procs, workdir, "webhook", redis_url, sim_url, public, args.jobs, args.latency
        )
        print(
            f"{args.jobs} jobs of {args.latency:g} s: polling p50 {statistics.median(poll):.0f} ms, "
            f"webhooks p50 {statistics.median(hook):.0f} ms; calls per job {poll_calls:.2f} vs {hook_calls:.2f}"
        )
        return {
            "poll_p50_ms": round(percentile(poll, 0.5), 1),
            "poll_p99_ms": round(percentile(poll, 0.99), 1),
            "webhook_p50_ms": round(percentile(hook, 0.5), 1),
            "webhook_p99_ms": round(percentile(hook, 0.99), 1),
            "poll_calls_per_job": round(poll_calls, 3),
            "webhook_calls_per_job": round(hook_calls, 3),
            "server_cpu_ms_per_delivery": round(server_ms, 3) if server_ms is not None else None,
        }
    finally:
        procs.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--latency", type=float, default=None, help="remote job duration, seconds")
    parser.add_argument("--quick", action="store_true", help="200 jobs of 3 s")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs)")
    args = parser.parse_args()
    args.jobs = args.jobs or (200 if args.quick else 1000)
    args.latency = args.latency if args.latency is not None else (3.0 if args.quick else 10.0)
    result = run_in_workdir("offload-bench-webhooks-", args.keep, lambda workdir: main_async(args, workdir))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
