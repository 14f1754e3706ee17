"""Bring instance records in line with what the provider and the worker registry report, and carry out the
teardown journal. Split from the scaler so the decisions (scaler.py) and the bookkeeping (here) read apart.

Failure handling, in order of evidence:
- the provider reports the machine failed / stopped / terminated, or it vanished (pre-empted): destroy it
  anyway (a stopped machine still bills for disk) and mark it failed. It was taken away, which is not the jobs'
  fault: its worker's jobs go back to the queue without using up an attempt (QueueStore.forgive). If it never
  had a ready worker and the provider says *failed*, the host could not start the container: a boot failure;
- no worker became ready within boot_timeout (a RunPod pod stuck in STARTING too): destroy, mark failed, a boot
  failure. A boot failure avoids the host 24 h; the queue pauses only once several hosts failed since the last
  healthy boot (safety.py: the image is then probably broken; the first ready worker resets it);
- the worker stopped heart-beating for 5 minutes: destroy, mark failed;
- a draining machine whose worker is still busy after drain_timeout: destroy (a hung handler must not bill
  forever); one drained for the spend cap goes after one poll interval, its jobs back uncounted.
A protected instance is not destroyed for the failures above while the machine exists (`protected_failures:
keep`, the default): it is marked failed with `teardown=kept`, alerted, and destroyed once unprotected.
Every failure raises an alert (once per cooldown per subject).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from offload.autoscale import keyspace, scale_in
from offload.autoscale.alert_settings import AlertKind
from offload.autoscale.drain import DrainReason
from offload.autoscale.instances import EventKind, Instance, StaleState, log_event
from offload.autoscale.providers import Machine, MachineState, NotOurs, Provider, ProviderError
from offload.autoscale.safety import (
    FAILED_OF_WINDOW,
    HOST_AVOID,
    HOSTS_FOR_PAUSE,
    HOSTS_FOR_PAUSE_KNOWN_GOOD,
    PROVISION_GRACE,
    TEARDOWN_ALERT_AFTER,
    boot_backoff,
    host_pause,
)
from offload.autoscale.state import add_cost
from offload.autoscale.workers import WorkerInfo

if TYPE_CHECKING:
    from offload.autoscale.evaluation import Evaluation
    from offload.autoscale.scaler import Autoscaler

log = logging.getLogger("offload.autoscale")
DEAD_STATES = (MachineState.FAILED, MachineState.TERMINATED, MachineState.STOPPED)


async def fail(
    a: Autoscaler,
    inst: Instance,
    reason: str,
    now: float,
    *,
    destroy: bool = True,
    keep: bool = False,
    also: dict[str, Any] | None = None,
) -> None:
    """Mark failed and (normally) journal the teardown in the same write, before any provider call. `keep`: the
    instance is protected: failed, but its machine stays (teardown=kept) until it is unprotected. `also`: more
    fields for that write (a new machine's id: recorded and doomed at once, so no crash can leave it unjournaled)."""
    changes: dict[str, Any] = {**(also or {}), "status": "failed", "reason": reason}
    if keep:
        changes.update(teardown="kept", reason=f"{reason}; kept: protected")
    elif destroy:
        changes.update(teardown="pending", teardown_at=now)
    await a.instances.update(inst, a.leader.token, now, **changes)
    await log_event(
        a.redis, now, EventKind.FAILED, f"{inst.id}: {changes['reason']}", instance=inst.id, queue=inst.queue
    )
    log.warning("instance %s (%s) failed: %s", inst.id, inst.queue, changes["reason"])


async def accrue(a: Autoscaler, inst: Instance, now: float) -> None:
    """Add the cost since the last accrual (price x time) to the instance and its queue's spend buckets (the
    mock's in dry-run buckets: it rents nothing)."""
    if not inst.provider_id or inst.teardown == "done" or inst.destroyed_at:
        return
    since = inst.accrued_at or inst.created_at
    if now <= since:
        return
    delta = inst.price * (now - since) / 3600
    await a.instances.update(inst, a.leader.token, now, cost=inst.cost + delta, accrued_at=now)
    await add_cost(a.redis, inst.queue, now, delta, dry_run=inst.provider_type == "mock")


async def _failure(
    a: Autoscaler,
    ev: Evaluation,
    inst: Instance,
    reason: str,
    alert: str,
    *,
    machine_exists: bool = True,
    kind: AlertKind = "autoscale_failure",
) -> None:
    """A failed instance: kept if protected (and its machine still exists), else destroyed; alerted either way."""
    keep = inst.protected and machine_exists and ev.cfg.protected_failures == "keep"
    await fail(a, inst, reason, ev.now, keep=keep)
    verb = "keeping it: it is protected (unprotect it to destroy it)" if keep else "destroying it"
    await a.alerter.alert(
        kind,
        inst.queue if kind == "boot_timeout" else inst.id,
        f"instance {inst.id} ({inst.queue}): {alert}; {verb}",
    )


async def _forgive(a: Autoscaler, inst: Instance, now: float, why: str) -> None:
    """The machine was taken away by the provider (or retired by the spend cap): its worker's jobs go back
    without using up an attempt."""
    if not inst.worker_id:
        return
    released, refunded, revived = await a.store.forgive(inst.queue, inst.worker_id)
    if released or refunded:
        await log_event(
            a.redis,
            now,
            EventKind.FORGIVEN,
            f"{inst.id}: {why}: jobs back without using an attempt "
            f"({released} lease(s) handed back, {refunded} lease expiry(ies) refunded"
            + (f", {revived} revived from dead)" if revived else ")"),
            instance=inst.id,
            queue=inst.queue,
        )


async def sync(
    a: Autoscaler,
    ev: Evaluation,
    inst: Instance,
    machine: Machine | None,
    listed: bool,
    worker: WorkerInfo | None,
    touched: set[str],
) -> None:
    """One instance: correlate its worker, follow the provider's report, enforce timeouts. `machine` is the
    provider's (None: not in its list), `listed` whether the listing answered at all (no conclusions if not)."""
    if inst.teardown == "pending":
        return
    if inst.teardown == "kept":
        await _unkeep(a, inst, ev.now)
        return
    if worker is not None:
        await _correlate(a, ev, inst, worker, touched)
    if not inst.provider_id and not await _adopt(a, ev, inst, machine, listed):
        return
    if await _taken_away(a, ev, inst, machine, listed):
        return
    if machine is not None and machine.state == MachineState.RUNNING and inst.status == "provisioning":
        await a.instances.update(inst, a.leader.token, ev.now, status="booting", booted_at=ev.now)
    if await _timed_out(a, ev, inst):
        return
    if inst.status == "draining":
        await _drained(a, ev, inst, worker)


async def _unkeep(a: Autoscaler, inst: Instance, now: float) -> None:
    """A kept instance that was unprotected: now its teardown is journaled like any other."""
    if inst.protected:
        return
    await a.instances.update(inst, a.leader.token, now, teardown="pending", teardown_at=now)
    await log_event(
        a.redis,
        now,
        EventKind.UNKEPT,
        f"{inst.id}: no longer protected; destroying it",
        instance=inst.id,
        queue=inst.queue,
    )


def _boot_s(inst: Instance, worker: WorkerInfo, now: float) -> float:
    """Rent to the worker's registration (the store's clock, as the instance's), not to this evaluation, which
    sees it up to a poll later: the lead a pre-rent counts on is that boot. 0: unknown."""
    if not inst.created_at:
        return 0.0
    registered = worker.registered_at if inst.created_at <= worker.registered_at <= now else now
    return registered - inst.created_at


async def _correlate(a: Autoscaler, ev: Evaluation, inst: Instance, worker: WorkerInfo, touched: set[str]) -> None:
    """Copy the worker's report onto the instance; its first registration makes the instance running."""
    now = ev.now
    changes: dict[str, Any] = {
        "worker_id": worker.id,
        "in_flight": worker.in_flight,
        "worker_protected": worker.protected,
        "last_seen_at": min(worker.last_heartbeat or now, now),
    }
    if worker.in_flight > 0 or worker.id in touched:
        changes["last_task_at"] = now
    if inst.status in ("provisioning", "booting"):
        changes.update(status="running", ready_at=now)
        await ev.state.booted(a.redis, inst.queue, ev.cfg.boots, now, inst.created_at)
        await ev.state.outcome(a.redis, inst.queue, healthy=True)
        await scale_in.boot_seen(a.redis, inst.queue, ev.state, _boot_s(inst, worker, now))
        await log_event(
            a.redis,
            now,
            EventKind.READY,
            f"{inst.id}: worker {worker.id} registered",
            instance=inst.id,
            queue=inst.queue,
            worker=worker.id,
        )
    await a.instances.update(inst, a.leader.token, now, **changes)
    if inst.status == "draining" and not worker.draining:  # e.g. it registered again: keep it from claiming
        await a.workers.set_draining(worker.id)


async def _adopt(a: Autoscaler, ev: Evaluation, inst: Instance, machine: Machine | None, listed: bool) -> bool:
    """A rental whose create answer was lost: adopt the machine found by its label (True), or fail the record once
    the grace period is over and no such machine appeared (False: nothing more to check now)."""
    now = ev.now
    if machine is not None:
        await a.instances.update(
            inst, a.leader.token, now, provider_id=machine.provider_id, host=machine.host_id or "", **_price(machine)
        )
        await ev.state.provider_ok(a.redis, inst.queue, inst.provider)  # the ambiguous create did go through
        await log_event(
            a.redis,
            now,
            EventKind.ADOPTED,
            f"{inst.id}: found machine {machine.provider_id} by its label",
            instance=inst.id,
            queue=inst.queue,
        )
        return True
    if listed and now - inst.created_at > PROVISION_GRACE:
        reason = "provisioning was interrupted and no machine with its label appeared"
        await fail(a, inst, reason, now)
        await a.alerter.alert(
            "autoscale_failure",
            f"{inst.queue}/{inst.provider}",
            f"queue {inst.queue}: instance {inst.id}: {reason} (the provider's answer to the create was lost)",
        )
    return False


async def _taken_away(a: Autoscaler, ev: Evaluation, inst: Instance, machine: Machine | None, listed: bool) -> bool:
    """The provider reports the machine dead, or it vanished from the list (past the grace period of a fresh
    rental): its jobs come back uncounted, and it is torn down (a draining one) or failed. True if so."""
    young = ev.now - inst.created_at < PROVISION_GRACE  # a fresh rental may not be in the provider's list yet
    if not listed or (machine is None and young) or (machine is not None and machine.state not in DEAD_STATES):
        return False
    state = "vanished (pre-empted or deleted)" if machine is None else f"reported {machine.state.value}"
    if inst.spot and (machine is None or machine.state != MachineState.FAILED):
        state = f"pre-empted the spot machine ({state})"
    detail = f": {a.redact(machine.message)}" if machine is not None and machine.message else ""
    await _forgive(a, inst, ev.now, f"the provider {state}")
    if inst.status == "draining":  # it was going anyway: finish the teardown, not a failure
        await a.instances.update(inst, a.leader.token, ev.now, teardown="pending", teardown_at=ev.now)
        return True
    if machine is not None and machine.state == MachineState.FAILED and not inst.ready_at:
        await boot_failed(a, ev, inst, machine.host_id or inst.host, timed_out=False)
    exists = machine is not None and machine.state != MachineState.TERMINATED
    said = f"the provider {state}{detail}"
    await _failure(a, ev, inst, said, said, machine_exists=exists)
    return True


async def _timed_out(a: Autoscaler, ev: Evaluation, inst: Instance) -> bool:
    """No ready worker within boot_timeout (the next rental backs off), or a running worker's heartbeats stopped:
    the instance fails. True if so."""
    cfg, now = ev.cfg, ev.now
    if inst.status in ("provisioning", "booting") and now - inst.created_at > cfg.boot_timeout:
        pause = await boot_failed(a, ev, inst, inst.host, timed_out=True)
        then = f"the next rental waits {pause:.0f}s" if pause else "its host is avoided; renting goes on"
        await _failure(
            a,
            ev,
            inst,
            f"no worker became ready within boot_timeout ({cfg.boot_timeout:.0f}s)",
            f"no ready worker after {cfg.boot_timeout:.0f}s ({then})",
            kind="boot_timeout",
        )
        return True
    if inst.status != "running":
        return False
    seen = max(inst.last_seen_at, inst.ready_at)
    if now - seen <= a.server.heartbeat_timeout:
        return False
    await _failure(
        a, ev, inst, f"no heartbeat for {now - seen:.0f}s (machine died or hung)", "its worker stopped heart-beating"
    )
    return True


async def _drained(a: Autoscaler, ev: Evaluation, inst: Instance, worker: WorkerInfo | None) -> None:
    """When a draining machine may go: its worker holds nothing (after the settle time), or the spend cap needs
    it gone (after one poll: its jobs come back uncounted), or drain_timeout ran out (a hung handler)."""
    cfg, now = ev.cfg, ev.now
    busy = worker is not None and worker.in_flight > 0
    waited = now - inst.drain_at
    if inst.drain_reason == DrainReason.SPEND_CAP and busy and waited >= cfg.poll_interval and not inst.protected:
        await _forgive(a, inst, now, "the spend cap was reached")
        reason = "destroyed busy: the spend cap was reached"
        await a.instances.update(inst, a.leader.token, now, teardown="pending", teardown_at=now, reason=reason)
        await log_event(a.redis, now, EventKind.SPEND_CAP, f"{inst.id}: {reason}", instance=inst.id, queue=inst.queue)
        await a.alerter.alert(
            "spend_cap_reached",
            inst.id,
            f"instance {inst.id} ({inst.queue}): {reason}; its jobs go back without using an attempt",
        )
    elif busy and waited >= cfg.drain_timeout:
        reason = f"drain_timeout: still busy after draining {waited:.0f}s (a hung handler?)"
        await a.instances.update(inst, a.leader.token, now, teardown="pending", teardown_at=now, reason=reason)
        await log_event(
            a.redis, now, EventKind.DRAIN_TIMEOUT, f"{inst.id}: {reason}", instance=inst.id, queue=inst.queue
        )
        await a.alerter.alert(
            "autoscale_failure", inst.id, f"instance {inst.id} ({inst.queue}): {reason}; destroying it"
        )
    elif not busy and waited >= a.drain_settle:
        await a.instances.update(inst, a.leader.token, now, teardown="pending", teardown_at=now)


async def boot_failed(a: Autoscaler, ev: Evaluation, inst: Instance, host: str, *, timed_out: bool) -> float:
    """A machine that never served: avoid its host a day, and pause the queue's renting only if several hosts
    failed since the last healthy boot (boot timeouts: the boot backoff; a host that could not start the
    container: the short host pause). Returns the pause (0: none, other hosts may boot the image)."""
    qs, now = ev.state, ev.now
    if host:
        await a.redis.zadd(keyspace.avoid(inst.provider), {host: now + HOST_AVOID})
    vouched = qs.vouched(ev.cfg.boots, inst.created_at, now)
    hosts = 0 if vouched else await qs.boot_failed(a.redis, inst.queue, host or f"?{inst.id}", now)
    level = 0
    if hosts:
        failed = await qs.outcome(a.redis, inst.queue, healthy=False)
        if not qs.known_good(ev.cfg.boots, now):
            level = hosts - HOSTS_FOR_PAUSE + 1
        elif hosts >= HOSTS_FOR_PAUSE_KNOWN_GOOD:
            level = failed - FAILED_OF_WINDOW + 1
    pause = 0.0
    if level > 0 and timed_out:
        pause = boot_backoff(ev.cfg.boot_timeout, level)
        await qs.save(a.redis, inst.queue, boot_failures=level, boot_until=now + pause)
    elif level > 0:
        pause = host_pause(level)
        await qs.save(a.redis, inst.queue, host_failures=level, host_until=now + pause)
    what = "gave no ready worker within boot_timeout" if timed_out else "could not start the container"
    if pause:
        then = f"{hosts} hosts failed since the last healthy boot: renting paused {pause:.0f}s"
    elif vouched:
        then = "a machine rented after it booted the image: renting goes on"
    else:
        then = "other hosts may boot the image: renting goes on"
    await log_event(
        a.redis,
        now,
        EventKind.HOST_AVOIDED,
        f"host {host or '?'} {what}; avoided for 24h; {then}",
        instance=inst.id,
        queue=inst.queue,
        host=host,
    )
    return pause


async def avoided_hosts(a: Autoscaler, provider: str, now: float) -> set[str]:
    await a.redis.zremrangebyscore(keyspace.avoid(provider), "-inf", now)
    return {str(h) for h in await a.redis.zrange(keyspace.avoid(provider), 0, -1)}


def _price(machine: Machine) -> dict[str, Any]:
    if machine.price_per_hour:
        return {"price": float(machine.price_per_hour), "price_reported": True}
    return {}


async def teardown(a: Autoscaler, inst: Instance, provider: Provider, machines: dict[str, Machine], now: float) -> bool:
    """Carry out one journaled teardown; True once the provider confirmed (or there was nothing to destroy)."""
    target = inst.provider_id or (machines[inst.label].provider_id if inst.label in machines else "")
    try:
        if target:
            await a.leader.check()
            a.provider_calls += 1
            await provider.destroy(target)
        elif now - inst.created_at <= PROVISION_GRACE:
            return False  # an interrupted create may still surface under its label
    except NotOurs as exc:
        return await _not_ours(a, inst, target, exc, now)
    except ProviderError as exc:
        await a.instances.update(
            inst, a.leader.token, now, teardown_attempts=inst.teardown_attempts + 1, teardown_error=a.why(exc)[:300]
        )
        log.warning(
            "teardown of %s failed (attempt %d, retried next evaluation): %s",
            inst.id,
            inst.teardown_attempts,
            a.why(exc),
        )
        if inst.teardown_attempts >= TEARDOWN_ALERT_AFTER:
            await a.alerter.alert(
                "autoscale_failure",
                inst.id,
                f"instance {inst.id} ({inst.queue}): the provider "
                f"refused to destroy it {inst.teardown_attempts} times ({a.why(exc)}); it may "
                "still be billing, retrying every evaluation",
            )
        return False
    await accrue(a, inst, now)
    final = "terminated" if inst.status == "draining" else inst.status
    try:
        await a.instances.update(inst, a.leader.token, now, status=final, teardown="done", destroyed_at=now)
    except StaleState:
        return False
    await log_event(
        a.redis,
        now,
        EventKind.DESTROYED,
        f"{inst.id}: machine {target or '-'} destroyed ({final})",
        instance=inst.id,
        queue=inst.queue,
    )
    return True


async def _not_ours(a: Autoscaler, inst: Instance, target: str, exc: NotOurs, now: float) -> bool:
    """The provider refused: machine `target` is not labelled as ours, so the record pointed at someone else's
    machine. It is left alone and the record closed (there is nothing of ours to destroy), not called destroyed."""
    said = a.why(exc)
    try:
        await a.instances.update(
            inst,
            a.leader.token,
            now,
            status="terminated" if inst.status == "draining" else inst.status,
            teardown="done",
            destroyed_at=now,
            reason=f"{inst.reason + '; ' if inst.reason else ''}not destroyed: machine {target} is not ours",
        )
    except StaleState:
        return False
    await log_event(a.redis, now, EventKind.REFUSED, said, instance=inst.id, queue=inst.queue)
    await a.alerter.alert(
        "autoscale_failure",
        inst.id,
        f"instance {inst.id} ({inst.queue}): the provider's machine {target} is not ours ({said}); left alone, "
        "the record closed: check the account for a machine of ours under another id",
    )
    return True


async def sweep_orphans(
    a: Autoscaler, name: str, provider: Provider, machines: list[Machine], known: set[str], now: float
) -> list[str]:
    """Machines labelled `offload-…` at the provider that no record accounts for: report, and destroy them
    if `autoscaler.destroy_orphans` is on (off by default: two deployments may share one account)."""
    orphans = [m for m in machines if m.label not in known and m.state != MachineState.TERMINATED]
    for m in orphans:
        verb = "destroying" if a.server.destroy_orphans else "reporting"
        await log_event(
            a.redis,
            now,
            EventKind.ORPHAN,
            f"{verb} machine {m.provider_id} ({m.label}) at provider {name}: no record of it",
            provider=name,
            machine=m.provider_id,
        )
        await a.alerter.alert(
            "autoscale_failure",
            f"orphan:{m.provider_id}",
            f"provider {name} runs {m.provider_id} ({m.label}) that offload has no record of ({verb} it)",
        )
        if a.server.destroy_orphans:
            try:
                await a.leader.check()
                a.provider_calls += 1
                await provider.destroy(m.provider_id)
            except ProviderError as exc:
                log.warning("orphan %s: destroy failed: %s", m.provider_id, a.why(exc))
    return [m.provider_id for m in orphans]
