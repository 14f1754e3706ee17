"""Scale-in by cost (`scale_down: [{trigger: cost}]`): how long an idle machine is kept, from what idling and a
re-rent cost.

Keeping an idle machine through a gap costs gap x price; releasing it and renting again when work returns costs
a boot: boot time x price (the re-rented machine bills while it boots). So with the queue's expected gap under
its boot time an idle machine is kept, but no longer than one boot time (past that, the idling has already cost
more than a re-rent, whatever comes next); with the expected gap at or over the boot time it is released at once
(the safety rules still spare it for 30 s after its last task). Until a gap has been seen, the idle timeout holds.

The gaps are learnt from the queue's load each evaluation: it runs out of work (nothing ready or in flight) at one
evaluation, and has work again at a later one; the boot times from each machine's create-to-ready time. Both are
exponentially weighted and kept in the queue's state in Redis, so a new leader continues them.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.autoscale.safety import RECENT_TASK
from offload.autoscale.settings import AutoscaleSettings, Cost
from offload.autoscale.state import QueueState
from offload.autoscale.triggers import QueueLoad, idle_timeout
from offload.redis_client import RedisClient

RELEASE_RUNS = 2.0  # overflow patience (`after`) of this many runs: a job that finds the fleet busy waits for it
WEIGHT = 0.3  # the newest gap's (or boot's) share of the average: a few bursts turn it round
FALLBACK_TIMEOUT = 600.0  # the default idle timeout, when the block names the cost trigger and no idle one


@dataclass(frozen=True)
class Hold:
    """How long an idle machine may stay (seconds idle before it drains) and why, for the decision's reasons."""

    seconds: float
    why: str


def cost_trigger(cfg: AutoscaleSettings) -> Cost | None:
    return next((t for t in cfg.scale_down if isinstance(t, Cost)), None)


def _mean(old: float, new: float) -> float:
    return new if old <= 0 else WEIGHT * new + (1 - WEIGHT) * old


async def observe(redis: RedisClient, queue: str, qs: QueueState, load: QueueLoad, now: float) -> None:
    """Note when the queue runs out of work and, when work returns, fold that gap into the average."""
    busy = load.pending > 0 or load.in_flight > 0
    if busy and qs.quiet_since > 0:
        gap = now - qs.quiet_since
        await qs.save(redis, queue, quiet_since=0.0, gap_ewma=_mean(qs.gap_ewma, gap), gaps=qs.gaps + 1)
    elif not busy and qs.quiet_since <= 0:
        await qs.save(redis, queue, quiet_since=now)


async def boot_seen(redis: RedisClient, queue: str, qs: QueueState, seconds: float) -> None:
    """A machine of the queue became ready `seconds` after it was rented: fold it into the measured boot time."""
    if seconds > 0:
        await qs.save(redis, queue, boot_ewma=_mean(qs.boot_ewma, seconds))


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _dollars(seconds: float, price: float) -> str:
    return f" (${seconds / 3600 * price:.3f})" if price > 0 else ""


def hold(cfg: AutoscaleSettings, trig: Cost, qs: QueueState, price: float, run_s: float = 0.0) -> Hold:
    """How long idle machines stay under the cost trigger; `price` is $/h of one machine (0: unknown), `run_s`
    the queue's expected run time (0: not known)."""
    if (patient := _patient(cfg, run_s)) is not None:
        return Hold(0.0, patient)
    timeout = idle_timeout(cfg) or FALLBACK_TIMEOUT
    if qs.gaps <= 0 or qs.gap_ewma <= 0:
        return Hold(timeout, f"cost: no gap between bursts seen yet; idle timeout {_minutes(timeout)}")
    boot, measured = (qs.boot_ewma, "measured") if qs.boot_ewma > 0 else (trig.boot_time, "configured")
    gap = qs.gap_ewma
    numbers = (
        f"expected gap {_minutes(gap)}{_dollars(gap, price)} idle vs re-rent {_minutes(boot)} {measured} "
        f"boot{_dollars(boot, price)}"
    )
    if gap < boot:
        return Hold(boot, f"cost: keep idle machines up to {_minutes(boot)}: {numbers}")
    return Hold(0.0, f"cost: release idle machines at once: {numbers}")


def _patient(cfg: AutoscaleSettings, run_s: float) -> str | None:
    """Why idle machines above the base go at once in a queue with overflow whose jobs wait `after` of at least
    RELEASE_RUNS runs (None: they do not). A job that finds every machine busy then waits for one to finish (one
    does within a run) rather than overflowing, so an idle machine held for it buys nothing: the base sizing
    (overflow.py) keeps the machines the arrivals need, the floor no drain goes under."""
    flow = cfg.overflow
    if flow is None or run_s <= 0 or flow.after < RELEASE_RUNS * run_s:
        return None
    return (
        f"cost: release idle machines above the base at once: a job that finds the fleet busy waits up to "
        f"{_minutes(flow.after)} ({flow.after / run_s:.1f} runs of {run_s:.0f}s) for a machine to finish"
    )


def idle_tail(cfg: AutoscaleSettings, qs: QueueState, run_s: float = 0.0) -> float:
    """Seconds a machine that ran out of work still bills before it drains (the cost trigger's hold, else the idle
    timeout; the safety rules' spare at least): what renting one for a burst costs after the burst."""
    trig = cost_trigger(cfg)
    timeout = hold(cfg, trig, qs, 0.0, run_s).seconds if trig is not None else idle_timeout(cfg)
    return max(FALLBACK_TIMEOUT if timeout is None else timeout, RECENT_TASK)
