"""What the queue history (offload/queue/history.py) costs the job store: Valkey memory and CPU with it on against
off, in one run on one private Valkey (AOF everysec, offload's shipped persistence).

    python -m bench.history_cost [--jobs 20000] [--minutes 1440] [--group 5] [--small] [--keep]

Two queues, one with the history on and one with it off, do the same work on a virtual clock spread over
`--minutes` simulated minutes (default a whole day: every minute has work, so every minute bucket exists): per
minute, its share of the jobs is enqueued, claimed `--group` at a time after a wait, begun at one of two backends,
and completed after a run of a few ms to 25 s with a cost (one in twenty fails and is retried, one in fifty
dies). The history's writes are per script call, not per job: a bigger group costs less per job. The queues take
turns in blocks of simulated time, so a drift of the machine's load falls on both.
Measured: the history keys' MEMORY USAGE (the on queue's `history:*` keys), the used_memory each queue's blocks
added, and Valkey's CPU (INFO cpu, user + sys) each queue's blocks used, per 1,000 jobs and as a ratio on/off.
Memory per queue per day is what one simulated day of minutes, hours and days takes, and the steady state at the
default retention (2 days of minutes, 15 of hours, 400 of days). The last line printed is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make `bench` importable
from bench.processes import Processes, run_in_workdir, start_valkey
from offload.connection import connect
from offload.queue import history, keyspace
from offload.queue.scripts import HISTORY_KEEP_S
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

T0_MS = 1_796_083_200_000  # a UTC midnight (2026-12-01): a day of minutes is one day bucket
MIN_MS = 60_000
BACKENDS = ("sim-a", "sim-b")
DAY_S = 86_400


class Clock:
    def __init__(self) -> None:
        self.ms = T0_MS

    def __call__(self) -> int:
        return self.ms


@dataclass
class Side:
    """One queue's share of the run: what its blocks cost the server."""

    queue: str
    enabled: bool
    store: QueueStore | None = None
    clock: Clock = field(default_factory=lambda: Clock())
    rng: random.Random = field(default_factory=lambda: random.Random(41))  # the same work on both queues
    cpu_s: float = 0.0
    mem_bytes: int = 0
    jobs: int = 0
    calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


