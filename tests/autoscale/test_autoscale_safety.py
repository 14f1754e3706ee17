"""Each safety rule of the autoscaler on its own, on a simulated clock (no sleeps), real Valkey underneath.

The mock provider keeps its machines in Redis, so "leaked" means: still held by the mock (or the simulator)
after the test. Where a rule depends on what a real provider reports (a host that cannot start the container),
the Vast.ai adapter runs against the simulator, sharing the test's clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import (
    Clock,
    drop_worker,
    make_scaler,
    put_worker,
    queue_block,
    sim_call,
    stored,
    worker_token,
)

from offload.autoscale import keyspace
from offload.autoscale.instances import Fenced, Instance
from offload.autoscale.providers.mock import MockConfig
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.autoscale.safety import boot_backoff, host_pause, provision_backoff
from offload.autoscale.scaler import Autoscaler
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(fast_valkey_url))
    yield client
    await client.aclose()


def qstore(r: AdminRedis, clock: Clock) -> QueueStore:
    return QueueStore(r, clock_ms=lambda: int(clock() * 1000))


async def enqueue(r: AdminRedis, clock: Clock, n: int, queue: str = "gpu") -> None:
    await qstore(r, clock).enqueue_many(queue, [JobSpec(input={"i": i}) for i in range(n)])


async def statuses(s: Autoscaler) -> list[str]:
    return [i.status for i in await s.instances.recent()]


async def step(s: Autoscaler, clock: Clock, seconds: float = 30.0, times: int = 1) -> None:
    for _ in range(times):
        clock.advance(seconds)
        await s.tick()


async def only(s: Autoscaler) -> Instance:
    live = await s.instances.live()
    assert len(live) == 1, [(i.id, i.status) for i in live]
    return live[0]


async def test_no_stacking_while_an_instance_boots(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(
        r,
        clock,
        queue_block(scale_up=[{"trigger": "queue_depth", "threshold": 2}, {"trigger": "latency", "max_latency": "1m"}]),
    )
    await enqueue(r, clock, 10)
    await s.tick()
    await step(s, clock, times=8)  # 4 minutes of depth 10 and a growing latency, nothing registered yet
    inst = await only(s)
    assert inst.status == "booting" and len(await mock.all_ids()) == 1
    await put_worker(r, "w1", "gpu", inst.id, clock())
    await step(s, clock)  # the booted instance is running: now a second one may come
    assert len(await s.instances.live()) == 2 and len(await mock.all_ids()) == 2


async def test_provisioning_failures_back_off_exponentially(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, mock=MockConfig(fail_creates=4))
    await enqueue(r, clock, 1)
    attempts: list[float] = []
    start = clock()
    for _ in range(35):  # 17.5 minutes of 30 s polls
        before = mock.calls["create"]
        await s.tick()
        if mock.calls["create"] > before:
            attempts.append(clock() - start)
        clock.advance(30)
    # poll 30 s x 2^n: waits of 60, 120, 240, 480 s after failures 1..4, then success
    assert attempts == [0, 60, 180, 420, 900]
    assert (await only(s)).status == "booting"
    assert provision_backoff(30, 10) == 600  # capped at 10 minutes
    failed = [i for i in await s.instances.recent() if i.status == "failed"]
    assert len(failed) == 4 and all("provisioning failed" in i.reason for i in failed)


async def test_paused_queue_is_not_load_but_min_workers_still_applies(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock)
    await enqueue(r, clock, 5)
    await qstore(r, clock).pause("gpu")
    await step(s, clock, times=4)
    assert await mock.all_ids() == []
    s2, _ = make_scaler(r, clock, queue_block(min_workers=1), owner="s2")
    await step(s2, clock, seconds=61)  # a new server with min_workers: 1, after the first one's lock expired
    assert len(await mock.all_ids()) == 1


async def _running(
    s: Autoscaler, r: AdminRedis, clock: Clock, *, in_flight: int = 0, protected: bool = False
) -> Instance:
    await enqueue(r, clock, 1)
    await s.tick()
    inst = await only(s)
    await put_worker(r, "w1", "gpu", inst.id, clock(), in_flight=in_flight, protected=protected)
    await step(s, clock)
    inst = await only(s)
    assert inst.status == "running" and inst.worker_id == "w1"
    await qstore(r, clock).purge("gpu", "queued")
    return inst


async def test_busy_worker_is_never_scaled_down(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(
        r,
        clock,
        queue_block(scale_down=[{"trigger": "idle", "timeout": "1m"}, {"trigger": "schedule", "cron": "*/5 * * * *"}]),
    )
    await _running(s, r, clock, in_flight=1)
    for _ in range(40):  # 20 minutes: idle timeout long past, schedule fired four times
        clock.advance(30)
        await put_worker(r, "w1", "gpu", (await only(s)).id, clock(), in_flight=1)
        await s.tick()
    assert await statuses(s) == ["running"] and len(await mock.all_ids()) == 1


async def test_worker_that_touched_a_task_in_the_last_30s_is_spared(r: AdminRedis) -> None:
    clock = Clock(1_800_000_300)
    s, _ = make_scaler(r, clock, queue_block(scale_down=[{"trigger": "schedule", "cron": "*/10 * * * *"}]))
    inst = await _running(s, r, clock)
    store = qstore(r, clock)
    clock.t = (clock.t // 600 + 1) * 600 - 5  # 5 s before a scale-down schedule fires
    await enqueue(r, clock, 1)
    job = (await store.claim("gpu", "w1", 1))[0]
    await store.complete(job.id, job.token, "done")  # a task finished just now, nothing in flight
    await put_worker(r, "w1", "gpu", inst.id, clock())
    await step(s, clock, seconds=10)  # the schedule fired; the worker touched a task 10 s ago
    assert await statuses(s) == ["running"]
    await put_worker(r, "w1", "gpu", inst.id, clock() + 31)
    await step(s, clock, seconds=31)  # over 30 s since the evaluation that saw the task: now it may go
    assert (await stored(s, inst.id)).status in ("draining", "terminated")


async def test_protected_instances_are_spared(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(
        r,
        clock,
        queue_block(scale_down=[{"trigger": "idle", "timeout": "1m"}]),
        mock=MockConfig(allow_worker_protect=True),
    )  # this provider trusts workers' own flag
    inst = await _running(s, r, clock, protected=True)  # OFFLOAD_PROTECTED=true on the worker
    for _ in range(10):
        await put_worker(r, "w1", "gpu", inst.id, clock(), protected=True)
        await step(s, clock)
    assert await statuses(s) == ["running"]
    await put_worker(r, "w1", "gpu", inst.id, clock())  # the worker drops its flag; the operator protects it
    await s.instances.set_protect(inst.id, True)
    await step(s, clock, times=4)
    assert await statuses(s) == ["running"]
    await s.instances.set_protect(inst.id, False)
    await step(s, clock, times=2)
    assert await statuses(s) == ["terminated"] and await mock.all_ids() == []


async def test_scale_down_drains_before_destroying(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(scale_down=[{"trigger": "idle", "timeout": "1m"}]))
    s.drain_settle = 20
    inst = await _running(s, r, clock)
    await step(s, clock, seconds=61)
    assert await statuses(s) == ["draining"]
    assert await r.hget("offload:rworker:w1", "draining") == "1"  # the server stops handing it jobs
    await put_worker(r, "w1", "gpu", inst.id, clock(), in_flight=1)  # a job claimed in the race window
    await step(s, clock, times=4)
    assert await statuses(s) == ["draining"] and len(await mock.all_ids()) == 1  # finishes first
    await put_worker(r, "w1", "gpu", inst.id, clock(), in_flight=0)
    await step(s, clock)
    assert await statuses(s) == ["terminated"] and await mock.all_ids() == []


async def test_teardown_is_journaled_and_retried_across_restarts(r: AdminRedis) -> None:
    clock = Clock()
    block = queue_block(scale_down=[{"trigger": "idle", "timeout": "1m"}])
    s, _ = make_scaler(r, clock, block, mock=MockConfig(fail_destroys=2))
    inst = await _running(s, r, clock)
    await drop_worker(r, "w1")
    await step(s, clock, seconds=61)  # idle: draining
    await step(s, clock)  # no worker left -> teardown journaled, destroy fails (1)
    got = await s.instances.get(inst.id)
    assert got is not None and got.teardown == "pending" and got.teardown_attempts >= 1
    # the server restarts: a new process, a new owner, once the old lock has expired
    clock.advance(61)
    s2, mock2 = make_scaler(r, clock, block, mock=MockConfig(fail_destroys=2), owner="s2")
    await step(s2, clock, times=3)
    got = await s2.instances.get(inst.id)
    assert got is not None and got.status == "terminated" and got.teardown == "done"
    assert await mock2.all_ids() == [] and not await r.sismember(keyspace.LIVE, inst.id)


async def test_preempted_machine_is_marked_failed_and_destroyed(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock)
    inst = await _running(s, r, clock)
    await step(s, clock, times=3)  # past the grace in which a fresh rental may be missing from the listing
    await mock.vanish(inst.provider_id)
    await put_worker(r, "w1", "gpu", inst.id, clock())
    await step(s, clock)
    got = await s.instances.get(inst.id)
    assert got is not None and got.status == "failed" and "vanished" in got.reason and got.teardown == "done"


async def test_boot_timeout_destroys_and_backs_off_until_a_worker_is_ready(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(boot_timeout="5m"))
    await enqueue(r, clock, 1)
    rentals: list[float] = []
    start = clock()
    for _ in range(120):  # 60 minutes
        before = mock.calls["create"]
        await s.tick()
        if mock.calls["create"] > before:
            rentals.append(clock() - start)
        clock.advance(30)
    # rent, 5 min boot timeout on the first host: rent at once (one host may be bad); timeout on a second host:
    # wait 5 min, rent, timeout, wait 10 min, rent, timeout, wait 20 min, rent
    assert rentals == [0, 330, 960, 1890, 3420]
    assert assert_no_leak_but_one(await s.instances.recent(), await mock.all_ids())
    inst = await only(s)
    await put_worker(r, "w1", "gpu", inst.id, clock())
    await step(s, clock)
    assert (await r.hget(keyspace.queue_state("gpu"), "boot_failures")) == "0"  # the first ready worker resets it
    assert boot_backoff(300, 10) == 3600


def assert_no_leak_but_one(insts: list[Instance], machines: list[str]) -> bool:
    failed = [i for i in insts if i.status == "failed"]
    return (
        len(machines) == 1
        and len(failed) == 4
        and all("boot_timeout" in i.reason for i in failed)
        and all(i.teardown == "done" for i in failed)
    )


async def test_lost_heartbeats_for_5_minutes_destroy_the_instance(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(scale_down=[{"trigger": "idle", "timeout": "1m"}]))
    inst = await _running(s, r, clock, in_flight=1)
    await drop_worker(r, "w1")  # machine died: no more heartbeats, the registry record expired
    await step(s, clock, times=9)  # 4.5 minutes
    assert await statuses(s) == ["running"]
    await step(s, clock, times=2)
    got = await s.instances.get(inst.id)
    assert got is not None and got.status == "failed" and "heartbeat" in got.reason and await mock.all_ids() == []


async def test_broken_host_is_avoided_and_the_next_rental_waits_briefly(r: AdminRedis) -> None:
    clock = Clock()
    cfg = SimConfig.model_validate({"machines": {"boot_seconds": 60, "broken_hosts": ["1001"]}})
    with running_sim(cfg, clock=clock) as url:
        vast = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090"))
        block = queue_block(provider="v", boot_timeout="20m")
        s, _ = make_scaler(
            r, clock, block, server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r)}
        )
        s.override = {"v": vast}
        await enqueue(r, clock, 1)
        await s.tick()
        first = await only(s)
        assert first.host == "1001"  # the cheapest acceptable offer
        rentals = []
        for _ in range(8):
            clock.advance(30)
            before = {i.id for i in await s.instances.recent()}
            await s.tick()
            rentals += [i for i in await s.instances.recent() if i.id not in before]
        got = await s.instances.get(first.id)
        assert got is not None and got.status == "failed" and "daemon" in got.reason and got.teardown == "done"
        assert await r.zscore(keyspace.avoid("v"), "1001") == pytest.approx(clock.t - 150 + 86400, abs=60)
        assert len(rentals) == 1 and rentals[0].host != "1001"  # after a 30 s pause, not a boot backoff
        assert host_pause(1) == 30 and host_pause(10) == 600
        machines = sim_call("GET", f"{url}/_sim/machines")["machines"]
        assert {m["phase"] for m in machines if m["host"] == "1001"} == {"deleted"}
        await vast.aclose()


async def test_orphan_sweep_reports_and_destroys_only_offload_machines(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, server={"destroy_orphans": True})
    orphan = await mock.plant("offload-as-lost")
    foreign = await mock.plant("prod-db")
    assert await s.leader.acquire()
    found = await s.sweep(clock())
    assert found == {"m": [orphan]}
    assert set(await mock.all_ids()) == {foreign}
    events = [e async for e in _events(r)]
    assert any(e["kind"] == "orphan" for e in events)


async def _events(r: AdminRedis) -> AsyncIterator[dict[str, str]]:
    for _, fields in await r.xrange(keyspace.EVENTS):
        yield fields


async def test_only_the_leader_touches_the_provider_and_a_stale_leader_is_fenced(r: AdminRedis) -> None:
    clock = Clock()
    s1, mock = make_scaler(r, clock, owner="a")
    s2, mock2 = make_scaler(r, clock, owner="b")
    await enqueue(r, clock, 1)
    assert await s1.tick() and not await s2.tick()
    assert mock2.calls == {"create": 0, "list": 0, "destroy": 0} and mock.calls["create"] == 1
    clock.advance(61)  # s1 stalls past its lease; s2 takes over with a larger token
    assert await s2.tick()
    assert int(s2.leader.token) > int(s1.leader.token)
    with pytest.raises(Fenced):
        await s1.leader.check()
    inst = await only(s2)
    with pytest.raises(Fenced):
        await s1.instances.update(inst, s1.leader.token, clock(), reason="stale write")


async def test_real_providers_need_a_public_url_and_never_get_the_admin_key(r: AdminRedis) -> None:
    clock = Clock()
    with running_sim(SimConfig()) as url:
        vast = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090"))
        s, _ = make_scaler(r, clock, queue_block(provider="v"), alerts={"cooldown": 0})
        s.override = {"v": vast}
        await enqueue(r, clock, 1)
        await s.tick()
        assert await s.instances.live() == [] and "public_url" in s.alerter.sent[-1]["message"]
        s.server.public_url = "https://cp.example.com"
        s.server.worker_key = "admin-secret"
        s.env["OFFLOAD_ADMIN_KEY"] = "admin-secret"
        await step(s, clock)
        assert await s.instances.live() == [] and "admin key" in s.alerter.sent[-1]["message"]
        assert sim_call("GET", f"{url}/_sim/stats")["requests"].get("vastai.rent") is None
        await vast.aclose()


async def test_spend_cap_blocks_scale_up_and_alerts(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(
        r, clock, queue_block(daily_spend_cap=1.0, max_workers=1, instance={"max_price_per_hour": 0.5})
    )
    inst = await _running(s, r, clock)
    for _ in range(5):  # 2.5 h at $0.50/h
        await put_worker(r, "w1", "gpu", inst.id, clock() + 1800, in_flight=1)
        await step(s, clock, seconds=1800)
    got = await s.instances.get(inst.id)
    assert got is not None and got.cost == pytest.approx(0.5 * (got.accrued_at - got.created_at) / 3600)
    await drop_worker(r, "w1")
    await mock.vanish(inst.provider_id)
    await enqueue(r, clock, 3)
    await step(s, clock, times=3)
    assert [i.status for i in await s.instances.live()] == []  # no new rental over the cap
    assert any(a["kind"] == "spend_cap_reached" for a in s.alerter.sent)
