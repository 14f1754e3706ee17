"""Where a new machine landed, checked as its create returns. Some providers' create cannot be told which hosts to
avoid or what to pay at most (a RunPod pod lands on any host, and its costPerHr is known only once it exists), so
every new machine is checked here, whatever the provider, before the rental counts:

- a machine whose reported price per hour is over the cap (`Provider.price_cap`: the queue's `max_price_per_hour`,
  `spot_max_price` for spot) is released at once and alerted, and the provider backs off as after an
  out-of-stock create: nothing more is rented from it in this evaluation;
- a machine on an avoided host (one that failed to boot in the last 24 h: reconcile.boot_failed) is released at
  once and the rental counts as not made, so the same evaluation rents again. After MAX_RELEASES such releases in
  a row for one provider in one evaluation the next one is kept (a `landed` event says so): a provider that keeps
  placing us there must not cost an endless create/destroy.

A release is reconcile's journaled teardown: the write that records the machine's id also fails the record and
journals its teardown, then the destroy is called. A server killed before that write leaves a record without an
id, which reconcile adopts by its label; one killed after it leaves a pending teardown the next leader carries out.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any

from offload.autoscale import reconcile
from offload.autoscale.instances import EventKind, Instance, log_event
from offload.autoscale.providers import LaunchSpec, Machine, Provider
from offload.autoscale.safety import provision_backoff

if TYPE_CHECKING:
    from offload.autoscale.evaluation import Evaluation
    from offload.autoscale.scaler import Autoscaler

log = logging.getLogger("offload.autoscale")
MAX_RELEASES = 2  # machines on avoided hosts released in a row (per provider and evaluation); the next is kept
PRICE_SLACK = 1e-6  # a reported price this close over the cap is the cap (bids are rounded)


class Landing(enum.StrEnum):
    KEPT = "kept"  # recorded: the rental is made
    RENT_AGAIN = "rent again"  # released from an avoided host: the rental is not made, try the same provider
    NEXT_PROVIDER = "next provider"  # released over the cap (or its destroy not yet confirmed): none from here now


def over_cap(provider: Provider, spec: LaunchSpec, machine: Machine) -> str | None:
    """Why the machine's reported price breaks the cap (None: it does not, or it reported none)."""
    cap, price = provider.price_cap(spec), machine.price_per_hour
    if cap is None or not price or price <= cap + PRICE_SLACK:
        return None
    return f"reported ${price:.3f}/h, over {'spot_max_price' if spec.spot else 'max_price_per_hour'} ${cap:.3f}/h"


async def settle(
    a: Autoscaler,
    ev: Evaluation,
    provider: Provider,
    inst: Instance,
    spec: LaunchSpec,
    machine: Machine,
    changes: dict[str, Any],
    released: int,
) -> Landing:
    """Record the new machine (`changes`: its id, host, price), or release it. `released`: how many machines this
    evaluation released in a row for landing on this provider's avoided hosts."""
    if why := over_cap(provider, spec, machine):
        await _over_cap(a, ev, provider, inst, changes, why)
        return Landing.NEXT_PROVIDER
    host = machine.host_id or ""
    if host and host in spec.avoid_hosts:
        if released < MAX_RELEASES:
            why = f"landed on avoided host {host}; released, renting again"
            done = await _release(a, ev, provider, inst, changes, why)
            return Landing.RENT_AGAIN if done else Landing.NEXT_PROVIDER
        said = (
            f"{inst.id}: landed on avoided host {host} again ({released} released in a row from {provider.name}); "
            "kept rather than renting again"
        )
        await log_event(a.redis, ev.now, EventKind.LANDED, said, instance=inst.id, queue=ev.queue, host=host)
        log.warning("%s", said)
    await a.instances.update(inst, a.leader.token, ev.now, **changes)
    return Landing.KEPT


async def _release(
    a: Autoscaler, ev: Evaluation, provider: Provider, inst: Instance, changes: dict[str, Any], reason: str
) -> bool:
    """Fail the record and journal its teardown in the write that records the machine, then destroy it; True once
    the provider confirmed (if not, the scaler retries the teardown every evaluation)."""
    await reconcile.fail(a, inst, reason, ev.now, also=changes)
    return await reconcile.teardown(a, inst, provider, {}, ev.now)


async def _over_cap(
    a: Autoscaler, ev: Evaluation, provider: Provider, inst: Instance, changes: dict[str, Any], why: str
) -> None:
    """Release a machine priced over the cap; the provider backs off as after an out-of-stock create."""
    queue, qs, name = ev.queue, ev.state, provider.name
    pause = provision_backoff(ev.cfg.poll_interval, qs.prov_failures.get(name, 0) + 1)
    await _release(a, ev, provider, inst, changes, f"{why}; released, renting from {name} again in {pause:.0f}s")
    await qs.provider_failed(a.redis, queue, name, pause, ev.now)
    await a.alerter.alert(
        "autoscale_failure",
        f"{queue}/{name}",
        f"queue {queue}: {inst.id} from {name} {why} once created; released it, renting from {name} again in "
        f"{pause:.0f}s",
    )
