"""A teardown the provider refuses as not ours, a busy machine destroyed for the spend cap, and a provider over the
spend cap checked once per evaluation: on a simulated clock over a real Valkey, with the mock provider."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from support.autoscale_helpers import Clock, make_scaler, put_worker, queue_block

from offload.autoscale import keyspace, reconcile, rent
from offload.autoscale.settings import server_side
from offload.autoscale.state import add_cost
from offload.connection import connect
from offload.errors import ConfigError
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[Any]:
    client = await connect(fast_valkey_url)
    yield client
    await client.aclose()


async def enqueue(r: Any, clock: Clock, n: int, queue: str = "gpu") -> None:
    await QueueStore(r, clock_ms=lambda: int(clock() * 1000)).enqueue_many(queue, [JobSpec(input=i) for i in range(n)])


async def events(r: Any, kind: str) -> list[dict[str, str]]:
    return [e for _, e in await r.xrange(keyspace.EVENTS) if e.get("kind") == kind]


async def test_a_teardown_refused_as_not_ours_is_not_called_destroyed(r: Any) -> None:
    """Before the fix the record was closed with a `destroyed` event, and nobody was told."""
    clock = Clock()
    s, mock = make_scaler(r, clock)
    await enqueue(r, clock, 1)
    await s.tick()
    (inst,) = await s.instances.live()
    raw = await r.hget(mock.key, inst.provider_id)
    await r.hset(mock.key, inst.provider_id, orjson.dumps({**orjson.loads(raw), "label": "prod-db"}))
    assert await reconcile.teardown(s, inst, mock, {}, clock())
    got = await s.instances.get(inst.id)
    assert got is not None and got.teardown == "done" and "is not ours" in got.reason
    assert await mock.all_ids() == [inst.provider_id]  # left alone
    assert [e["instance"] for e in await events(r, "refused")] == [inst.id]
    assert not [e for e in await events(r, "destroyed") if e.get("instance") == inst.id]
    assert any("not ours" in a["message"] for a in s.alerter.sent if a["kind"] == "autoscale_failure")


async def test_a_busy_machine_destroyed_for_the_spend_cap_is_journaled_and_alerted(r: Any) -> None:
    """Before the fix the drain timeout's twin had neither an event nor an alert."""
    clock = Clock()
    s, _ = make_scaler(r, clock, queue_block(daily_spend_cap=1.0, max_workers=1))
    await enqueue(r, clock, 1)
    await s.tick()
    (inst,) = await s.instances.live()
    for _ in range(6):  # 3 h at $0.50/h, busy all along
        clock.advance(1800)
        await put_worker(r, "w1", "gpu", inst.id, clock(), in_flight=1)
        await s.tick()
    got = await s.instances.get(inst.id)
    assert got is not None and got.reason == "destroyed busy: the spend cap was reached"
    assert [e["instance"] for e in await events(r, "spend_cap")] == [inst.id]
    assert any(a["subject"] == inst.id for a in s.alerter.sent if a["kind"] == "spend_cap_reached")


async def test_a_provider_over_the_spend_cap_is_checked_once_per_evaluation(
    r: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(daily_spend_cap=1.0, jobs_per_worker=1, max_workers=3))
    await add_cost(r, "gpu", clock(), 0.999, dry_run=True)  # one more machine would reach the cap
    checks: list[str] = []
    capped = rent._capped

    async def counted(*args: Any) -> bool:
        checks.append(args[3].name)
        return await capped(*args)

    monkeypatch.setattr(rent, "_capped", counted)
    await enqueue(r, clock, 3)
    await s.tick()
    assert mock.calls["create"] == 0 and checks == ["m"]


# -- the caps of the autoscaler: block, across all queues ------------------------------------------------------


def two_queues(**block: Any) -> dict[str, Any]:
    return {"queues": {q: {"autoscale": queue_block(jobs_per_worker=1, **block)} for q in ("gpu", "gpu2")}}


async def test_max_machines_holds_across_queues(r: Any) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, extra=two_queues(max_workers=3), server={"max_machines": 4})
    for queue in ("gpu", "gpu2"):
        await enqueue(r, clock, 3, queue)
    await s.tick()
    assert len(await mock.all_ids()) == 4
    held = orjson.loads(await r.get(keyspace.decision("gpu2")))["held"]
    assert "autoscaler.max_machines 4 reached" in held


async def test_max_machines_per_provider_holds(r: Any) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(jobs_per_worker=1), server={"max_machines_per_provider": {"m": 1}})
    await enqueue(r, clock, 3)
    await s.tick()
    assert len(await mock.all_ids()) == 1
    held = orjson.loads(await r.get(keyspace.decision("gpu")))["held"]
    assert held.startswith("autoscaler.max_machines_per_provider.m 1 reached")


async def test_a_daily_spend_cap_across_queues_holds(r: Any) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, extra=two_queues(), server={"daily_spend_cap": 5.0})
    await add_cost(r, "gpu2", clock(), 4.999, dry_run=True)  # the other queue spent it
    await enqueue(r, clock, 1)
    await s.tick()
    assert await mock.all_ids() == []
    held = orjson.loads(await r.get(keyspace.decision("gpu")))["held"]
    assert "autoscaler.daily_spend_cap $5.00 reached across all queues" in held
    assert any(a["kind"] == "spend_cap_reached" for a in s.alerter.sent)


def test_fleet_caps_are_validated_and_named() -> None:
    with pytest.raises(ConfigError, match="max_machines_per_provider"):
        server_side({"max_machines_per_provider": {"m": 0}}, {})
    with pytest.raises(ConfigError, match="daily_spend_cap"):
        server_side({"daily_spend_cap": -1}, {})


async def test_a_spend_cap_across_queues_drains_every_queues_fleet(r: Any) -> None:
    """Before, a fleet-wide spend cap only stopped renting: the machines already up kept billing past it."""
    clock = Clock()
    s, mock = make_scaler(r, clock, extra=two_queues(), server={"daily_spend_cap": 5.0})
    for queue in ("gpu", "gpu2"):
        await enqueue(r, clock, 1, queue)
    await s.tick()
    rented = {i.queue: i for i in await s.instances.live()}
    assert set(rented) == {"gpu", "gpu2"} and len(await mock.all_ids()) == 2
    await add_cost(r, "gpu2", clock(), 4.999, dry_run=True)  # the day's spend, almost all by the other queue
    clock.advance(30)
    await s.tick()
    for queue, inst in rented.items():
        got = await s.instances.get(inst.id)
        assert got is not None and got.status != "running", (queue, got)
        decision = orjson.loads(await r.get(keyspace.decision(queue)))
        assert decision["desired"] == 0 and "autoscaler.daily_spend_cap $5.00 reached" in decision["held"], decision
