"""One evaluation of a queue with overflow backends: measure its arrivals, size its fleet (overflow.py), and tell
the overflow worker's claims how far the fleet reaches (`publish_reach`).

The arrivals are the queue's `enqueued` total sampled each evaluation and kept in its state for one window (so a
new leader continues the same measurement); the mean run time is the store's run histogram, blended with the
block's `run_time` (a prior) while few runs are measured, so the first burst can count on machines. The count
replaces the scale-up triggers' (a burst is overflow's), except that min_workers and schedules still hold a floor.
"""

from __future__ import annotations

from offload.autoscale import overflow
from offload.autoscale.evaluation import Evaluation
from offload.autoscale.instances import Instance
from offload.autoscale.scale_in import cost_trigger
from offload.autoscale.settings import Overflow
from offload.autoscale.triggers import QueueLoad, UpDecision
from offload.queue.keyspace import overflow_reach
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

DEFAULT_BOOT = 180.0  # seconds a boot is expected to take until the queue's own are measured
REACH_TTL_MIN_S = 60.0  # the reach lasts 3 evaluations, at least this long: then claims go by waiting time only
NEVER_MS = 1e12  # a fleet that starts nothing more: each job after the idle machines' waits "forever"
PRIOR_RUNS = 5  # runs `overflow.run_time` weighs as: half the estimate at 5 measured, a tenth at 45


def parse_samples(text: str) -> list[overflow.Sample]:
    out: list[overflow.Sample] = []
    for part in filter(None, text.split(",")):
        t, _, n = part.partition(":")
        try:
            out.append((float(t), int(n)))
        except ValueError:
            return []  # a damaged record: measure afresh rather than fail the evaluation
    return out


def expected_boot(ev: Evaluation) -> float:
    if ev.state.boot_ewma > 0:
        return ev.state.boot_ewma
    trig = cost_trigger(ev.cfg)
    return trig.boot_time if trig is not None else DEFAULT_BOOT


async def runs_measured(store: QueueStore, queue: str) -> tuple[float, int]:
    """(the queue's mean run time in seconds, runs it is measured on); (0, 0) before any finished."""
    _, count, total_ms = (await store.histograms(queue)).get("run", ([], 0, 0))
    return (total_ms / count / 1000 if count else 0.0), count


def with_prior(measured: float, count: int, prior: float | None) -> float:
    """The run time to count on: the measured mean, with the prior (`overflow.run_time`) weighing as PRIOR_RUNS
    runs, so the first one or two runs (a cold model's first load, one long job) do not set the rate alone."""
    if prior is None:
        return measured
    return (prior * PRIOR_RUNS + measured * count) / (PRIOR_RUNS + count)


async def expected_run(store: QueueStore, queue: str, flow: Overflow) -> float:
    """The run time the sizing and the overflow router count on, seconds (0: none measured and no prior)."""
    return with_prior(*await runs_measured(store, queue), flow.run_time)


async def overflow_up(
    redis: RedisClient, store: QueueStore, ev: Evaluation, load: QueueLoad, active: list[Instance], up: UpDecision
) -> UpDecision:
    """The fleet's count for a queue with overflow: its base load, and machines the waiting work justifies."""
    cfg, flow, now = ev.cfg, ev.cfg.overflow, ev.now
    assert flow is not None
    samples = overflow.keep_samples(parse_samples(ev.state.arrivals), now, load.enqueued, flow.window)
    await ev.state.save(redis, ev.queue, arrivals=",".join(f"{t:.3f}:{n}" for t, n in samples))
    run_s = await expected_run(store, ev.queue, flow)
    base, buckets = overflow.base_load(samples, now, run_s, flow)
    boot = expected_boot(ev)
    booting = [i.created_at + boot - now for i in active if i.status in ("provisioning", "booting")]
    serving = len(active) - len(booting)
    rate = 60 / run_s if run_s > 0 else 0.0
    idle = sum(1 for i in active if i.status == "running" and i.worker_id and i.in_flight == 0)  # not the
    # queue's in-flight count: overflow's jobs are in flight too
    have = overflow.capacity(idle, serving, rate, booting, flow.after)
    await publish_reach(redis, ev.queue, have, idle, flow.after, run_s, max(3 * cfg.poll_interval, REACH_TTL_MIN_S))
    burst = overflow.burst_machines(load.pending, have, rate, boot, flow.after)
    sized = overflow.size(base, buckets, burst, len(active), cfg.limit, flow)
    floor = max(up.floor, min(sized.floor, cfg.limit))
    return UpDecision(
        target=max(sized.target, floor),
        reasons=[
            sized.why,
            f"overflow: the fleet starts {have:.0f} waiting job(s) within {flow.after:g}s; later ones go to "
            + ", ".join(flow.backends),
            *[r for r in up.reasons if r.startswith(("schedule", "min_workers"))],
        ],
        demand=burst > 0,
        floor=floor,
    )


async def publish_reach(
    redis: RedisClient, queue: str, reach: float, idle: int, after: float, run_s: float, ttl_s: float
) -> None:
    """What the overflow worker's claims read (pick.lua): the fleet starts the first `reach` ready jobs within
    `after`, the first `idle` at once and the rest about evenly over `after`; a job runs `run_s`."""
    skip = max(int(reach), 0)
    per_ms = after * 1000 / (reach - idle) if reach - idle > 1e-9 else NEVER_MS
    pipe = redis.pipeline(transaction=False)
    pipe.hset(
        overflow_reach(queue),
        mapping={
            "skip": skip,
            "idle": idle,
            "per_ms": f"{per_ms:.3f}",
            "run_ms": round(run_s * 1000),
            "after_ms": round(after * 1000),
        },
    )
    pipe.pexpire(overflow_reach(queue), round(ttl_s * 1000))
    await pipe.execute()
