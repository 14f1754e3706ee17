"""What `offload autoscale status`, the API and /metrics show: instances, per-queue cost and state, the leader,
and why the autoscaler does what it does for each queue (`explain`: the desired count and the triggers behind
it, what holds it, the provider chosen and why, backoffs, what scale-down drained or spared), in words the CLI
and the dashboard show as they are.

Costs of live instances include what accrued since the scaler's last accrual (price x elapsed), so a status
read between two evaluations is not behind.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from offload.autoscale import keyspace
from offload.autoscale.instances import ACTIVE, Instance, InstanceStore, read_events
from offload.autoscale.leader import Leader
from offload.autoscale.state import QueueState, load_decision, spend
from offload.queue.store_clock import StoreClock
from offload.redis_client import RedisClient


def live_cost(inst: Instance, now: float) -> float:
    if inst.destroyed_at or not inst.provider_id:
        return inst.cost
    since = inst.accrued_at or inst.created_at
    return inst.cost + inst.price * max(0.0, now - since) / 3600


async def snapshot(redis: RedisClient, *, history: int = 50, now: float | None = None) -> dict[str, Any]:
    now = await StoreClock().sync(redis) if now is None else now  # the store's day: the one spend is counted in
    store = InstanceStore(redis)
    live = await store.live()
    recent = [i for i in await store.recent(history) if i.id not in {x.id for x in live}] if history > 0 else []
    queues: dict[str, dict[str, Any]] = {}
    for name in sorted(await redis.smembers(keyspace.DECIDED)):
        queues[name] = {"active": 0, "draining": 0, "live_cost": 0.0}
    for inst in live + recent:
        q = queues.setdefault(inst.queue, {"active": 0, "draining": 0, "live_cost": 0.0})
        if inst.status in ACTIVE and not inst.teardown:
            q["active"] += 1
        elif inst.status == "draining" and not inst.teardown:
            q["draining"] += 1
    for name, q in queues.items():
        today, month, total = await spend(redis, name, now)
        dry_today, dry_month, _ = await spend(redis, name, now, dry_run=True)
        state = await QueueState.load(redis, name)
        until, why = state.paused_until()
        backoffs = {
            p: {"until": t, "failures": state.prov_failures.get(p, 0)}
            for p, t in sorted(state.prov_until.items())
            if t > now
        }
        q.update(
            spend_today=round(today, 4),
            spend_month=round(month, 4),
            spend_total=round(total, 4),
            dry_run_spend_today=round(dry_today, 4),
            dry_run_spend_month=round(dry_month, 4),
            renting_paused_until=until if until > now else None,
            paused_because=why if until > now else None,
            backoffs=backoffs,
            decision=await load_decision(redis, name),
        )
        q["why"] = explain(q, now)
    rows = []
    for inst in live + recent:
        d = inst.to_dict()
        d["cost"] = round(live_cost(inst, now), 4)
        rows.append(d)
    return {
        "leader": await Leader.current(redis),
        "instances": rows,
        "queues": queues,
        "events": await read_events(redis, 20),
    }


def _ago(now: float, t: float) -> str:
    s = max(0.0, now - t)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def explain(q: dict[str, Any], now: float) -> list[str]:
    """One queue's last decision as sentences, most important first."""
    d = q.get("decision")
    out: list[str] = []
    if not d:
        return ["not evaluated yet"]
    head = f"desired {d.get('desired', 0)} (active {d.get('active', 0)}, billed {d.get('billed', 0)}"
    head += f", floor {d.get('floor', 0)}) at the evaluation {_ago(now, float(d.get('at', now)))}"
    if not d.get("enabled", True):
        head += ": autoscaling is off, everything drains"
    out.append(head)
    idle = f"no trigger fired ({d.get('pending', 0)} ready, {d.get('live_workers', 0)} live workers)"
    reasons = list(d.get("reasons") or [])
    up = [r for r in reasons if not r.startswith("cost:")]
    out.append("because: " + ("; ".join(up) or idle))
    out += [f"scale-in by {r}" for r in reasons if r.startswith("cost:")]
    if d.get("held"):
        out.append(f"held: {d['held']}")
    if d.get("undrained"):
        out.append(f"cancelled {d['undrained']} drain(s): load came back")
    prov = d.get("provider")
    if prov:
        line = f"provider: {prov.get('why', '')}"
        quotes = prov.get("quotes") or {}
        if quotes:
            line += (
                " (quotes: "
                + ", ".join(f"{n} " + (f"${v:.3f}/h" if v is not None else "none") for n, v in quotes.items())
                + ")"
            )
        out.append(line)
        for name, why in (prov.get("skipped") or {}).items():
            out.append(f"skipped {name}: {why}")
    if d.get("rented"):
        out.append(f"rented: {', '.join(d['rented'])}")
    for name, b in (q.get("backoffs") or {}).items():
        out.append(f"backoff: {name} after {b['failures']} failure(s), renting there again in {b['until'] - now:.0f}s")
    if q.get("paused_because"):
        out.append(f"renting paused {q['renting_paused_until'] - now:.0f}s more: {q['paused_because']}")
    down = d.get("scale_down")
    if down:
        line = f"scale-down ({down['reason']}, floor {down['floor']}): draining {down['draining']}"
        if down.get("spared"):
            line += "; spared " + ", ".join(f"{i} ({why})" for i, why in down["spared"].items())
        out.append(line)
    return out


async def autoscale_families(redis: RedisClient) -> list[Metric]:
    """Gauges for /metrics: instances by queue and status, spend, and the estimated cost of live machines."""
    now = await StoreClock().sync(redis)
    snap = await snapshot(redis, history=0, now=now)
    inst = GaugeMetricFamily(
        "offload_autoscale_instances", "Rented instances by status.", labels=["queue", "provider", "status"]
    )
    counts: dict[tuple[str, str, str], int] = {}
    for row in snap["instances"]:
        k = (row["queue"], row["provider"], row["status"])
        counts[k] = counts.get(k, 0) + 1
    for k, n in sorted(counts.items()):
        inst.add_metric(list(k), n)
    spend_g = GaugeMetricFamily("offload_autoscale_spend_usd", "Accrued machine cost.", labels=["queue", "period"])
    for queue, q in sorted(snap["queues"].items()):
        for period in ("today", "month", "total"):
            spend_g.add_metric([queue, period], q[f"spend_{period}"])
    live = GaugeMetricFamily(
        "offload_autoscale_live_cost_usd", "Cost so far of instances still alive.", labels=["queue"]
    )
    per: dict[str, float] = {}
    for row in snap["instances"]:
        per[row["queue"]] = per.get(row["queue"], 0.0) + row["cost"]
    for queue, c in sorted(per.items()):
        live.add_metric([queue], c)
    leader = GaugeMetricFamily("offload_autoscale_leader_token", "Fencing token of the current autoscaler leader.")
    leader.add_metric([], float(snap["leader"]["token"]) if snap["leader"] else 0.0)
    return [inst, spend_g, live, leader]


__all__ = ["autoscale_families", "keyspace", "live_cost", "snapshot"]
