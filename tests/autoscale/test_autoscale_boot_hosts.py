"""Boot failures judged per host, the scale-down schedule that fires under load, and price caps on every provider:
on a simulated clock over a real Valkey, with the mock provider and the simulator's RunPod routes.

- one host that cannot boot the image is avoided and the queue rents on; failures on several hosts since the last
  healthy boot pause it, a healthy boot resets the pause, and a failure older than a day no longer counts;
- a RunPod pod stuck in STARTING past boot_timeout is its host's boot failure (avoided, no pause);
- a scale-down schedule that fires while a scale-up trigger fires is applied once the triggers stop;
- a GPU type listed over max_price_per_hour is not rented (RunPod, mock).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from support.autoscale_helpers import Clock, drop_worker, make_scaler, put_worker, queue_block, sim_call, worker_token

from offload.autoscale import keyspace
from offload.autoscale.instances import Instance
from offload.autoscale.providers import LaunchSpec, MachineState, OutOfCapacity
from offload.autoscale.providers.mock import MockConfig, MockProvider
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.settings import AutoscaleSettings
from offload.autoscale.state import QueueState
from offload.connection import connect
from offload.queue.keyspace import gpu_worker
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

DAY = datetime(2027, 1, 18, tzinfo=UTC).timestamp()  # a Monday, 00:00 UTC


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[Any]:
    client = await connect(fast_valkey_url)
    yield client
    await client.aclose()


async def enqueue(r: Any, clock: Clock, n: int) -> None:
    await QueueStore(r, clock_ms=lambda: int(clock() * 1000)).enqueue_many("gpu", [JobSpec(input=i) for i in range(n)])


async def booting(s: Autoscaler) -> list[Instance]:
    return [i for i in await s.instances.live() if i.status in ("provisioning", "booting") and i.provider_id]


async def fail_host(s: Autoscaler, mock: MockProvider, clock: Clock) -> tuple[Instance, int]:
    """The booting machine's host cannot start the container; one evaluation later. Returns it and how many
    rentals that evaluation started."""
    (inst,) = await booting(s)
    await mock.set_state(inst.provider_id, MachineState.FAILED)
    clock.advance(30)
    before = mock.calls["create"]
    await s.tick()
    return inst, mock.calls["create"] - before


async def paused(r: Any, clock: Clock) -> float:
    qs = await QueueState.load(r, "gpu")
    return max(max(qs.host_until, qs.boot_until) - clock(), 0.0)


async def test_one_failing_host_is_avoided_without_pausing_the_queue(r: Any) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(max_workers=1))
    await enqueue(r, clock, 1)
    await s.tick()
    first, rented = await fail_host(s, mock, clock)
    assert rented == 1 and await paused(r, clock) == 0  # rented again in the same evaluation
    assert await r.zscore(keyspace.avoid("m"), first.host) == pytest.approx(clock() + 86400)
    _, rented = await fail_host(s, mock, clock)  # a second host: the image is probably broken
    assert rented == 0 and await paused(r, clock) == 30


async def test_a_healthy_boot_resets_the_host_pause(r: Any) -> None:
    """Before the fix the pause kept doubling for the queue's whole life: 60 s after a healthy machine."""
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(max_workers=1))
    await enqueue(r, clock, 1)
    await s.tick()
    await fail_host(s, mock, clock)
    await fail_host(s, mock, clock)
    assert await paused(r, clock) == 30
    clock.advance(31)
    await s.tick()
    (healthy,) = await booting(s)
    await put_worker(r, "w1", "gpu", healthy.id, clock())
    clock.advance(30)
    await s.tick()
    assert (await s.instances.get(healthy.id)).status == "running"  # type: ignore[union-attr]
    assert await paused(r, clock) == 0
    # the healthy machine dies later (not a boot failure); its replacements' hosts fail again
    await mock.set_state(healthy.provider_id, MachineState.FAILED)
    await drop_worker(r, "w1")
    clock.advance(30)
    await s.tick()
    _, rented = await fail_host(s, mock, clock)
    assert rented == 1 and await paused(r, clock) == 0
    # the image booted healthy within the day: a run of failing hosts pauses only once most recent boots failed
    for _ in range(2):  # 3 in a row, 5 of the last 6 boots
        await fail_host(s, mock, clock)
        assert await paused(r, clock) == 0
    await fail_host(s, mock, clock)  # 6 of the last 7
    assert await paused(r, clock) == 30