async def cpu_s(redis: Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def used_memory(redis: Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def run_minute(side: Side, minute: int, n: int, rng: random.Random, group: int) -> None:
    """One simulated minute of one queue: `n` jobs through enqueue, claim, begin and complete (or fail). Each queue
    has its own clock, which only goes forward (a run may end in the next minute)."""
    q, clock, store = side.queue, side.clock, side.store
    assert store is not None
    clock.ms = max(clock.ms, T0_MS + minute * MIN_MS + 500)
    ids = await store.enqueue_many(q, [JobSpec(input={"n": i}, retention=3600) for i in range(n)])
    side.calls += 1
    for _ in range(0, len(ids) + group, group):  # (+ a group: jobs retried from the minute before)
        clock.ms += rng.randint(10, 800)
        claimed = await store.claim(q, "bench", group)
        if not claimed:
            break
        backend = rng.choice(BACKENDS)
        await store.begin_many(q, [(c.id, c.token, 0.0) for c in claimed], backend=backend)
        clock.ms += rng.choice((5, 40, 300, 2000, 9000, 25_000))
        done = []
        for c in claimed:
            roll = rng.random()
            if roll < 0.05 and c.attempt == 1:
                await store.fail(c.id, c.token, "remote 5xx", delay_ms=0, cost=0.001)
                side.calls += 1
            elif roll < 0.07:
                await store.fail(c.id, c.token, "bad input", retryable=False)
                side.calls += 1
            else:
                done.append((c.id, c.token, c.output_key, round(rng.uniform(0.0005, 0.01), 6)))
        if done:
            await store.complete_many(q, done)
        side.calls += 3
    side.jobs += n


async def block(redis: Redis, side: Side, minutes: range, per_min: list[int], group: int) -> None:
    cpu0, mem0 = await cpu_s(redis), await used_memory(redis)
    for m in minutes:
        await run_minute(side, m, per_min[m], side.rng, group)
    side.cpu_s += await cpu_s(redis) - cpu0
    side.mem_bytes += await used_memory(redis) - mem0


async def history_bytes(redis: Redis, queue: str) -> dict[str, int]:
    """MEMORY USAGE of the queue's history keys, by resolution (m, h, d), with their count."""
    out: dict[str, int] = {}
    async for key in redis.scan_iter(match=keyspace.prefix(queue) + "history:[mhd]:*", count=1000):
        res = key.split("history:", 1)[1][0]
        out[res] = out.get(res, 0) + int(await redis.memory_usage(key, samples=0) or 0)
        out[res + "_keys"] = out.get(res + "_keys", 0) + 1
    return out


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    redis = await connect(url)
    admin = Redis.from_url(url, decode_responses=True)  # INFO, SCAN, MEMORY USAGE: commands offload never sends
    per_min = [args.jobs // args.minutes + (1 if m < args.jobs % args.minutes else 0) for m in range(args.minutes)]
    on, off = Side("hist-on", True), Side("hist-off", False)
    try:
        for side in (on, off):  # the history's settings, as the server writes them
            side.store = QueueStore(redis, clock_ms=side.clock, excuse_outages=False)
            await history.sample(redis, side.queue, history.HistoryKeep(enabled=side.enabled), {}, str(T0_MS))
        # warm up first: the scripts' first load and the server's one-time allocations (about 700 KB) would
        # otherwise fall on whichever queue's block came first
        warm = Side("warm-up", True)
        warm.store = QueueStore(redis, clock_ms=warm.clock, excuse_outages=False)
        for m in range(min(30, args.minutes)):
            await run_minute(warm, m, per_min[m], warm.rng, args.group)
        step = max(1, args.minutes // 8)
        for b, first in enumerate(range(0, args.minutes, step)):
            minutes = range(first, min(first + step, args.minutes))
            for side in (on, off) if b % 2 == 0 else (off, on):  # each goes first in half the blocks
                await block(admin, side, minutes, per_min, args.group)
        kept = await history_bytes(admin, on.queue)
        assert not await history_bytes(admin, off.queue), "history written for the queue that has it off"
        stats = {s.queue: (await s.store.stats(s.queue)).totals for s in (on, off) if s.store}
    finally:
        await redis.aclose()
        await admin.aclose()
    return report(args, on, off, kept, stats)


def report(
    args: argparse.Namespace, on: Side, off: Side, kept: dict[str, int], stats: dict[str, Any]
) -> dict[str, Any]:
    days = args.minutes / 1440
    per_k = {s.queue: 1000 / s.jobs for s in (on, off)}
    hist_total = kept.get("m", 0) + kept.get("h", 0) + kept.get("d", 0)
    # steady state at the default retention: 2 days of minute buckets, 15 of hour buckets, 400 of day buckets
    per_day = {r: kept.get(r, 0) / days for r in ("m", "h")}
    day_bucket = kept.get("d", 0) / max(1, kept.get("d_keys", 1))
    steady = per_day["m"] * HISTORY_KEEP_S[0] / DAY_S + per_day["h"] * HISTORY_KEEP_S[1] / DAY_S
    steady += day_bucket * HISTORY_KEEP_S[2] / DAY_S
    cpu_on, cpu_off = on.cpu_s * per_k[on.queue], off.cpu_s * per_k[off.queue]
    return {
        "jobs_per_queue": on.jobs,
        "group": args.group,
        "simulated_minutes": args.minutes,
        "succeeded": {q: t.get("succeeded", 0) for q, t in stats.items()},
        "history_keys": {r: kept.get(f"{r}_keys", 0) for r in ("m", "h", "d")},
        "history_bytes": {r: kept.get(r, 0) for r in ("m", "h", "d")},
        "history_bytes_per_queue_day": round(hist_total / days),
        "history_bytes_steady_state_per_queue": round(steady),
        "history_bytes_per_1000_jobs": round(hist_total * per_k[on.queue]),
        "used_memory_delta_per_1000_jobs": {
            "on": round(on.mem_bytes * per_k[on.queue]),
            "off": round(off.mem_bytes * per_k[off.queue]),
        },
        "valkey_cpu_ms_per_1000_jobs": {"on": round(cpu_on * 1000, 1), "off": round(cpu_off * 1000, 1)},
        "cpu_ratio_on_off": round(cpu_on / cpu_off, 3) if cpu_off > 0 else None,
    }


def print_table(doc: dict[str, Any]) -> None:
    cpu = doc["valkey_cpu_ms_per_1000_jobs"]
    mem = doc["used_memory_delta_per_1000_jobs"]
    print(
        f"{doc['jobs_per_queue']:,} jobs per queue over {doc['simulated_minutes']:,} simulated minutes, "
        f"{doc['group']} per claim and per complete"
    )
    print(f"history keys (minute/hour/day)     {doc['history_keys']}")
    print(f"history memory per queue per day    {doc['history_bytes_per_queue_day'] / 1024:,.1f} KiB")
    print(f"  steady state, default retention   {doc['history_bytes_steady_state_per_queue'] / 1024:,.1f} KiB")
    print(f"history memory per 1,000 jobs      {doc['history_bytes_per_1000_jobs'] / 1024:,.1f} KiB")
    print(f"used_memory delta per 1,000 jobs    on {mem['on'] / 1024:,.1f} KiB, off {mem['off'] / 1024:,.1f} KiB")
    print(
        f"Valkey CPU per 1,000 jobs           on {cpu['on']:,.1f} ms, off {cpu['off']:,.1f} ms "
        f"(ratio {doc['cpu_ratio_on_off']})"
    )


async def run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    procs = Processes(workdir)
    try:
        url = start_valkey(procs)
        return await measure(url, args)
    finally:
        procs.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per queue (each queue runs as many)")
    parser.add_argument("--minutes", type=int, default=1440, help="simulated minutes the jobs are spread over")
    parser.add_argument("--group", type=int, default=5, help="jobs per claim and per complete call (default 5)")
    parser.add_argument("--small", action="store_true", help="2,000 jobs over 240 minutes: a quick run")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (Valkey's log)")
    args = parser.parse_args()
    if args.small:
        args.jobs, args.minutes = 2_000, 240
    if args.jobs < args.minutes or args.minutes < 8:
        parser.error("--jobs must be at least --minutes, and --minutes at least 8")
    started = time.perf_counter()
    doc = run_in_workdir("offload-history-cost-", args.keep, lambda w: run(w, args))
    print_table(doc)
    print(f"(took {time.perf_counter() - started:.0f} s)")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
