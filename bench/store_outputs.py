"""A burst of finished jobs storing their outputs: the worker's two roads for a provider file, side by side.

    python bench/store_outputs.py [--quick] [--jobs 2000] [--reps 3]

When 2,000 GPU jobs end within a second, each one's output names a provider file that the worker copies into
the result store before the job may succeed (offload/storage/outputs.py), and those copies are what the event
loop spends the burst on. This runs `--jobs` concurrent `store_output` calls in one process, as the
worker's `save` makes them: the worker's client (`new_client`, on aiohttp's pool), local-directory storage, the
fence a no-op, one file per output from a simulator running as its own process. Two roads, interleaved per
repetition:

- `httpx`: the file fetched through httpx's client layers (`plain=None`; what every file took before);
- `plain`: through `AiohttpTransport.get_plain` (`plain=fast_path(http)`), httpx only for a redirect or an
  encoded body, on a pool of at most `FILE_CONNECTIONS_PER_HOST` connections per host, as the worker's;
- `unbounded`: `plain` on a pool bounded only in total (1,024), as before the per-host bound: a burst opens a
  connection for most of its files instead of reusing a few dozen.

Each burst starts on a fresh pool (a worker's pool holds few idle connections when a burst begins). All write
through the same LocalStorage. Each figure is the median over the repetitions; CPU is this process's, and the
simulator's (serving the files) is given per job too. The last line printed is JSON: {"httpx_jobs_per_s",
"plain_jobs_per_s", "unbounded_jobs_per_s", "ratio", "per_host_ratio", "httpx_cpu_ms_per_job",
"plain_cpu_ms_per_job", "unbounded_cpu_ms_per_job", "plain_sim_cpu_ms_per_job", "unbounded_sim_cpu_ms_per_job"}
where `ratio` is plain over httpx and `per_host_ratio` plain over unbounded (jobs per second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make `bench` importable
from bench.processes import Processes, ProcStats, start_sim
from offload import eventloop
from offload.backends import new_client
from offload.backends.transport import fast_path
from offload.egress import FilePolicy
from offload.storage import LocalStorage, store_output
from offload.worker.run import FILE_CONNECTIONS_PER_HOST

AUTH = {"Authorization": "Bearer bench"}


async def one_output(http: httpx.AsyncClient, sim: str) -> Any:
    """A finished Replicate-style prediction's output (it names one file on the simulator)."""
    made = (await http.post(f"{sim}/v1/predictions", json={"version": "bench", "input": {}}, headers=AUTH)).json()
    for _ in range(200):
        body = (await http.get(f"{sim}/v1/predictions/{made['id']}", headers=AUTH)).json()
        if body["status"] == "succeeded":
            return body["output"]
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the simulator's prediction did not finish: {body}")


async def burst(
    http: httpx.AsyncClient, output: Any, jobs: int, plain: bool, root: Path, sim: str
) -> tuple[float, float]:
    """(jobs per second, CPU ms per job) for `jobs` outputs stored at once, on `http`'s pool."""
    store = LocalStorage(root)
    road = fast_path(http) if plain else None
    own = FilePolicy.of(sim)  # the simulator is the backend: its files are on its own origin, on loopback

    async def fence() -> None:
        return None

    async def one(i: int) -> None:
        await store_output(
            store, f"results/j{i}.json", output, http, run="1", before_write=fence, plain=road, policy=own
        )

    wall0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(jobs)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    stored = sum(1 for _ in (root / "results").glob("*.json"))
    if stored != jobs:
        raise RuntimeError(f"{stored} of {jobs} outputs stored")
    return jobs / wall, cpu * 1000 / jobs


ROADS = ("httpx", "plain", "unbounded")


async def run(sim: str, sim_pid: int, jobs: int, reps: int, workdir: Path) -> dict[str, float]:
    sim_cpu = ProcStats(sim_pid)
    first = new_client(max_connections=1024, timeout=60)
    try:
        output = await one_output(first, sim)
    finally:
        await first.aclose()
    rates: dict[str, list[float]] = {name: [] for name in ROADS}
    cpus: dict[str, list[float]] = {name: [] for name in ROADS}
    sims: dict[str, list[float]] = {name: [] for name in ROADS}
    for rep in range(reps):
        for name in ROADS[rep % len(ROADS) :] + ROADS[: rep % len(ROADS)]:
            per_host = 0 if name == "unbounded" else FILE_CONNECTIONS_PER_HOST
            http = new_client(max_connections=1024, timeout=60, per_host=per_host, egress=True)
            root = workdir / f"{name}{rep}"
            sim0 = sim_cpu.cpu_seconds()
            try:
                rate, cpu = await burst(http, output, jobs, name != "httpx", root, sim)
            finally:
                await http.aclose()
            sims[name].append((sim_cpu.cpu_seconds() - sim0) * 1000 / jobs)
            shutil.rmtree(root, ignore_errors=True)
            rates[name].append(rate)
            cpus[name].append(cpu)
            print(f"rep {rep + 1} {name}: {rate:,.0f} jobs/s, {cpu:.2f} ms CPU per job", flush=True)
    median = {name: statistics.median(rates[name]) for name in ROADS}
    return {
        "httpx_jobs_per_s": round(median["httpx"]),
        "plain_jobs_per_s": round(median["plain"]),
        "unbounded_jobs_per_s": round(median["unbounded"]),
        "ratio": round(median["plain"] / median["httpx"], 3),
        "per_host_ratio": round(median["plain"] / median["unbounded"], 3),
        **{f"{name}_cpu_ms_per_job": round(statistics.median(cpus[name]), 3) for name in ROADS},
        "plain_sim_cpu_ms_per_job": round(statistics.median(sims["plain"]), 3),
        "unbounded_sim_cpu_ms_per_job": round(statistics.median(sims["unbounded"]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 jobs, 1 repetition")
    parser.add_argument("--jobs", type=int, default=None, help="outputs stored at once (2000; quick 200)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions, interleaved (3; quick 1)")
    args = parser.parse_args()
    jobs = args.jobs or (200 if args.quick else 2000)
    reps = args.reps or (1 if args.quick else 3)
    workdir = Path(tempfile.mkdtemp(prefix="offload-store-bench-"))
    procs = Processes(workdir)
    try:
        sim, sim_proc = start_sim(procs, 0.01)
        result = eventloop.run(run(sim, sim_proc.pid, jobs, reps, workdir))
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
