"""The command line of `python -m bench.chaos` and the fault profile it selects (the default, `--quick`'s
CI-sized one, and the overrides and `--faults` choices on top)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.chaos.faults import Profile

FAULTS = (
    "kill",
    "stop",
    "valkey",
    "drop",
    "reset",
    "blackhole",
    "storm",
    "provider",
    "cancel",
    "gateway",
    "lag",
    "oom",
    "eviction",
    "drain",
    "failover",
    "worker-clock",
    "valkey-clock",
    "hostile",
    "deploy",
    "ssrf",
)
OPT_IN = frozenset({"ssrf"})  # not in `all`: the delivery guarantees' CI runs keep their seeded schedule
BACKENDS = {
    "http-job": {},
    "runpod": {"endpoint_id": "chaos"},
    "replicate": {"version": "chaos-version"},
    "fal": {"app": "chaos/app"},
    "openai": {},  # the model is in every input (a chat-completions request body), as a real client sends it
}
# Where each family lives under the simulator's port, as the backend's base_url names it (OpenAI's SDK convention:
# `{host}/v1`, the backend adding `/chat/completions`); the others' base_url is the port itself.
API_ROOTS = {"openai": "/v1"}
# The families whose submit call is the whole job (offload's `Backend.synchronous`): the answer carries the result,
# nothing is polled, and the remote id is recorded by the ack. The checker judges their runs accordingly.
SYNCHRONOUS = frozenset({"openai"})
MODEL = "chaos-model"  # the `model` of every chat-completions input
# 40 s of faults: every fault the CI runs must see once fires within it (a wait is drawn from 0.5x to 1.5x its mean,
# so each mean here is at most 40 / 1.5 s), and 15 jobs/s for 85 % of it acknowledges 280-350 jobs (an enqueue
# refused in an outage or a failover is not sent again), over the 200 CI asks for.
QUICK = {
    "minutes": 2 / 3,
    "concurrency": 60,
    "jobs_per_s": 15.0,
    "kill_every": 3.0,
    "stop_every": 15.0,
    "valkey_every": 20.0,
    "worker_clock_every": 20.0,
    "worker_clock_s": 12.0,
    "valkey_clock_every": 12.0,
    "drop_every": 2.0,
    "reset_every": 20.0,
    "blackhole_every": 20.0,
    "blackhole_s": 2.0,
    "storm_every": 20.0,
    "storm_s": 3.0,
    "cancel_every": 2.0,
    "drain_every": 6.0,
    "failover_every": 20.0,
    "failover_cut_s": 3.0,
    "hostile_every": 8.0,
    "server_restart_every": 12.0,
    "latency": "3-8",
    "result_ttl": 8.0,
    "capped_jobs": 24,
    "daily_job_cap": 15,
    "gateway_error_rate": 0.05,
    "oom_every": 20.0,
    "oom_s": 6.0,
    "eviction_every": 18.0,
    "eviction_s": 8.0,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    about = "One run of the fault harness, from a clean slate to a verdict."
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=about)
    p.add_argument("--quick", action="store_true", help="the CI-sized profile (40 s of faults)")
    p.add_argument("--minutes", type=float, help="length of the fault phase (default 10, quick 2/3)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, help="dispatch worker processes on the main queue (default 3)")
    p.add_argument("--in-flight", type=int, help="concurrency per worker (default 200, quick 60)")
    p.add_argument("--jobs-per-s", type=float, help="producer rate during the fault phase (default 20)")
    p.add_argument("--jobs", type=int, help="total jobs on the main queue (sets the rate over the fault phase)")
    p.add_argument("--faults", default="all", help=f"comma list of {','.join(FAULTS)}, or all / none")
    p.add_argument("--kill-every", type=float, help="mean seconds between worker SIGKILLs (default 2)")
    p.add_argument("--aof", choices=("always", "everysec"), default="always", help="Valkey appendfsync")
    honour = p.add_mutually_exclusive_group()
    honour.add_argument("--honour-idempotency-key", dest="honour", action="store_true", default=True)
    honour.add_argument(
        "--ignore-idempotency-key",
        dest="honour",
        action="store_false",
        help="the simulator treats every submit as new, as most provider APIs do",
    )
    p.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="http-job",
        help="API family the workers use (openai: synchronous chat completions, the answer is the result)",
    )
    p.add_argument(
        "--webhooks",
        action="store_true",
        help="run `offload server` as every worker's public_url: the provider calls back (replicate, fal, runpod)",
    )
    p.add_argument(
        "--providers",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: the main queue routes to two providers of different kinds, the first down for the middle of the "
        "fault phase (bench/chaos/providers.py)",
    )
    p.add_argument("--no-pidns", action="store_true", help="do not restart workers in PID namespaces")
    p.add_argument(
        "--settle",
        type=float,
        help="after the faults, the longest wait with no job becoming terminal before the rest count as stuck "
        "(default: 3 min, quick 50 s; at most 4 times that in all)",
    )
    p.add_argument("--out", type=Path, help="directory for logs and data (default: a new temp dir)")
    p.add_argument("--autoscale", action="store_true", help="run the server-killed-mid-autoscale scenario only")
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="run the both-kinds scenario only: a rented fleet and serverless overflow on one queue, each SIGKILLed",
    )
    return p.parse_args(argv)


def profile_for(args: argparse.Namespace) -> Profile:
    profile = Profile(**QUICK) if args.quick else Profile()  # type: ignore[arg-type]
    overrides = {
        "minutes": args.minutes,
        "workers": args.workers,
        "concurrency": args.in_flight,
        "jobs_per_s": args.jobs_per_s,
        "kill_every": args.kill_every,
    }
    profile = replace(profile, **{k: v for k, v in overrides.items() if v is not None})
    if args.jobs:  # the producer enqueues for 85 % of the fault phase, a batch every 0.5 s
        profile = replace(profile, jobs_per_s=args.jobs / (profile.minutes * 60 * 0.85))
    chosen = set(args.faults.split(","))
    chosen = set(FAULTS) - OPT_IN if args.faults == "all" else set() if args.faults == "none" else chosen
    if unknown := chosen - set(FAULTS):
        raise SystemExit(f"error: unknown fault(s) {', '.join(sorted(unknown))}; choose from {', '.join(FAULTS)}")
    off: dict[str, Any] = {}
    for fault, fields in (
        ("kill", ["kill_every"]),
        ("stop", ["stop_every"]),
        ("valkey", ["valkey_every"]),
        ("drop", ["drop_every"]),
        ("reset", ["reset_every"]),
        ("blackhole", ["blackhole_every"]),
        ("storm", ["storm_every"]),
        ("oom", ["oom_every"]),
        ("eviction", ["eviction_every"]),
        ("failover", ["failover_every"]),
        ("provider", ["error_rate", "rate_429", "lost_response_rate", "fail_rate"]),
        ("cancel", ["cancel_every"]),
        ("gateway", ["gateway_error_rate"]),
        ("lag", ["status_lag"]),
        ("drain", ["drain_every"]),
        ("worker-clock", ["worker_clock_every"]),
        ("valkey-clock", ["valkey_clock_every"]),
        ("hostile", ["hostile_every"]),
        ("deploy", ["server_restart_every"]),
        ("ssrf", ["ssrf_share"]),
    ):
        if fault not in chosen:
            off.update(dict.fromkeys(fields, 0.0))
    if "drain" in chosen:  # drains must find jobs waiting: a small submit gate, slower submits, a rate limit
        off.update(
            submit_concurrency=8, submit_latency="0.2-1", rate_limit=f"{max(2, round(profile.jobs_per_s * 2))}/s"
        )
    return replace(profile, **off)
