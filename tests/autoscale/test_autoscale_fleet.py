"""Fleet behaviour on a simulated clock: ramp in one step (jobs_per_worker), several providers in preference order
with `choose: first|cheapest`, spot rentals (RunPod interruptible, Vast.ai bids) whose pre-empted jobs come back
without using an attempt, the drain timeout, and a drain cancelled when load returns. The RunPod and Vast.ai
adapters run against the simulator's wire formats; everything else on a real Valkey."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import Clock, make_scaler, put_worker, queue_block, sim_call, stored, worker_token

from offload.autoscale import keyspace
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.state import load_decision
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

PUBLIC = {"public_url": "https://cp.example.com"}


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(fast_valkey_url))
    yield client
    await client.aclose()


def qstore(r: AdminRedis, clock: Clock) -> QueueStore:
    # the virtual clock jumps past leases with no calls in between: that silence is not an outage here
    return QueueStore(r, clock_ms=lambda: int(clock() * 1000), excuse_outages=False)


def providers(url: str) -> dict[str, Any]:
    return {
        "rp": RunPodProvider("rp", RunPodConfig(api_key="k", base_url=url, gpu_type_id="NVIDIA RTX A5000")),
        "v": VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090")),
    }


async def close(s: Autoscaler) -> None:
    for p in s.override.values():
        await p.aclose()
    await s.aclose()


async def test_200_jobs_with_jobs_per_worker_50_rent_4_machines_in_one_evaluation(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(max_workers=6, jobs_per_worker=50, scale_up=[]))
    await qstore(r, clock).enqueue_many("gpu", [JobSpec(input=i) for i in range(200)])
    await s.tick()
    assert len(await mock.all_ids()) == 4
    why = await load_decision(r, "gpu")
    assert why is not None and why["desired"] == 4 and "jobs_per_worker: 200 ready + 0 in flight / 50 = 4" in str(why)
    for _ in range(5):  # booting for minutes: nothing stacks beyond the desired count
        clock.advance(30)
        await s.tick()
    assert len(await mock.all_ids()) == 4
    await qstore(r, clock).enqueue_many("gpu", [JobSpec(input=i) for i in range(200)])
    clock.advance(30)
    await s.tick()
    assert len(await mock.all_ids()) == 6  # 400 / 50 = 8, bounded by max_workers


async def test_the_first_provider_out_of_stock_the_second_rents(r: AdminRedis) -> None:
    clock = Clock()
    cfg = SimConfig.model_validate(
        {"api_key": "k", "machines": {"boot_seconds": 0, "out_of_stock": ["NVIDIA RTX A5000"]}}
    )
    with running_sim(cfg, clock=clock) as url:
        block = queue_block(provider=None, providers=["rp", "v"], jobs_per_worker=1, max_workers=3, scale_up=[])
        s, _ = make_scaler(r, clock, block, server={**PUBLIC, "worker_key": await worker_token(r, queue="gpu")})
        s.override = providers(url)
        await qstore(r, clock).enqueue_many("gpu", [JobSpec(input=1), JobSpec(input=2)])
        await s.tick()
        assert sorted(i.provider for i in await s.instances.live()) == ["v", "v"]
        stats = sim_call("GET", f"{url}/_sim/stats")["requests"]
        assert stats["pods.create"] == 1 and stats["vastai.rent"] == 2  # rp tried once, in the same evaluation
        why = await load_decision(r, "gpu")
        assert why is not None and why["provider"]["order"] == ["rp", "v"] and why["rented"] == ["v", "v"]
        backoff_until = await r.hget(keyspace.queue_state("gpu"), "prov_until:rp")
        assert backoff_until is not None and float(backoff_until) > clock()  # rp backs off
        await qstore(r, clock).enqueue("gpu", JobSpec(input=3))
        clock.advance(30)
        await s.tick()
        assert sorted(i.provider for i in await s.instances.live()) == ["v", "v", "v"]
        why = await load_decision(r, "gpu")
        assert why is not None and why["provider"]["order"] == ["v"]
        assert why["provider"]["skipped"]["rp"].startswith("backing off")
        assert sim_call("GET", f"{url}/_sim/stats")["requests"]["pods.create"] == 1
        await close(s)


@pytest.mark.parametrize(("runpod_price", "expected"), [(0.36, "v"), (0.30, "rp")])
async def test_cheapest_picks_the_lower_current_offer(r: AdminRedis, runpod_price: float, expected: str) -> None:
    """Vast.ai's cheapest acceptable RTX 4090 offer is $0.35/h; RunPod's A5000 is $0.36 or $0.30: whichever is
    lower rents, whatever the order of preference."""
    clock = Clock()
    cfg = SimConfig.model_validate(
        {"api_key": "k", "machines": {"boot_seconds": 0, "runpod_gpus": {"NVIDIA RTX A5000": runpod_price}}}
    )
    with running_sim(cfg, clock=clock) as url:
        s, _ = make_scaler(
            r,
            clock,
            queue_block(provider=None, providers=["rp", "v"], choose="cheapest"),
            server={**PUBLIC, "worker_key": await worker_token(r, queue="gpu")},
        )
        s.override = providers(url)
        await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
        await s.tick()
        (inst,) = await s.instances.live()
        assert inst.provider == expected
        why = await load_decision(r, "gpu")
        assert why is not None
        assert why["provider"]["quotes"] == {"rp": pytest.approx(runpod_price), "v": pytest.approx(0.35)}
        assert f"cheapest current offer: {expected}" in why["provider"]["why"]
        assert inst.price == pytest.approx(min(runpod_price, 0.35))
        await close(s)


@pytest.mark.parametrize("provider", ["rp", "v"])
async def test_a_preempted_spot_machine_returns_its_jobs_without_using_an_attempt(r: AdminRedis, provider: str) -> None:
    """Spot rentals: RunPod through podRentInterruptable (a bid 10 % over the minimum), Vast.ai through a bid.
    The machine is pre-empted while its worker holds a job whose lease the reaper already took back (counting an
    expiry) and one it still holds: both come back with no attempt and no expiry used."""
    clock = Clock()
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0, "spot_preempt_after": 600}})
    with running_sim(cfg, clock=clock) as url:
        block = queue_block(
            provider=provider, instance={"gpu": "RTX 4090", "image": "img", "spot": True, "spot_max_price": 0.3}
        )
        s, _ = make_scaler(r, clock, block, server={**PUBLIC, "worker_key": await worker_token(r, queue="gpu")})
        s.override = providers(url)
        store = qstore(r, clock)
        await store.enqueue_many("gpu", [JobSpec(input=1, max_attempts=1), JobSpec(input=2, max_attempts=1)])
        await s.tick()
        (inst,) = await s.instances.live()
        (machine,) = sim_call("GET", f"{url}/_sim/machines")["machines"]
        assert machine["spot"] and machine["price"] == pytest.approx(inst.price)
        assert machine["price"] <= 0.3 and inst.spot
        if provider == "rp":  # A5000 minimum bid 0.18 (half of 0.36): bid 0.198
            assert machine["price"] == pytest.approx(0.198)
            assert sim_call("GET", f"{url}/_sim/stats")["requests"].get("pods.create") is None  # GraphQL only
        await put_worker(r, "r-w1", "gpu", inst.id, clock())
        first = (await store.claim("gpu", "r-w1", 1, lease_ms=60_000))[0]
        clock.advance(30)
        await s.tick()
        clock.advance(61)  # first's lease runs out: the reaper takes it back, counting an expiry
        await store.reap("gpu")
        assert (await store.get(first.id)).lease_expiries == 1
        second = (await store.claim("gpu", "r-w1", 1, lease_ms=3_600_000))[0]
        assert second.id == first.id  # the same job, back on the same worker
        other = (await store.claim("gpu", "r-w1", 1, lease_ms=3_600_000))[0]
        await put_worker(r, "r-w1", "gpu", inst.id, clock(), in_flight=2)
        for _ in range(20):  # pre-empted 600 s after boot
            clock.advance(30)
            await put_worker(r, "r-w1", "gpu", inst.id, clock(), in_flight=2)
            await s.tick()
            if (got := await s.instances.get(inst.id)) is not None and got.status == "failed":
                break
        got = await s.instances.get(inst.id)
        assert got is not None and got.status == "failed" and "pre-empted the spot machine" in got.reason
        for job_id in (first.id, other.id):
            job = await store.get(job_id)
            assert job.state.value == "queued" and job.attempts == 0 and job.lease_expiries == 0, job
        events = [e["message"] for _, e in await r.xrange(keyspace.EVENTS) if e.get("kind") == "forgiven"]
        assert events and "(2 lease(s) handed back, 1 lease expiry(ies) refunded)" in events[0]
        phases = {m["phase"] for m in sim_call("GET", f"{url}/_sim/machines")["machines"] if m["id"] == machine["id"]}
        assert phases == {"deleted"}  # the stopped (outbid / EXITED) machine was destroyed: no disk left billing
        await close(s)


async def test_spot_above_the_cap_rents_nothing_there(r: AdminRedis) -> None:
    clock = Clock()
    with running_sim(SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0}}), clock=clock) as url:
        block = queue_block(
            provider=None,
            providers=["rp", "v"],
            instance={"gpu": "RTX 4090", "image": "img", "spot": True, "spot_max_price": 0.1},
        )
        s, _ = make_scaler(r, clock, block, server={**PUBLIC, "worker_key": await worker_token(r, queue="gpu")})
        s.override = providers(url)
        await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
        await s.tick()
        assert await s.instances.live() == [] and sim_call("GET", f"{url}/_sim/machines")["machines"] == []
        reasons = " ".join(i.reason for i in await s.instances.recent())
        assert "no interruptible capacity at <= $0.100/GPU/h" in reasons and "no interruptible offer" in reasons
        await close(s)


async def test_a_hung_handler_does_not_keep_a_draining_machine_forever(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(
        r,
        clock,
        queue_block(drain_timeout="20m", scale_down=[{"trigger": "idle", "timeout": "1m"}]),
        alerts={"cooldown": 0},
    )
    await qstore(r, clock).enqueue("gpu", JobSpec(input=0))
    await s.tick()
    (a,) = await s.instances.live()
    await put_worker(r, "r-w1", "gpu", a.id, clock())
    clock.advance(30)
    await s.tick()
    await qstore(r, clock).purge("gpu", "queued")
    clock.advance(61)
    await put_worker(r, "r-w1", "gpu", a.id, clock())
    await s.tick()
    assert (await stored(s, a.id)).status == "draining"
    for _ in range(30):  # the handler it took in the race window never returns
        clock.advance(60)
        await put_worker(r, "r-w1", "gpu", a.id, clock(), in_flight=1)
        await s.tick()
    got = await s.instances.get(a.id)
    assert got is not None and got.status == "terminated" and "drain_timeout" in got.reason
    assert await mock.all_ids() == []
    assert any("drain_timeout" in al["message"] for al in s.alerter.sent)
    assert got.destroyed_at - got.drain_at == pytest.approx(20 * 60, abs=61)


async def test_a_drain_is_cancelled_when_load_returns(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(scale_down=[{"trigger": "idle", "timeout": "1m"}]))
    s.drain_settle = 45  # the machine drains for a while before its teardown
    await qstore(r, clock).enqueue("gpu", JobSpec(input=0))
    await s.tick()
    (a,) = await s.instances.live()
    await put_worker(r, "r-w1", "gpu", a.id, clock())
    clock.advance(30)
    await s.tick()
    await qstore(r, clock).purge("gpu", "queued")
    clock.advance(61)
    await put_worker(r, "r-w1", "gpu", a.id, clock())
    await s.tick()
    assert (await stored(s, a.id)).status == "draining"
    assert await r.hget("offload:rworker:r-w1", "draining") == "1"
    await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
    clock.advance(30)
    await put_worker(r, "r-w1", "gpu", a.id, clock())
    await r.hset("offload:rworker:r-w1", "draining", 1)  # as the registry keeps it
    await s.tick()
    got = await s.instances.get(a.id)
    assert got is not None and got.status == "running" and got.teardown == ""
    assert await r.hget("offload:rworker:r-w1", "draining") is None  # the server hands it jobs again
    assert mock.calls["create"] == 1 and len(await mock.all_ids()) == 1  # no new rental
    kinds = [e["kind"] for _, e in await r.xrange(keyspace.EVENTS)]
    assert kinds.index("draining") < kinds.index("undrained")


async def test_status_says_why_per_queue(r: AdminRedis, fast_valkey_url: str) -> None:
    """`offload autoscale status` (and the API's status, which the dashboard shows) explain each queue's last
    evaluation: desired count and the trigger behind it, the provider chosen and why, backoffs."""
    from typer.testing import CliRunner

    from offload.cli.app import app

    clock = Clock()
    cfg = SimConfig.model_validate(
        {"api_key": "k", "machines": {"boot_seconds": 0, "out_of_stock": ["NVIDIA RTX A5000"]}}
    )
    with running_sim(cfg, clock=clock) as url:
        s, _ = make_scaler(
            r,
            clock,
            queue_block(provider=None, providers=["rp", "v"]),
            server={**PUBLIC, "worker_key": await worker_token(r, queue="gpu")},
        )
        s.override = providers(url)
        await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
        await s.tick()
        await close(s)
    res = await asyncio.to_thread(CliRunner().invoke, app, ["autoscale", "status", "--url", fast_valkey_url])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for part in (
        "gpu: 1 active",
        "desired 1 (active 0, billed 0, floor 0)",
        "because: no_workers: 1 pending, no live worker",
        "provider: first usable in order of preference: rp",
        "rented: v",
        "backoff: rp after 1 failure(s)",
    ):
        assert part in text, (part, res.output)
