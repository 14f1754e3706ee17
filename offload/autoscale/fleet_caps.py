"""The caps of the `autoscaler:` block, which hold across every queue: machines billed at once (in all, and per
provider name) and spend per UTC day and month.

A queue's own caps (max_workers, daily_spend_cap) see only its own machines; these see the whole fleet, read from
the store at each rental, so a rental by one queue counts for the next queue evaluated in the same tick. A machine
cap only stops renting (the evaluation holds, naming the cap). A spend cap also drains: once the day's (or month's)
spend across all queues plus the fleet's cost until the next evaluation reaches it, every queue drains as at its
own spend cap (`spend_reached`), so the cap is a ceiling on the bill, not only on new rentals. Dry-run (mock) spend
is checked against dry-run spend only, as for a queue's cap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload.autoscale.instances import Instance
from offload.autoscale.providers import Provider
from offload.autoscale.state import spend

if TYPE_CHECKING:
    from offload.autoscale.evaluation import Evaluation
    from offload.autoscale.scaler import Autoscaler


def _machines(a: Autoscaler, billed: list[Instance], provider: Provider) -> str | None:
    srv = a.server
    if srv.max_machines is not None and len(billed) >= srv.max_machines:
        return f"autoscaler.max_machines {srv.max_machines} reached: {len(billed)} machine(s) billed across all queues"
    cap = srv.max_machines_per_provider.get(provider.name)
    mine = sum(1 for i in billed if i.provider == provider.name)
    if cap is not None and mine >= cap:
        return (
            f"autoscaler.max_machines_per_provider.{provider.name} {cap} reached: "
            f"{mine} machine(s) billed there across all queues"
        )
    return None


async def _spend(a: Autoscaler, ev: Evaluation, billed: list[Instance], dry_run: bool, extra: float) -> str | None:
    srv = a.server
    queues = set(a.sources) | {i.queue for i in billed} | {ev.queue}
    today = month = 0.0
    for queue in sorted(queues):
        day_spent, month_spent, _ = await spend(a.redis, queue, ev.now, dry_run=dry_run)
        today, month = today + day_spent, month + month_spent
    fleet = sum(i.price for i in billed if (i.provider_type == "mock") == dry_run)
    ahead = (fleet + extra) * ev.cfg.poll_interval / 3600
    kind = "dry-run " if dry_run else ""
    for name, cap, spent in (("daily", srv.daily_spend_cap, today), ("monthly", srv.monthly_spend_cap, month)):
        if cap is not None and spent + ahead >= cap:
            return (
                f"autoscaler.{name}_spend_cap ${cap:.2f} reached across all queues ({kind}${spent:.2f} spent, "
                f"${ahead:.2f} more until the next evaluation)"
            )
    return None


async def fleet_cap(a: Autoscaler, ev: Evaluation, provider: Provider, extra: float) -> str | None:
    """Why one more machine from `provider` (`extra` $/h) would break a fleet-wide cap (None: it would not)."""
    srv = a.server
    spend_caps = srv.daily_spend_cap is not None or srv.monthly_spend_cap is not None
    if srv.max_machines is None and provider.name not in srv.max_machines_per_provider and not spend_caps:
        return None
    billed = [i for i in await a.instances.live() if i.live]
    if why := _machines(a, billed, provider):
        return why
    return await _spend(a, ev, billed, provider.type == "mock", extra) if spend_caps else None


async def spend_reached(a: Autoscaler, ev: Evaluation, *, dry_run: bool) -> str | None:
    """Why the fleet must drain for a spend cap across all queues (None: it need not): the day's or month's spend
    plus what every billed machine costs until the next evaluation reaches `daily_spend_cap` or
    `monthly_spend_cap` of the `autoscaler:` block."""
    srv = a.server
    if srv.daily_spend_cap is None and srv.monthly_spend_cap is None:
        return None
    billed = [i for i in await a.instances.live() if i.live]
    return await _spend(a, ev, billed, dry_run, 0.0)
