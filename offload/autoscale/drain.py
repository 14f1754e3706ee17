"""Scaling down: which machines drain, and draining itself (and its cancellation when load returns).

- `idle`: a running instance whose worker started or finished nothing for the timeout, oldest first, down to the
  floor (min_workers, a scale-up schedule's window).
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

import logging
from typing import TYPE_CHECKING, Any

from offload.autoscale.instances import Instance, StaleState, log_event
from offload.autoscale.providers import Machine, ProviderError
from offload.autoscale.safety import spared
from offload.autoscale.state import QueueState
from offload.autoscale.triggers import down_fire, idle_since, idle_timeout

if TYPE_CHECKING:
    from offload.autoscale.scaler import Autoscaler
    from offload.autoscale.settings import AutoscaleSettings

log = logging.getLogger("offload.autoscale")
CANCELLABLE = ("idle", "schedule")  # drains that load coming back may cancel (not: disabled, spend cap)


async def scale_down(
    a: Autoscaler,
    queue: str,
    cfg: AutoscaleSettings,
    qs: QueueState,
    active: list[Instance],
    floor: int,
    listings: dict[str, tuple[bool, list[Machine]]],
    now: float,
    plan: dict[str, Any],
    *,
    mode: str = "",
) -> int:
    """Drain what the scale-down rules allow above `floor`; returns how many began draining. `mode`: "" (the
    triggers), "disabled" or "spend cap" (everything goes)."""
    fire = down_fire(cfg, now, max(cfg.poll_interval * 2, 120.0))
    if fire is not None and fire > qs.last_down_fire:
        seen = ",".join(i.id for i in active if i.created_at <= fire)
        await qs.save(a.redis, queue, last_down_fire=fire, down_targets=seen)
        await log_event(
            a.redis,
            now,
            "schedule",
            f"{queue}: scale-down schedule fired ({len(active)} active, floor {floor})",
            queue=queue,
        )
    ids = {i.id for i in active}
    targets = qs.targets() & ids
    if targets != qs.targets():
        await qs.save(a.redis, queue, down_targets=",".join(sorted(targets)))
    if mode:
        reason, candidates = mode, sorted(active, key=lambda i: (i.status == "running", i.created_at))
    elif targets:
        reason = "schedule"
        candidates = sorted((i for i in active if i.id in targets), key=lambda i: (i.status == "running", i.created_at))
    else:
        reason, timeout = "idle", idle_timeout(cfg)
        candidates = (
            []
            if timeout is None
            else sorted(
                (i for i in active if i.status == "running" and now - idle_since(i) >= timeout),
                key=lambda i: i.created_at,
            )
        )
    excess = len(active) - floor
    drained, kept = 0, {}
    for inst in candidates:
        if excess <= 0:
            break
        why = "protected" if inst.protected else (None if mode else spared(inst, now, a.server.recent_task))
        if why is not None:
            kept[inst.id] = why
            continue
        if await drain(a, inst, listings, now, reason):
            drained += 1
            excess -= 1
    if drained or kept:
        plan["scale_down"] = {"reason": reason, "floor": floor, "draining": drained, "spared": kept}
    return drained


async def drain(
    a: Autoscaler, inst: Instance, listings: dict[str, tuple[bool, list[Machine]]], now: float, reason: str
) -> bool:
    """Stop the worker claiming, let it finish what it has; reconcile destroys it once it holds nothing."""
    try:
        await a.instances.update(inst, a.leader.token, now, status="draining", drain_at=now, drain_reason=reason)
    except StaleState:
        return False
    if inst.worker_id:
        await a.workers.set_draining(inst.worker_id)
    _, machines = await a.listing(inst.provider, listings)
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
        a.redis, now, "draining", f"{inst.id}: draining before teardown ({reason})", instance=inst.id, queue=inst.queue
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
            "undrained",
            f"{inst.id}: load came back; the drain is cancelled",
            instance=inst.id,
            queue=inst.queue,
        )
        back += 1
    return back
