"""Scaling down: which machines drain, and draining itself (and its cancellation when load returns).

- `idle`: a running instance whose worker started or finished nothing for the timeout, oldest first, down to the
  floor (min_workers, a scale-up schedule's window). With the `cost` trigger the timeout is what scale_in.py
  reckons from the queue's gaps and boot times (0: at once), and the reckoning joins the decision's reasons.
- a scale-down `schedule` retires the instances that existed when it fired, down to the floor. The set is fixed
  at the fire: what is spared then (busy, protected) is retired once it may be, and a machine rented after the
  fire is never its target. So a schedule that spares something can never start a rent-and-drain loop against an
  up schedule's floor.
- autoscaling switched off (`enabled: false`) drains everything, busy machines too (they finish the job they
  have, then go); the spend cap drains the capped fleet (busy machines too: reconcile destroys them after one
  poll, their jobs back without using an attempt).
- the triggers never drain a busy worker, one that touched a task in the last 30 s, or a protected one
  (safety.spared); switching off and the spend cap spare only protected ones.

Draining marks the instance and its worker's registry record; the server then hands the worker no new jobs, and
reconcile destroys the machine once it holds nothing. When load returns first, an idle draining instance is
made running again instead of renting a new machine.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

from offload.autoscale.evaluation import Decision, Evaluation, ScaleDownOutcome
from offload.autoscale.instances import EventKind, Instance, StaleState, log_event
from offload.autoscale.providers import ProviderError
from offload.autoscale.safety import RECENT_TASK, spared
from offload.autoscale.scale_in import cost_trigger, hold
from offload.autoscale.triggers import down_fire, idle_since, idle_timeout

if TYPE_CHECKING:
    from offload.autoscale.scaler import Autoscaler

log = logging.getLogger("offload.autoscale")


class DrainReason(enum.StrEnum):
    """Why an instance drains (stored as its `drain_reason`, shown by status)."""

    IDLE = "idle"
    SCHEDULE = "schedule"
    DISABLED = "disabled"  # autoscaling switched off: everything goes
    SPEND_CAP = "spend cap"  # the capped fleet goes, busy machines too


CANCELLABLE = (DrainReason.IDLE, DrainReason.SCHEDULE)  # drains that load coming back may cancel


def _oldest_first(insts: list[Instance]) -> list[Instance]:
    """Machines not yet serving go first, then the oldest."""
    return sorted(insts, key=lambda i: (i.status == "running", i.created_at))


async def schedule_targets(a: Autoscaler, ev: Evaluation, active: list[Instance]) -> set[str]:
    """Record a new scale-down schedule fire (the instances it saw become its targets); return the targets
    still active. Called every evaluation, before the triggers are read: a fire while a scale-up trigger holds
    the fleet is kept, and its targets drain at the first evaluation that may scale down."""
    qs, cfg, now = ev.state, ev.cfg, ev.now
    fire = down_fire(cfg, now, max(cfg.poll_interval * 2, 120.0))
    if fire is not None and fire > qs.last_down_fire:
        seen = ",".join(i.id for i in active if i.created_at <= fire)
        await qs.save(a.redis, ev.queue, last_down_fire=fire, down_targets=seen)
        await log_event(
            a.redis,
            now,
            EventKind.SCHEDULE,
            f"{ev.queue}: scale-down schedule fired ({len(active)} active, {len(qs.targets())} to retire)",
            queue=ev.queue,
        )
    targets = qs.targets() & {i.id for i in active}
    if targets != qs.targets():
        await qs.save(a.redis, ev.queue, down_targets=",".join(sorted(targets)))
    return targets


def _idle_timeout(ev: Evaluation, decision: Decision, active: list[Instance]) -> float | None:
    """The idle timeout: the idle trigger's, or the cost trigger's reckoning (added to the decision's reasons)."""
    trig = cost_trigger(ev.cfg)
    if trig is None:
        return idle_timeout(ev.cfg)
    price = max((i.price for i in active), default=0.0)
    verdict = hold(ev.cfg, trig, ev.state, price, ev.run_s)
    if active:
        decision.reasons.append(verdict.why)
    return max(verdict.seconds, RECENT_TASK)  # a machine that just finished a task is spared anyway


def _candidates(
    ev: Evaluation, decision: Decision, active: list[Instance], targets: set[str], mode: DrainReason | None
) -> tuple[DrainReason, list[Instance]]:
    """Why and which instances may drain, in the order they go."""
    if mode:
        return mode, _oldest_first(active)
    if targets:
        return DrainReason.SCHEDULE, _oldest_first([i for i in active if i.id in targets])
    timeout = _idle_timeout(ev, decision, active)
    if timeout is None:
        return DrainReason.IDLE, []
    idle = [i for i in active if i.status == "running" and ev.now - idle_since(i) >= timeout]
    # rented together: the longer idle first, then the earlier up (not the store's order of their random ids)
    return DrainReason.IDLE, sorted(idle, key=lambda i: (i.created_at, idle_since(i), i.ready_at))


async def scale_down(
    a: Autoscaler, ev: Evaluation, decision: Decision, active: list[Instance], mode: DrainReason | None = None
) -> int:
    """Drain what the scale-down rules allow above the decision's floor; returns how many began draining.
    `mode`: None (the triggers), DISABLED or SPEND_CAP (everything goes)."""
    floor = decision.floor
    targets = ev.state.targets() & {i.id for i in active}
    reason, candidates = _candidates(ev, decision, active, targets, mode)
    excess = len(active) - floor
    drained, kept = 0, {}
    for inst in candidates:
        if excess <= 0:
            break
        why = "protected" if inst.protected else (None if mode else spared(inst, ev.now, a.server.recent_task))
        if why is not None:
            kept[inst.id] = why
            continue
        if await drain(a, ev, inst, reason):
            drained += 1
            excess -= 1
    if drained or kept:
        decision.scale_down = ScaleDownOutcome(reason=reason, floor=floor, draining=drained, spared=kept)
    return drained


async def drain(a: Autoscaler, ev: Evaluation, inst: Instance, reason: DrainReason) -> bool:
    """Stop the worker claiming, let it finish what it has; reconcile destroys it once it holds nothing."""
    now = ev.now
    try:
        await a.instances.update(inst, a.leader.token, now, status="draining", drain_at=now, drain_reason=reason)
    except StaleState:
        return False
    if inst.worker_id:
        await a.workers.set_draining(inst.worker_id)
    _, machines = await a.listing(inst.provider, ev.listings)
    machine = next((m for m in machines if m.provider_id == inst.provider_id), None)
    if machine is not None:
        try:
            provider = await a.provider(inst.provider)
            await a.leader.check()
            a.provider_calls += 1
            await provider.drain(machine)
        except ProviderError as exc:
            log.warning("drain signal to %s failed: %s", inst.id, a.why(exc))
    await log_event(
        a.redis,
        now,
        EventKind.DRAINING,
        f"{inst.id}: draining before teardown ({reason})",
        instance=inst.id,
        queue=inst.queue,
    )
    return True


async def cancel(a: Autoscaler, draining: list[Instance], n: int, now: float) -> int:
    """Load came back: make up to `n` idle draining instances (not yet torn down) running again rather than
    renting new ones. A busy draining one stays draining: it could not take the new work anyway."""
    back = 0
    for inst in sorted(draining, key=lambda i: -i.drain_at):
        if back >= n:
            break
        if inst.teardown or inst.drain_reason not in CANCELLABLE or inst.in_flight > 0 or not inst.worker_id:
            continue
        try:
            await a.instances.update(
                inst, a.leader.token, now, status="running", drain_at=0.0, drain_reason="", last_task_at=now
            )
        except StaleState:
            continue
        await a.workers.set_draining(inst.worker_id, False)
        await log_event(
            a.redis,
            now,
            EventKind.UNDRAINED,
            f"{inst.id}: load came back; the drain is cancelled",
            instance=inst.id,
            queue=inst.queue,
        )
        back += 1
    return back
