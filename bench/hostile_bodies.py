"""What a hostile request body costs the server: answer time, status and the server's peak RSS.

    python bench/hostile_bodies.py [--mib 8]

Starts a private Valkey and `offload server` as its own process (like bench/http_enqueue.py), then POSTs a batch
body of `--mib` MiB of `{}` items to `/v1/queues/Q/jobs/batch` three ways: with no key, with a worker key of
another queue, and with a producer key of Q itself (allowed to enqueue, but not to make the server build
millions of objects), and the same body as one job's input to the single enqueue route. Meanwhile `/healthz` is
polled: its slowest answer says whether the event loop stalled. The server's peak RSS is read from
/proc/<pid>/status (VmHWM) before the first request and after the last. The last line is JSON:
{"seconds": {...}, "statuses": {...}, "baseline_rss_mb": .., "peak_rss_mb": .., "healthz_max_ms": ..}.

To measure another checkout side by side (e.g. the code before a fix), run it with PYTHONPATH pointing at that
checkout: the server process inherits it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make `bench` importable
from bench import web
from bench.http_enqueue import free_port, start_server, wait_ready
from bench.queue_throughput import start_valkey

QUEUE, OTHER = "bench-hostile", "bench-other"


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def make_key(client: httpx.AsyncClient, url: str, admin: str, scope: str, queue: str) -> str:
    r = await client.post(
        f"{url}/v1/keys", json={"scope": scope, "queues": [queue]}, headers={"Authorization": f"Bearer {admin}"}
    )
    r.raise_for_status()
    return str(r.json()["token"])


async def hostile(url: str, pid: int, admin: str, mib: float) -> dict[str, Any]:
    items = int(mib * (1 << 20) / 3)  # "{}," per item
    batch = b'{"jobs": [' + b",".join([b"{}"] * items) + b"]}"
    single = b'{"input": [' + b",".join([b"{}"] * items) + b"]}"
    baseline = peak_rss_mb(pid)
    seconds: dict[str, float] = {}
    statuses: dict[str, int] = {}
    slowest = 0.0
    done = asyncio.Event()

    async def watch_health() -> None:
        nonlocal slowest
        async with web.async_client(timeout=120) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                await c.get(f"{url}/healthz")
                slowest = max(slowest, time.perf_counter() - t0)
                await asyncio.sleep(0.05)

    async with web.async_client(timeout=120) as client:
        producer = await make_key(client, url, admin, "producer", QUEUE)
        other_worker = await make_key(client, url, admin, "worker", OTHER)
        watcher = asyncio.create_task(watch_health())
        cases = [
            ("no key, batch", None, "/jobs/batch", batch),
            ("worker key of another queue, batch", other_worker, "/jobs/batch", batch),
            ("producer key of the queue, batch", producer, "/jobs/batch", batch),
            ("producer key of the queue, one job", producer, "/jobs", single),
        ]
        for name, token, route, body in cases:
            headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/queues/{QUEUE}{route}", content=body, headers=headers)
            seconds[name] = round(time.perf_counter() - t0, 3)
            statuses[name] = r.status_code
        done.set()
        await watcher
    return {
        "mib": mib,
        "seconds": seconds,
        "statuses": statuses,
        "baseline_rss_mb": round(baseline, 1),
        "peak_rss_mb": round(peak_rss_mb(pid), 1),
        "healthz_max_ms": round(slowest * 1000, 1),
    }


async def run(mib: float) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="offload-hostile-")
    valkey, redis_url = start_valkey(workdir, aof=False)
    admin = "bench-" + secrets.token_urlsafe(24)
    port = free_port()
    env = {
        **os.environ,
        "OFFLOAD_ADMIN_KEY": admin,
        "OFFLOAD_REDIS_URL": redis_url,
        "OFFLOAD_HOME": workdir,
        "OFFLOAD_AUTOSCALER": "off",
    }
    server = start_server(port, 1000, workdir, env)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, server)
        return await hostile(url, server.pid, admin, mib)
    finally:
        server.terminate()
        server.wait(30)
        valkey.terminate()
        valkey.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=8.0, help="size of each hostile body")
    args = parser.parse_args()
    doc = asyncio.run(run(args.mib))
    for name, took in doc["seconds"].items():
        print(f"{name:<40} HTTP {doc['statuses'][name]}  {took:.3f} s")
    print(
        f"server RSS: {doc['baseline_rss_mb']} MB before, peak {doc['peak_rss_mb']} MB; slowest /healthz "
        f"{doc['healthz_max_ms']} ms"
    )
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
