"""`python -m bench.chaos --hybrid`: one queue served by both kinds of capacity, under SIGKILLs of each.

A real `offload server` autoscales queue `gpu` with the `local` provider: its machines are `offload worker
--handler bench.chaos.gpu_handler:run` processes. The queue's `overflow` backend is the simulator's RunPod API,
served by overflow workers (`offload worker --queue gpu`). A producer enqueues bursts; meanwhile the harness
SIGKILLs, at random, an overflow worker (restarted at once: a kill inside a submit leaves its intent open), a
machine's worker process (the autoscaler replaces the machine), or the server (restarted on the same port); or
restarts the server gracefully (SIGTERM, as a deploy does): it must exit cleanly within `STOP_BOUND_S` (a stop once
waited forever on a loop whose cancel Python 3.11 had lost: offload/connection.py's `restore_lost_cancels`).

The verdict, per job: finished (none lost, none stuck), its stored output echoes its own input (none wrong), at
most one submission at the provider that is not a replay of the same key (none paid twice), and never run by both
kinds: no machine began it after the provider had it, and no job finished on a machine was also submitted. A job
a machine began and then lost with the machine (its lease lapsed) may move to overflow: counted, not a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench.chaos.autoscale import VAULT_KEY, Server, _wait, admin_key
from bench.chaos.procs import CLEAN_STOP, OFFLOAD, STOP_BOUND_S, Sim, Valkey, base_env, reap, signal_group, spawn

QUEUE = "gpu"
REPO = Path(__file__).resolve().parents[2]
RUN_S = 0.5  # a job on a machine and at the provider alike
BURST = (20, 60)  # jobs per burst, uniform
BURST_EVERY_S = 8.0
MAX_ATTEMPTS = 30  # lease lapses count as attempts: every job must finish, none may go dead of the kills


def main(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path(tempfile.mkdtemp(prefix="offload-chaos-hybrid-"))
    out.mkdir(parents=True, exist_ok=True)
    minutes = args.minutes or (1.0 if args.quick else 5.0)
    rng = random.Random(args.seed)
    valkey = Valkey(out / "valkey", "always").start()
    sim = Sim(out, 0).start()
    sim.post("/_sim/config", {"seed": args.seed, "default": {"latency": {"seconds": RUN_S}}})
    worker_key = _operator(valkey.url, out)
    config = out / "offload.yaml"
    server = Server(out, config, valkey.url, admin_key(), "--worker-lease", "3")
    _config(config, out, valkey.url, sim.url, worker_key, server.url)
    overflow: list[Any] = []
    try:
        server.start()
        _wait(lambda: _machines(server) >= 1, 90, "the first rented machine to serve")
        overflow = [_overflow_worker(out, config, n) for n in range(2)]
        stops: list[tuple[int | None, float]] = []
        ids, kills = _fault_phase(
            server, overflow, out, config, valkey.url, minutes, rng, args.kill_every or 3.0, stops
        )
        result = _check(valkey.url, sim, out, ids, _settle(valkey.url, ids, 240))
        result.update(kills=dict(kills), minutes=minutes, seed=args.seed, out=str(out))
        result["server_stops"] = {
            "n": len(stops),
            "longest_s": max((took for _, took in stops), default=0.0),
            "bad": sum(1 for code, _ in stops if code not in CLEAN_STOP),
        }
        result["ok"] = verdict(result)
        return result
    finally:
        for proc in overflow:
            with contextlib.suppress(Exception):
                signal_group(proc, signal.SIGTERM)
                reap(proc, 20)
        for stop in (server.stop, sim.stop, valkey.stop):
            with contextlib.suppress(Exception):
                stop()
        _kill_machines()


def verdict(result: dict[str, Any]) -> bool:
    """Passed only if both kinds ran jobs, kills of each kind landed, and nothing broke: no job, and no graceful
    stop of the server (each ends cleanly within STOP_BOUND_S)."""
    happened = result["on_fleet"] > 0 and result["on_api"] > 0 and all(result["kills"].get(k) for k in KILLS)
    broken = (result["lost"] or result["stuck"] or result["wrong"] or result["dead"] or result["paid_twice"]) or result[
        "run_by_both"
    ]
    broken = broken or result["server_stops"]["bad"]
    return bool(happened and not broken)


KILLS = ("overflow_worker", "machine", "server", "server_sigterm")


def _operator(redis_url: str, out: Path) -> str:
    """The provider `here` (local machines running the chaos handler) and the worker key rented machines get."""
    from offload.access.api_keys import KeyStore
    from offload.autoscale.provider_store import ProviderStore
    from offload.autoscale.vault import Vault
    from offload.connection import connect

    async def go() -> str:
        redis = await connect(redis_url)
        try:
            machine = {
                "handler": "bench.chaos.gpu_handler:run",
                "python": sys.executable,
                "workdir": str(REPO),
                "log_dir": str(out / "machines"),
                "grace": 5,
                "stop_timeout": 2,
                "price_per_hour": 1.0,
            }
            await ProviderStore(redis, Vault(VAULT_KEY)).create("here", "local", machine)
            return (await KeyStore(redis).create("worker", [QUEUE], "rented machines"))[1]
        finally:
            await redis.aclose()

    return asyncio.run(go())


def _config(path: Path, out: Path, redis_url: str, sim_url: str, worker_key: str, server_url: str) -> None:
    env = {"OFFLOAD_CHAOS_RUNLOG": str(out / "gpu-runs.log"), "OFFLOAD_CHAOS_RUN_S": str(RUN_S)}
    block = {
        "enabled": True,
        "provider": "here",
        "min_workers": 2,
        "max_workers": 3,
        "poll_interval": "0.5s",
        "boot_timeout": "60s",
        "scale_up": [{"trigger": "no_workers"}],
        "scale_down": [{"trigger": "idle", "timeout": "10m"}],
        "instance": {"env": env},
        "overflow": {"backends": ["api"], "after": "3s"},
    }
    path.write_text(
        yaml.safe_dump(
            {
                "redis_url": redis_url,  # the overflow workers' (the server is given it on its command line)
                "storage": {"kind": "local", "path": str(out / "results")},
                "backends": {"api": {"kind": "runpod", "endpoint_id": "sdxl", "base_url": sim_url, "api_key": "k"}},
                "queues": {QUEUE: {"poll_interval": 0.2, "autoscale": block}},
                "autoscaler": {
                    "public_url": server_url,  # where the machines register
                    "worker_key": worker_key,
                    "tick": 0.2,
                    "drain_settle": 1,
                    "recent_task": 1,
                },
            }
        )
    )


def _overflow_worker(out: Path, config: Path, n: int) -> Any:
    env = base_env(OFFLOAD_LEASE_MS="3000")
    return spawn([OFFLOAD, "worker", "--queue", QUEUE, "--config", str(config)], out / f"overflow-{n}.log", env)


def _machines(server: Server) -> int:
    return sum(1 for w in server.api("GET", "/v1/workers") if w.get("instance_id"))


def _machine_pids() -> list[int]:
    """The rented machines' worker processes (the local provider's), found by their handler."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if b"bench.chaos.gpu_handler" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def _kill_machines() -> None:
    for pid in _machine_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _fault_phase(
    server: Server,
    overflow: list[Any],
    out: Path,
    config: Path,
    redis_url: str,
    minutes: float,
    rng: random.Random,
    kill_every: float,
    stops: list[tuple[int | None, float]],
) -> tuple[list[str], Counter[str]]:
    """Bursts of jobs and a SIGKILL (or the server's SIGTERM) about every `kill_every` seconds, for `minutes`; the
    ids enqueued. Each graceful stop's (exit code, seconds) is appended to `stops`."""
    ids: list[str] = []
    kills: Counter[str] = Counter()
    end = time.monotonic() + minutes * 60
    next_burst = time.monotonic()
    next_kill = time.monotonic() + rng.expovariate(1 / kill_every)
    restarts = 0
    while time.monotonic() < end:
        now = time.monotonic()
        if now >= next_burst:
            ids += _enqueue(redis_url, rng.randint(*BURST), len(ids))
            next_burst = now + BURST_EVERY_S
        if now >= next_kill:
            kind = rng.choice(KILLS)
            if kind == "overflow_worker":
                n = rng.randrange(len(overflow))
                signal_group(overflow[n], signal.SIGKILL)
                reap(overflow[n])
                restarts += 1
                overflow[n] = _overflow_worker(out, config, n + 2 * restarts)
            elif kind == "machine" and (pids := _machine_pids()):
                os.kill(rng.choice(pids), signal.SIGKILL)
            elif kind == "server":
                server.kill()
                server.start()
            elif kind == "server_sigterm":
                stops.append(server.graceful_stop(STOP_BOUND_S))
                server.start()
            kills[kind] += 1
            next_kill = now + rng.expovariate(1 / kill_every)
        time.sleep(0.05)
    return ids, kills


