"""One evaluation of a queue with overflow backends: measure its arrivals, size its fleet (overflow.py), and tell
the overflow worker's claims how far the fleet reaches (`publish_reach`).

The arrivals are the queue's `enqueued` total sampled each evaluation and kept in its state for one window (so a
new leader continues the same measurement); the mean run time is the store's run histogram, blended with the
block's `run_time` (a prior) while few runs are measured, so the first burst can count on machines. The count
replaces the scale-up triggers' (a burst is overflow's), except that min_workers and schedules still hold a floor.
"""

from __future__ import annotations

from offload.autoscale import overflow, predict, scale_in
from offload.autoscale.evaluation import Evaluation
from offload.autoscale.instances import Instance
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
    trig = scale_in.cost_trigger(ev.cfg)
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
    """The fleet's count for a queue with overflow: its base load, machines the waiting work justifies, and with
    `predict` machines a boot ahead of a burst that recurred."""
    cfg, flow, now = ev.cfg, ev.cfg.overflow, ev.now
    assert flow is not None
    seen = parse_samples(ev.state.arrivals)
    samples = overflow.keep_samples(seen, now, load.enqueued, flow.window)
    profile = learn(ev, seen, load.enqueued)
    await ev.state.save(
        redis,
        ev.queue,
        arrivals=",".join(f"{t:.3f}:{n}" for t, n in samples),
        **({} if profile is None else {"profile": predict.dump(profile)}),
    )
    run_s = ev.run_s = await expected_run(store, ev.queue, flow)  # (scale-down's hold reads it: scale_in.py)
    base, buckets = overflow.base_load(samples, now, run_s, flow)
    boot = expected_boot(ev)
    booting = [i.created_at + boot - now for i in active if i.status in ("provisioning", "booting")]
    serving = len(active) - len(booting)
    rate = 60 / run_s if run_s > 0 else 0.0
    idle = sum(1 for i in active if i.status == "running" and i.worker_id and i.in_flight == 0)  # not the
    # queue's in-flight count: overflow's jobs are in flight too
    have = overflow.capacity(idle, serving, rate, booting, flow.after)
    await publish_reach(redis, ev.queue, have, idle, flow.after, run_s, max(3 * cfg.poll_interval, REACH_TTL_MIN_S))
    tail = scale_in.idle_tail(cfg, ev.state, run_s)
    ages = overflow.waiting_ages(samples, now, load.pending, load.oldest_age)
    # the arrivals of the last bucket keep one more machine than the fleet has busy at least keep_busy
    lasting = overflow.recent_load(samples, now, run_s, flow.span) - len(active) >= flow.keep_busy
    cost = overflow.BurstCost(boot, flow.keep_busy, tail, lasting)
    burst = overflow.burst_for_ages(ages, idle, serving, rate, booting, flow.after, cost)
    sized = overflow.size(base, buckets, burst, len(active), cfg.limit, flow, run_s)
    pre, pre_why = 0, ""
    if flow.predict is not None and profile is not None and run_s > 0:
        fc = predict.forecast(profile, now, boot + cfg.poll_interval, flow.predict)
        pre, pre_why = prerent(fc, base, sized.floor, run_s, tail, ev)
    floor = max(up.floor, min(max(sized.floor, pre), cfg.limit))
    return UpDecision(
        target=max(sized.target, pre, floor),
        reasons=[
            sized.why,
            *([pre_why] if pre_why else []),
            f"overflow: the fleet starts {have:.0f} waiting job(s) within {flow.after:g}s; later ones go to "
            + ", ".join(flow.backends),
            *[r for r in up.reasons if r.startswith(("schedule", "min_workers"))],
        ],
        demand=burst > 0,
        floor=floor,
    )


def learn(ev: Evaluation, seen: list[overflow.Sample], enqueued: int) -> predict.Profile | None:
    """The queue's arrival profile with the jobs enqueued since the last evaluation counted now (None: no
    `predict`). Jobs counted across a gap longer than a bin (no evaluation meanwhile) or a reset store are not
    placed: when they came is not known."""
    flow = ev.cfg.overflow
    if flow is None or flow.predict is None:
        return None
    last = seen[-1] if seen else None
    fresh = last is not None and 0 <= ev.now - last[0] <= max(flow.predict.bin, 2 * ev.cfg.poll_interval)
    arrived = max(0, enqueued - last[1]) if fresh and last is not None else 0
    return predict.record(predict.parse(ev.state.profile), ev.now, arrived, flow.predict)


def prerent(
    fc: predict.Forecast | None, base: float, keep: int, run_s: float, tail: float, ev: Evaluation
) -> tuple[int, str]:
    """(the fleet's count, why) for a forecast burst: the `keep` base machines and those that pay for what of it
    neither the base load's own arrivals over the lead (`base` machines' worth) nor the base machines' spare
    within `after` explain; (0, "") for none. Counted from the base alone, not the fleet, so machines already
    pre-rented keep the count until the burst's time has passed. A pre-rented machine bills its boot and a
    poll's wait besides its work and its idle tail."""
    flow = ev.cfg.overflow
    if fc is None or flow is None or flow.predict is None or run_s <= 0:
        return 0, ""
    per = 1 + flow.after / run_s  # a machine ready as the burst lands starts one at once, then one a run
    wait = expected_boot(ev) + ev.cfg.poll_interval  # the lead: rented this long before the burst
    spare = max(0.0, keep * per - base * flow.after / run_s)
    excess = fc.jobs - base * wait / run_s - spare
    overhead = wait + tail
    n = min(overflow.machines_for(excess, per, run_s, flow.keep_busy, overhead), ev.cfg.limit - keep)
    if n <= 0:
        return 0, ""
    when = predict.phase_text(fc.at, flow.predict.period)
    return keep + n, (
        f"pre-rent: {n} machine(s) for the burst of {fc.jobs} job(s) seen at {when} "
        f"in each of the last {flow.predict.recur} period(s) of {flow.predict.period / 60:g} min"
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