async def test_a_healthy_boot_vouches_for_its_image_for_a_day_only(r: Any) -> None:
    """What booted healthy within a day needs three failing hosts to pause (the test above); a changed image, or
    the same a day later, is unproven again: two."""
    clock = Clock()
    s, _ = make_scaler(r, clock, queue_block(max_workers=1))
    await enqueue(r, clock, 1)
    await s.tick()
    (healthy,) = await booting(s)
    await put_worker(r, "w1", "gpu", healthy.id, clock())
    clock.advance(30)
    await s.tick()
    qs = await QueueState.load(r, "gpu")
    boots = (await s.configs())["gpu"].boots
    assert qs.known_good(boots, clock())
    new_image = queue_block(max_workers=1, instance={"gpu": "RTX 4090", "image": "img:2", "max_price_per_hour": 0.5})
    assert not qs.known_good(AutoscaleSettings.model_validate(new_image).boots, clock())
    assert not qs.known_good(boots, clock() + 86_401)  # a day later it must prove itself again


async def test_a_boot_failure_found_after_a_later_rental_booted_does_not_count_against_the_image(r: Any) -> None:
    """A failure comes to light boot_timeout after its rental; if a machine rented since booted the same image,
    the host was at fault. Before, such late failures piled up "since the last healthy boot" and paused renting
    for up to an hour in the cost bench's faulty week."""
    clock = Clock()
    s, _ = make_scaler(r, clock, queue_block(min_workers=2, boot_timeout="10m"))
    await s.tick()
    first, second = await booting(s)
    await put_worker(r, "w1", "gpu", second.id, clock())  # rented with the first; boots, the first never does
    clock.advance(30)
    await s.tick()
    clock.advance(600)
    await put_worker(r, "w1", "gpu", second.id, clock())
    await s.tick()
    assert (await s.instances.get(first.id)).status == "failed"  # type: ignore[union-attr]
    said = [e["message"] for _, e in await r.xrange(keyspace.EVENTS) if e.get("instance") == first.id]
    assert any("a machine rented after it booted the image: renting goes on" in m for m in said), said
    assert await r.zcard(keyspace.failed_hosts("gpu")) == 0 and await paused(r, clock) == 0


async def test_a_stuck_boot_holds_the_depth_trigger_only_for_twice_the_measured_boot(r: Any) -> None:
    """Before, a machine that never boots held queue_depth and latency for the whole boot_timeout (20 min in the
    cost bench's faulty week), while jobs piled up."""
    clock = Clock()
    block = queue_block(max_workers=3, boot_timeout="20m", scale_up=[{"trigger": "queue_depth", "threshold": 0}])
    s, _ = make_scaler(r, clock, block)
    await enqueue(r, clock, 50)
    await s.tick()
    (first,) = await booting(s)
    clock.advance(60)
    await put_worker(r, "w1", "gpu", first.id, clock())  # ready 60 s after its rental: the measured boot
    await s.tick()
    (stuck,) = await booting(s)  # the depth trigger's next machine, on a host that never boots
    assert (await QueueState.load(r, "gpu")).boot_ewma == 60
    for _ in range(3):  # 90 s: within twice the measured boot, the stuck machine still holds the count
        clock.advance(30)
        await put_worker(r, "w1", "gpu", first.id, clock(), in_flight=1)
        await s.tick()
    assert [i.id for i in await booting(s)] == [stuck.id]
    clock.advance(30)  # 120 s: presumed stuck, the trigger rents beside it
    await put_worker(r, "w1", "gpu", first.id, clock(), in_flight=1)
    await s.tick()
    assert len(await booting(s)) == 2 and (await s.instances.get(stuck.id)).status == "booting"  # type: ignore[union-attr]


@pytest.mark.parametrize(("registered_in", "measured"), [(100, 100), (3600, 125), (-60, 125)])
async def test_the_measured_boot_ends_at_the_workers_registration(
    r: Any, registered_in: float, measured: float
) -> None:
    """The worker registered 100 s after its machine was rented, and the evaluation that sees it runs 25 s later:
    the boot is 100 s (before, 125: every pre-rent's lead and every burst machine's cost counted a share of a
    poll too many). A registration time outside the machine's life (a record an hour ahead, or older than the
    rental) is not believed: the evaluation's time counts."""
    clock = Clock()
    s, _ = make_scaler(r, clock, queue_block(max_workers=1, scale_up=[{"trigger": "queue_depth", "threshold": 0}]))
    await enqueue(r, clock, 1)
    await s.tick()
    (first,) = await booting(s)
    clock.advance(100)
    await put_worker(r, "w1", "gpu", first.id, clock())
    registered = first.created_at + registered_in
    await r.hset(gpu_worker("w1"), "registered_at", int(registered * 1000))
    clock.advance(25)
    await s.tick()
    assert (await QueueState.load(r, "gpu")).boot_ewma == pytest.approx(measured, abs=0.01)


async def test_host_failures_older_than_a_day_no_longer_count(r: Any) -> None:
    """Before the fix a failure 25 h after the last one still doubled the pause."""
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(max_workers=1, boot_timeout="30h"))
    await enqueue(r, clock, 1)
    await s.tick()
    await fail_host(s, mock, clock)
    await fail_host(s, mock, clock)
    assert await paused(r, clock) == 30
    clock.advance(25 * 3600)
    await s.tick()  # the pause is long over: rents
    _, rented = await fail_host(s, mock, clock)
    assert rented == 1 and await paused(r, clock) == 0


