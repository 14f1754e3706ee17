"""Regression tests for the autoscaler's money bugs, each one of the experiments that found it, on a simulated
clock over a real Valkey (and the simulator's RunPod/Vast.ai routes where a real adapter's behaviour matters).

1. a scale-down schedule that spares something must not start a rent-and-drain loop against an up schedule;
2. a draining worker is not a live worker (no_workers must fire while the only instance drains a long job);
3. ambiguous create failures (5xx, lost answers) back off and alert like any other provisioning failure;
4. max_workers counts draining machines; a protected instance survives heartbeat loss and boot timeout;
7. a mock provider needs no vault key, and mock (dry-run) spend never counts against a real provider's cap.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from datetime import UTC, datetime
from pathlib import Path

import pytest
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import Clock, make_scaler, put_worker, queue_block, sim_call, stored, worker_token

from offload.autoscale import keyspace
from offload.autoscale.instances import Instance
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.status import snapshot
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

DAY = datetime(2027, 1, 18, tzinfo=UTC).timestamp()  # a Monday, 00:00 UTC


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(fast_valkey_url))
    yield client
    await client.aclose()


def qstore(r: AdminRedis, clock: Clock) -> QueueStore:
    return QueueStore(r, clock_ms=lambda: int(clock() * 1000))


async def serve_all(
    s: Autoscaler,
    r: AdminRedis,
    clock: Clock,
    busy: AbstractSet[str] = frozenset(),
    protected: AbstractSet[str] = frozenset(),
) -> None:
    """Every machine the mock holds has a worker that registered at once and heart-beats (idle unless busy)."""
    for inst in await s.instances.live():
        if inst.provider_id and inst.status in ("provisioning", "booting", "running", "draining"):
            await put_worker(
                r,
                f"w-{inst.id}",
                inst.queue,
                inst.id,
                clock(),
                in_flight=int(inst.id in busy),
                protected=inst.id in protected,
            )


async def rentals(r: AdminRedis) -> list[dict[str, str]]:
    return [e for _, e in await r.xrange(keyspace.EVENTS) if e.get("kind") == "provisioning"]


async def live(s: Autoscaler) -> list[Instance]:
    return await s.instances.live()


# -- 1. the scale-down schedule loop ---------------------------------------------------------------------------


@pytest.mark.parametrize("spared_by", ["protected", "busy"])
async def test_a_spared_instance_at_the_down_schedule_starts_no_rent_and_drain_loop(
    r: AdminRedis, spared_by: str
) -> None:
    """Down at 07:30 spares instance A (protected, or busy all morning); the 08:00 up schedule asks for 2. Before the
    fix, `down_pending` stayed set and pinned the floor to min_workers: rent B, drain B next poll, rent again..."""
    clock = Clock(DAY + 7 * 3600 + 20 * 60)
    block = queue_block(
        max_workers=3,
        poll_interval="60s",
        boot_timeout="10m",
        scale_up=[
            {"trigger": "no_workers"},
            {"trigger": "schedule", "cron": "0 8 * * *", "workers": 2, "duration": "10h"},
        ],
        scale_down=[{"trigger": "idle", "timeout": "30m"}, {"trigger": "schedule", "cron": "30 7 * * *"}],
    )
    s, mock = make_scaler(r, clock, block)
    await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
    await s.tick()
    (a,) = await live(s)
    busy = {a.id} if spared_by == "busy" else set()
    if spared_by == "protected":
        await s.instances.set_protect(a.id, True)
    await qstore(r, clock).purge("gpu", "queued")
    created: list[float] = []
    while clock() < DAY + 9 * 3600:
        clock.advance(60)
        await serve_all(s, r, clock, busy=busy)
        before = mock.calls["create"]
        await s.tick()
        created += [clock()] * (mock.calls["create"] - before)
    assert all(t >= DAY + 8 * 3600 for t in created), created
    assert len(created) == 1, f"{len(created)} rentals between 08:00 and 09:00 (a rent-and-drain loop)"
    assert sorted(i.status for i in await live(s)) == ["running", "running"]
    assert len(await mock.all_ids()) == 2


# -- 2. a draining worker is not live --------------------------------------------------------------------------


async def test_a_draining_worker_does_not_count_as_live(r: AdminRedis) -> None:
    """The only instance is draining (it took a long job in the race window of its drain). Five new jobs must get
    a machine: before the fix the draining worker counted as live, so no_workers never fired (10 min, no rental)."""
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(max_workers=2, scale_down=[{"trigger": "idle", "timeout": "1m"}]))
    await qstore(r, clock).enqueue("gpu", JobSpec(input=0))
    await s.tick()
    (a,) = await live(s)
    await put_worker(r, "w1", "gpu", a.id, clock())
    clock.advance(30)
    await s.tick()
    await qstore(r, clock).purge("gpu", "queued")
    clock.advance(61)
    await put_worker(r, "w1", "gpu", a.id, clock())
    await s.tick()
    assert (await stored(s, a.id)).status == "draining"
    await qstore(r, clock).enqueue_many("gpu", [JobSpec(input=i) for i in range(5)])
    for _ in range(20):  # 10 minutes; the draining worker is busy with its long job all along
        clock.advance(30)
        await put_worker(r, "w1", "gpu", a.id, clock(), in_flight=1)
        await s.tick()
    others = [i for i in await live(s) if i.id != a.id]
    assert len(others) == 1 and others[0].status in ("provisioning", "booting")
    assert len(await mock.all_ids()) == 2


# -- 3. ambiguous create failures ------------------------------------------------------------------------------


async def test_create_answering_503_backs_off_and_alerts(r: AdminRedis) -> None:
    """A provider answering 503 to every create (listing works). Before the fix: 12 creates in 30 minutes, no
    backoff state, no alert (an ambiguous create only waited out the 120 s adoption grace, then rented again)."""
    clock = Clock()
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0, "create_errors": 10_000}})
    with running_sim(cfg, clock=clock) as url:
        rp = RunPodProvider("rp", RunPodConfig(api_key="k", base_url=url, gpu_type_id="NVIDIA RTX A5000"))
        s, _ = make_scaler(
            r,
            clock,
            queue_block(provider="rp"),
            server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r)},
        )
        s.override = {"rp": rp}
        await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
        paused_seen = False
        for _ in range(60):  # 30 minutes of 30 s polls
            await s.tick()
            snap = await snapshot(r, now=clock())
            paused_seen |= bool(snap["queues"].get("gpu", {}).get("backoffs", {}).get("rp"))
            clock.advance(30)
        creates = sim_call("GET", f"{url}/_sim/stats")["requests"].get("pods.create", 0)
        assert creates <= 6, f"{creates} creates in 30 minutes against a provider answering 503"
        assert paused_seen, "the backoff never showed in the status"
        alerts = [a for a in s.alerter.sent if a["kind"] == "autoscale_failure"]
        assert 1 <= len(alerts) <= 2 and "503" in alerts[0]["message"]  # once per 15 min cooldown
        assert sim_call("GET", f"{url}/_sim/machines")["machines"] == []
        await rp.aclose()
        await s.aclose()


async def test_a_lost_create_answer_is_adopted_and_not_rented_twice(r: AdminRedis) -> None:
    """The create rented the machine but its answer was lost: the record is adopted by its label (one machine),
    and the ambiguous failure still counts for backoff until the adoption proves the create went through."""
    clock = Clock()
    cfg = SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0, "create_lost": 1}})
    with running_sim(cfg, clock=clock) as url:
        vast = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090"))
        s, _ = make_scaler(
            r,
            clock,
            queue_block(provider="v"),
            server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r)},
        )
        s.override = {"v": vast}
        await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
        for _ in range(8):
            await s.tick()
            clock.advance(30)
        machines = [m for m in sim_call("GET", f"{url}/_sim/machines")["machines"] if m["phase"] != "deleted"]
        assert len(machines) == 1
        (inst,) = await live(s)
        assert inst.provider_id == machines[0]["id"]
        assert await r.hget(keyspace.queue_state("gpu"), "prov_failures:v") in (None, "0")  # adoption reset it
        await vast.aclose()
        await s.aclose()


# -- 4. max_workers, protected instances -----------------------------------------------------------------------


async def test_max_workers_counts_draining_machines(r: AdminRedis) -> None:
    """max_workers 1: the one machine drains a long job while new work arrives. Before the fix a second machine was
    rented next to it (2 billed); now nothing is rented until the draining one is gone, then exactly one."""
    clock = Clock()
    block = queue_block(
        max_workers=1,
        scale_up=[{"trigger": "queue_depth", "threshold": 0}],
        scale_down=[{"trigger": "idle", "timeout": "1m"}],
    )
    s, mock = make_scaler(r, clock, block)
    await qstore(r, clock).enqueue("gpu", JobSpec(input=0))
    await s.tick()
    (a,) = await live(s)
    await put_worker(r, "w1", "gpu", a.id, clock())
    await qstore(r, clock).purge("gpu", "queued")
    for _ in range(3):
        clock.advance(30)
        await put_worker(r, "w1", "gpu", a.id, clock())
        await s.tick()
    assert (await stored(s, a.id)).status == "draining"
    await qstore(r, clock).enqueue_many("gpu", [JobSpec(input=i) for i in range(3)])
    most = 0
    for _ in range(10):
        clock.advance(30)
        await put_worker(r, "w1", "gpu", a.id, clock(), in_flight=1)
        await s.tick()
        most = max(most, len(await mock.all_ids()))
    assert most == 1, f"{most} machines billed with max_workers 1"


@pytest.mark.parametrize("failure", ["heartbeat", "boot_timeout"])
async def test_a_protected_instance_is_kept_on_failure_and_alerted(r: AdminRedis, failure: str) -> None:
    """The machine you protected to debug must not die of the crash you wanted to debug: kept (and alerted),
    destroyed once unprotected; `protected_failures: destroy` restores the old behaviour."""
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(boot_timeout="5m"), alerts={"cooldown": 0})
    await qstore(r, clock).enqueue("gpu", JobSpec(input=0))
    await s.tick()
    (a,) = await live(s)
    await s.instances.set_protect(a.id, True)
    if failure == "heartbeat":
        await put_worker(r, "w1", "gpu", a.id, clock())
        clock.advance(30)
        await s.tick()
    await qstore(r, clock).purge("gpu", "queued")
    for _ in range(24):  # 12 minutes: no heartbeat (or no worker at all) all along
        clock.advance(30)
        await s.tick()
    got = await s.instances.get(a.id)
    assert got is not None and a.provider_id in await mock.all_ids(), "the protected machine was destroyed"
    assert got.status == "failed" and got.teardown == "kept", (got.status, got.teardown)
    assert any(a.id in al["message"] and "protected" in al["message"] for al in s.alerter.sent)
    await s.instances.set_protect(a.id, False)
    clock.advance(30)
    await s.tick()
    assert await mock.all_ids() == [] and (await stored(s, a.id)).teardown == "done"


async def test_protected_failures_destroy_is_a_choice(r: AdminRedis) -> None:
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(boot_timeout="5m", protected_failures="destroy"))
    await qstore(r, clock).enqueue("gpu", JobSpec(input=0))
    await s.tick()
    (a,) = await live(s)
    await s.instances.set_protect(a.id, True)
    for _ in range(12):
        clock.advance(30)
        await s.tick()
    assert a.provider_id not in await mock.all_ids()


# -- 7. mock providers: no vault, no real spend ----------------------------------------------------------------


async def test_a_mock_provider_needs_no_vault_key(r: AdminRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OFFLOAD_VAULT_MASTER_KEY", raising=False)
    store = ProviderStore(r)
    rec = await store.create("try-it", "mock", {"price_per_hour": 0.2})
    assert rec.type == "mock" and rec.config == {"price_per_hour": 0.2}
    assert (await store.update("try-it", {"boot_seconds": 5})).config["boot_seconds"] == 5
    clock = Clock()
    s, _ = make_scaler(r, clock, queue_block(provider="try-it"))
    s.override = {}
    await qstore(r, clock).enqueue("gpu", JobSpec(input=0))
    await s.tick()
    (inst,) = await live(s)
    assert inst.provider == "try-it" and inst.provider_id
    assert "OFFLOAD_VAULT_MASTER_KEY" not in os.environ
    await s.aclose()


async def test_mock_spend_never_counts_against_a_real_cap(r: AdminRedis) -> None:
    """A queue rehearsed on the mock ($10 of dry-run spend), then pointed at Vast.ai with a $5 daily cap: the
    real provider must rent (before the fix, the mock's spend blocked it)."""
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(daily_spend_cap=5.0, instance={"max_price_per_hour": 10.0}))
    await qstore(r, clock).enqueue("gpu", JobSpec(input=0))
    await s.tick()
    (a,) = await live(s)
    for _ in range(2):
        await put_worker(r, "w1", "gpu", a.id, clock() + 1800, in_flight=1)
        clock.advance(1800)
        await s.tick()
    snap = await snapshot(r, now=clock())
    assert snap["queues"]["gpu"]["spend_today"] == 0  # dry-run spend is reported apart
    assert snap["queues"]["gpu"]["dry_run_spend_today"] == pytest.approx(10.0, rel=0.01)
    await mock.vanish(a.provider_id)
    await s.tick()
    with running_sim(SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0}}), clock=clock) as url:
        vast = VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090"))
        s2, _ = make_scaler(
            r,
            clock,
            queue_block(provider="v", daily_spend_cap=5.0),
            owner="s2",
            server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r)},
        )
        s2.override = {"v": vast}
        clock.advance(61)
        await qstore(r, clock).enqueue("gpu", JobSpec(input=1))
        await s2.tick()
        assert [i.provider for i in await live(s2)] == ["v"]
        assert not any(al["kind"] == "spend_cap_reached" for al in s2.alerter.sent)
        await vast.aclose()
        await s2.aclose()


