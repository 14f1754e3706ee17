"""Scale-up and scale-down triggers: pure functions of the queue's load, the instances and the clock.

Counting rules:
- `active` instances (provisioning, booting, running) are capacity; draining ones are not.
- load ignores a paused queue (its jobs would not be claimed, so renting for them only burns money).
- `jobs_per_worker` ramps in one step: the desired count is ceil((ready + in flight) / jobs_per_worker), as
  KEDA's and RunPod's request-count scalers do. It is an absolute count, so machines still booting are part of
  it and nothing stacks beyond it.
- queue_depth and latency add one instance per evaluation, and only while nothing is booting: a booting
  machine will take work soon, so adding another each poll would stack rentals for one burst.
- schedules set a floor (`workers`) for `duration` after each cron fire; a fired scale-down schedule ends the
  scale-up windows that opened before it and retires the instances it saw (drain.py).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from offload.autoscale.instances import Instance
from offload.autoscale.settings import AutoscaleSettings, Idle, Latency, NoWorkers, QueueDepth


class Trigger(enum.StrEnum):
    """The names a trigger goes by in a block's `trigger:` field and at the head of the reasons it gives."""

    NO_WORKERS = "no_workers"
    QUEUE_DEPTH = "queue_depth"
    LATENCY = "latency"
    JOBS_PER_WORKER = "jobs_per_worker"
    SCHEDULE = "schedule"
    MIN_WORKERS = "min_workers"
    IDLE = "idle"


@dataclass
class QueueLoad:
    pending: int  # ready jobs (0 when the queue is paused)
    oldest_age: float | None  # seconds the oldest ready job has waited
    live_workers: int  # workers serving the queue and taking new work: rented or started by hand
    paused: bool = False
    in_flight: int = 0  # jobs being worked on
    enqueued: int = 0  # the queue's total jobs enqueued ever (a queue with overflow measures arrivals by it)


@dataclass
class UpDecision:
    target: int
    reasons: list[str] = field(default_factory=list)
    held: bool = False  # a trigger fired but a booting instance holds the count
    demand: bool = False  # some scale-up trigger fired (scale-down waits)
    floor: int = 0  # what scale-down may not go below: min_workers, schedules


def schedule_floor(cfg: AutoscaleSettings, now: float, last_down_fire: float) -> tuple[int, list[str]]:
    floor, reasons = 0, []
    up, _ = cfg.crons()
    for cron, trig in up:
        hold = trig.duration or cfg.poll_interval
        fire = cron.last_fire(now, hold)
        if fire is not None and now - fire < hold and fire > last_down_fire:
            floor = max(floor, trig.workers)
            reasons.append(f"{Trigger.SCHEDULE} '{trig.cron}' holds {trig.workers}")
    return floor, reasons


def scale_up(
    cfg: AutoscaleSettings,
    load: QueueLoad,
    active: list[Instance],
    now: float,
    last_down_fire: float = 0.0,
    boot_hold: float | None = None,
) -> UpDecision:
    """`boot_hold`: seconds a booting machine holds queue_depth and latency (safety.boot_hold; None: until it
    boots or boot_timeout judges it)."""
    count = len(active)
    hold = cfg.boot_timeout if boot_hold is None else boot_hold
    booting = any(
        i.status in ("provisioning", "booting") and not (i.created_at and now - i.created_at >= hold) for i in active
    )
    want, reasons, held, demand = count, [], False, False
    bump = False
    for trig in cfg.scale_up:
        if isinstance(trig, NoWorkers) and load.pending > 0 and load.live_workers == 0:
            demand = True
            want = max(want, 1)
            reasons.append(
                f"{Trigger.NO_WORKERS}: {load.pending} pending, no live worker"
                + (f" ({count} instance(s) not serving yet)" if count else "")
            )
        elif isinstance(trig, QueueDepth) and load.pending > trig.threshold:
            demand = True
            reasons.append(f"{Trigger.QUEUE_DEPTH}: {load.pending} pending > {trig.threshold}")
            bump = True
        elif isinstance(trig, Latency) and load.oldest_age is not None and load.oldest_age > trig.max_latency:
            demand = True
            reasons.append(f"{Trigger.LATENCY}: oldest waited {load.oldest_age:.0f}s > {trig.max_latency:.0f}s")
            bump = True
    if bump:
        if booting:
            held = True
        else:
            want = max(want, count + 1)
    if cfg.jobs_per_worker and load.pending > 0:
        ramp = math.ceil((load.pending + load.in_flight) / cfg.jobs_per_worker)
        if ramp > count:
            demand = True
            want = max(want, ramp)
            reasons.append(
                f"{Trigger.JOBS_PER_WORKER}: {load.pending} ready + {load.in_flight} in flight"
                f" / {cfg.jobs_per_worker} = {ramp}"
            )
    floor, why = schedule_floor(cfg, now, last_down_fire)
    if cfg.min_workers > want:
        reasons.append(f"{Trigger.MIN_WORKERS} {cfg.min_workers}")
    want = max(want, floor, cfg.min_workers)
    reasons += why if floor > count else []
    return UpDecision(
        target=min(want, cfg.limit),
        reasons=reasons,
        held=held,
        demand=demand,
        floor=min(max(floor, cfg.min_workers), cfg.limit),
    )


def idle_timeout(cfg: AutoscaleSettings) -> float | None:
    found = [t.timeout for t in cfg.scale_down if isinstance(t, Idle)]
    return min(found) if found else None


def idle_since(inst: Instance) -> float:
    """When the instance's worker last started or finished a task (or became ready, if it never had one)."""
    return max(inst.last_task_at, inst.ready_at)


def down_fire(cfg: AutoscaleSettings, now: float, lookback: float) -> float | None:
    """The latest scale-down schedule fire within `lookback` seconds, if any."""
    _, down = cfg.crons()
    fires = [f for cron in down if (f := cron.last_fire(now, lookback)) is not None]
    return max(fires) if fires else None
