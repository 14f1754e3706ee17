"""One evaluation of a queue with overflow backends: measure its arrivals, size its fleet (overflow.py).

The arrivals are the queue's `enqueued` total sampled each evaluation and kept in its state for one window (so a
new leader continues the same measurement); the mean run time is the store's run histogram. The count replaces
the scale-up triggers' (a burst is overflow's), except that min_workers and schedules still hold a floor.
"""

from __future__ import annotations

from offload.autoscale import overflow
from offload.autoscale.evaluation import Evaluation
from offload.autoscale.instances import Instance
from offload.autoscale.scale_in import cost_trigger
from offload.autoscale.triggers import QueueLoad, UpDecision
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

DEFAULT_BOOT = 180.0  # seconds a boot is expected to take until the queue's own are measured


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


async def mean_run(store: QueueStore, queue: str) -> float:
    """The queue's mean run time, seconds (0: none finished yet)."""
    _, count, total_ms = (await store.histograms(queue)).get("run", ([], 0, 0))
    return total_ms / count / 1000 if count else 0.0


async def overflow_up(
    redis: RedisClient, store: QueueStore, ev: Evaluation, load: QueueLoad, active: list[Instance], up: UpDecision
) -> UpDecision:
    """The fleet's count for a queue with overflow: its base load, and machines the waiting work justifies."""
    cfg, flow, now = ev.cfg, ev.cfg.overflow, ev.now
    assert flow is not None
    samples = overflow.keep_samples(parse_samples(ev.state.arrivals), now, load.enqueued, flow.window)
    await ev.state.save(redis, ev.queue, arrivals=",".join(f"{t:.3f}:{n}" for t, n in samples))
    run_s = await mean_run(store, ev.queue)
    base, buckets = overflow.base_load(samples, now, run_s, flow)
    boot = expected_boot(ev)
    booting = [i.created_at + boot - now for i in active if i.status in ("provisioning", "booting")]
    serving = len(active) - len(booting)
    rate = 60 / run_s if run_s > 0 else 0.0
    idle = sum(1 for i in active if i.status == "running" and i.worker_id and i.in_flight == 0)  # not the
    # queue's in-flight count: overflow's jobs are in flight too
    have = overflow.capacity(idle, serving, rate, booting, flow.after)
    burst = overflow.burst_machines(load.pending, have, rate, boot, flow.after)
    sized = overflow.size(base, buckets, burst, len(active), cfg.limit, flow)
    floor = max(up.floor, min(sized.floor, cfg.limit))
    return UpDecision(
        target=max(sized.target, floor),
        reasons=[sized.why, *[r for r in up.reasons if r.startswith(("schedule", "min_workers"))]],
        demand=burst > 0,
        floor=floor,
    )