def test_offload_worker_reads_offload_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rented machine gets OFFLOAD_QUEUE; `offload worker` (both modes) serves it without --queue. Before the
    fix: "Missing option '--queue'"."""
    from typer.testing import CliRunner

    from offload.cli.app import app

    monkeypatch.delenv("OFFLOAD_SERVER", raising=False)
    monkeypatch.delenv("OFFLOAD_TOKEN", raising=False)
    runner = CliRunner()
    res = runner.invoke(app, ["worker", "--handler", "tests.support.handlers:echo"], env={"OFFLOAD_QUEUE": "gpu"})
    assert res.exit_code != 0 and "--queue" not in res.output and "needs --server" in res.output, res.output
    cfg = tmp_path / "offload.yaml"
    cfg.write_text("storage: {kind: local, path: %s}\nqueues: {}\n" % (tmp_path / "results"))
    res = runner.invoke(app, ["worker", "--config", str(cfg)], env={"OFFLOAD_QUEUE": "from-env"})
    assert res.exit_code != 0 and "Missing option" not in res.output and "from-env" in res.output, res.output


async def test_switching_autoscaling_off_drains_the_fleet_even_with_work_queued(r: AdminRedis) -> None:
    """Found by the property test: with jobs still queued, `enabled: false` never scaled down (the scale-up demand
    held every machine), so the machines the autoscaler rented ran on unmanaged. Now they drain; a busy one
    finishes its job first."""
    clock = Clock()
    s, mock = make_scaler(r, clock, queue_block(max_workers=2, scale_up=[{"trigger": "queue_depth", "threshold": 0}]))
    await qstore(r, clock).enqueue_many("gpu", [JobSpec(input=i) for i in range(20)])
    await s.tick()
    (a,) = await live(s)
    await put_worker(r, "r-w1", "gpu", a.id, clock(), in_flight=1)
    clock.advance(30)
    await s.tick()
    s.settings.queues["gpu"].autoscale["enabled"] = False  # type: ignore[index]
    for _ in range(4):
        clock.advance(30)
        await put_worker(r, "r-w1", "gpu", a.id, clock(), in_flight=1)
        await s.tick()
    assert (await stored(s, a.id)).status == "draining"
    assert a.provider_id in await mock.all_ids()  # busy: it finishes its job first
    clock.advance(30)
    await put_worker(r, "r-w1", "gpu", a.id, clock(), in_flight=0)
    await s.tick()
    clock.advance(30)
    await s.tick()
    assert await mock.all_ids() == [] and await live(s) == []