def _enqueue(redis_url: str, n: int, start: int) -> list[str]:
    from offload.connection import connect
    from offload.queue.specs import JobSpec
    from offload.queue.store import QueueStore

    async def go() -> list[str]:
        redis = await connect(redis_url)
        try:
            specs = [JobSpec(input={"id": f"j{start + i}"}, max_attempts=MAX_ATTEMPTS) for i in range(n)]
            return await QueueStore(redis).enqueue_many(QUEUE, specs)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def _settle(redis_url: str, ids: list[str], timeout: float) -> dict[str, dict[str, str]]:
    """Every job's record once all are finished, or at the timeout."""
    import redis as sync_redis

    from offload.queue import keyspace

    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    deadline = time.monotonic() + timeout
    records: dict[str, dict[str, str]] = {}
    while True:
        pipe = client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(keyspace.job(QUEUE, job_id))
        records = dict(zip(ids, pipe.execute(), strict=True))
        done = all(r.get("state") in ("succeeded", "dead", "cancelled") for r in records.values())
        if done or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def _check(redis_url: str, sim: Sim, out: Path, ids: list[str], records: dict[str, dict[str, str]]) -> dict[str, Any]:
    runs: dict[str, list[float]] = defaultdict(list)
    with contextlib.suppress(FileNotFoundError):
        for line in (out / "gpu-runs.log").read_text().splitlines():
            job_id, at = line.split()
            runs[job_id].append(float(at))
    by_input: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sub in sim.submissions():
        if not sub["replay"]:
            by_input[str(sub["input_id"])].append(sub)
    result: dict[str, Any] = Counter()
    problems: list[str] = []
    for job_id in ids:
        rec = records.get(job_id) or {}
        state = rec.get("state")
        if not rec:
            result["lost"] += 1
            problems.append(f"{job_id}: lost")
            continue
        if state != "succeeded":
            result["dead" if state == "dead" else "stuck"] += 1
            problems.append(f"{job_id}: {state} {rec.get('error', '')[:120]}")
            continue
        expected = orjson.loads(rec["input"])
        subs = by_input.get(expected["id"], [])
        on_api = rec.get("backend") == "api"
        result["on_api" if on_api else "on_fleet"] += 1
        stored = orjson.loads(Path(rec["result"]).read_bytes()) if Path(rec.get("result", "")).is_file() else None
        if not isinstance(stored, dict) or stored.get("echo") != expected:
            result["wrong"] += 1
            problems.append(f"{job_id}: output {str(stored)[:80]} is not its own")
        if len(subs) > 1:
            result["paid_twice"] += 1
            problems.append(f"{job_id}: {len(subs)} submissions at the provider")
        first_sub = min((float(s["arrival"]) for s in subs), default=None)
        if (not on_api and subs) or (first_sub is not None and any(t > first_sub for t in runs.get(job_id, []))):
            result["run_by_both"] += 1
            problems.append(f"{job_id}: run on a machine and submitted at the provider")
        elif on_api and runs.get(job_id):
            result["moved_after_a_machine_died"] += 1
    keys = ("lost", "stuck", "dead", "wrong", "paid_twice", "run_by_both", "on_fleet", "on_api")
    return {
        "mode": "hybrid",
        "jobs": len(ids),
        **{k: result[k] for k in keys},
        "moved_after_a_machine_died": result["moved_after_a_machine_died"],
        "gpu_runs": sum(len(v) for v in runs.values()),
        "problems": problems[:20],
    }