async def test_a_host_stuck_starting_on_runpod_is_that_hosts_boot_failure(r: Any) -> None:
    clock = Clock()
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 10_000}})
    with running_sim(cfg, clock=clock) as url:
        rp = RunPodProvider("rp", RunPodConfig(api_key="k", base_url=url, gpu_type_id="NVIDIA RTX A5000"))
        s, _ = make_scaler(
            r,
            clock,
            queue_block(provider="rp", max_workers=1, boot_timeout="5m"),
            server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r)},
        )
        s.override = {"rp": rp}
        await enqueue(r, clock, 1)
        await s.tick()
        (stuck,) = await booting(s)
        assert stuck.host
        for _ in range(11):  # past the 5 min boot timeout, the pod still STARTING
            clock.advance(30)
            await s.tick()
        got = await s.instances.get(stuck.id)
        assert got is not None and got.status == "failed" and "boot_timeout" in got.reason
        assert await r.zscore(keyspace.avoid("rp"), stuck.host) is not None
        assert await paused(r, clock) == 0 and len(await booting(s)) == 1  # rented again at once
        alerts = [a for a in s.alerter.sent if a["kind"] == "boot_timeout"]
        assert alerts and "renting goes on" in alerts[0]["message"]
        for _ in range(11):  # a second host fails too: now the queue pauses (boot backoff)
            clock.advance(30)
            await s.tick()
        assert await paused(r, clock) > 0 and await booting(s) == []
        await rp.aclose()


async def test_a_down_schedule_that_fires_under_load_applies_once_the_triggers_stop(r: Any) -> None:
    """Before the fix the fire was only looked at while nothing asked to scale up, within a two-poll lookback:
    one that fired during a burst was lost, and two idle machines were billed until the idle timeout."""
    clock = Clock(DAY + 17 * 3600 + 50 * 60)
    block = queue_block(
        max_workers=2,
        poll_interval="60s",
        jobs_per_worker=1,
        scale_up=[{"trigger": "queue_depth", "threshold": 0}],
        scale_down=[{"trigger": "idle", "timeout": "3h"}, {"trigger": "schedule", "cron": "0 18 * * *"}],
    )
    s, _ = make_scaler(r, clock, block)
    await enqueue(r, clock, 4)
    await s.tick()
    insts = await booting(s)
    assert len(insts) == 2
    for _ in range(30):  # 17:50 to 18:20: jobs keep waiting (the scale-up trigger fires through 18:00)
        clock.advance(60)
        for i, inst in enumerate(insts):
            await put_worker(r, f"w{i}", "gpu", inst.id, clock(), in_flight=1)
        await s.tick()
    assert {i.status for i in await s.instances.live()} == {"running"}
    await QueueStore(r, clock_ms=lambda: int(clock() * 1000)).purge("gpu", "queued")
    clock.advance(60)
    for i, inst in enumerate(insts):
        await put_worker(r, f"w{i}", "gpu", inst.id, clock())
    clock.advance(60)
    for i, inst in enumerate(insts):
        await put_worker(r, f"w{i}", "gpu", inst.id, clock())
    await s.tick()
    assert {i.status for i in await s.instances.live()} <= {"draining", "terminated"}


async def test_a_gpu_listed_over_the_price_cap_is_not_rented_on_runpod(r: Any) -> None:
    """Before the fix RunPod rented an A5000 at $0.36/h against a $0.10 cap."""
    cfg = SimConfig.model_validate({"api_key": "k"})
    with running_sim(cfg) as url:
        rp = RunPodProvider(
            "rp",
            RunPodConfig(api_key="k", base_url=url, gpu_type_ids=["NVIDIA RTX A5000", "NVIDIA GeForce RTX 3090"]),
        )
        spec = LaunchSpec("offload-as-1", "gpu", "img", None, 1, None, max_price_per_hour=0.10, env={})
        with pytest.raises(OutOfCapacity, match="max_price_per_hour"):
            await rp.create(spec)
        assert await rp.quote(spec) is None
        assert sim_call("GET", f"{url}/_sim/machines")["machines"] == []
        spec.max_price_per_hour = 0.40  # the A5000 fits now; the 3090 ($0.43) would not
        machine = await rp.create(spec)
        assert machine.price_per_hour == pytest.approx(0.36)
        await rp.aclose()


async def test_a_mock_listed_over_the_price_cap_is_not_rented(r: Any) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, mock=MockConfig(price_per_hour=0.6))  # the queue's cap is $0.50
    await enqueue(r, clock, 1)
    await s.tick()
    assert await mock.all_ids() == [] and mock.calls["create"] == 1
    assert any("over the queue's cap" in a["message"] for a in s.alerter.sent)
