"""A whole day of bursty load through the autoscaler on a simulated clock, without sleeping.

Simulated GPU workers live on the mock provider's machines: a machine boots in 90 s, then its worker registers
(with the instance id), heart-beats, claims one job at a time through the real queue store and takes 3 minutes
per job; it stops claiming once its registry record says draining, and it dies with its machine. Every 7th
machine never gets a worker (a bad boot). During the day: bursts, a schedule pre-warm, a pre-empted machine, a
server restart in the middle of a create call, a provider that fails teardown twice, and a protected worker.

At the end: every job succeeded, no machine is left at the provider, no busy or protected machine was
destroyed, and no rental was stacked for depth or latency on one booting within twice the measured boot time
(the bad boot holds them only that long: past it, it is presumed stuck).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import Clock, drop_worker, make_scaler, put_worker, queue_block

from offload.autoscale import keyspace
from offload.autoscale.providers import LaunchSpec, Machine
from offload.autoscale.providers.mock import MockConfig, MockProvider
from offload.autoscale.safety import boot_hold
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.state import QueueState
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

DAY_START = datetime(2027, 1, 18, 0, 0, tzinfo=UTC).timestamp()  # a Monday
TICK = 60.0
JOB_SECONDS = 180.0
BOOT_SECONDS = 90.0
BURSTS = {"03:00": 30, "09:30": 150, "09:40": 60, "13:00": 80, "17:45": 120, "23:10": 5}


class Crash(BaseException):
    """The server process dies (not an Exception: nothing may catch it on the way out)."""


class CrashingMock(MockProvider):
    """Rents the machine, then the process dies before it learns the machine's id."""

    crash_next = False

    async def create(self, spec: LaunchSpec) -> Machine:
        machine = await super().create(spec)
        if CrashingMock.crash_next:
            CrashingMock.crash_next = False
            raise Crash
        return machine


@dataclass
class SimWorker:
    id: str
    instance: str
    provider_id: str
    protected: bool
    job: tuple[str, str] | None = None
    job_done_at: float = 0.0


class Fleet:
    """The GPU machines' side: workers that boot, work, drain, and die with their machine."""

    def __init__(self, r: AdminRedis, store: QueueStore, mock: MockProvider, clock: Clock) -> None:
        self.r, self.store, self.mock, self.clock = r, store, mock, clock
        self.workers: dict[str, SimWorker] = {}
        self.seen: set[str] = set()
        self.busy_destroyed: list[str] = []
        self.protected_destroyed: list[str] = []
        self.preempted: set[str] = set()
        self.count = 0

    async def step(self, scaler: Autoscaler) -> None:
        now = self.clock()
        machines = {m.provider_id: m for m in await self.mock.list()}
        for w in list(self.workers.values()):
            if w.provider_id not in machines:  # its machine was destroyed or pre-empted
                if w.job is not None and w.provider_id not in self.preempted:
                    self.busy_destroyed.append(w.instance)
                if w.protected and w.provider_id not in self.preempted:
                    self.protected_destroyed.append(w.instance)
                await drop_worker(self.r, w.id)
                del self.workers[w.id]
        for m in machines.values():
            if m.provider_id in self.seen or now - float(m.raw["created"]) < BOOT_SECONDS:
                continue
            self.seen.add(m.provider_id)
            self.count += 1
            if self.count % 7 == 3:
                continue  # this machine never starts its worker
            instance = m.label.removeprefix("offload-")
            w = SimWorker(f"r-gpu{self.count}", instance, m.provider_id, protected=self.count == 2)
            self.workers[w.id] = w
        for w in self.workers.values():
            if w.job is not None and now >= w.job_done_at:
                await self.store.complete(w.job[0], w.job[1], f"results/{w.job[0]}.json")
                w.job = None
            draining = await self.r.hget(f"offload:rworker:{w.id}", "draining") == "1"
            if w.job is None and not draining:
                got = await self.store.claim("gpu", w.id, 1, lease_ms=600_000)
                if got:
                    w.job, w.job_done_at = (got[0].id, got[0].token), now + JOB_SECONDS
            if w.job is not None:
                await self.store.heartbeat("gpu", w.id, [w.job[0]], lease_ms=600_000)
            await put_worker(
                self.r, w.id, "gpu", w.instance, now, in_flight=int(w.job is not None), protected=w.protected
            )
            if draining:
                await self.r.hset(f"offload:rworker:{w.id}", "draining", 1)
        await self.store.reap("gpu")


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(fast_valkey_url))
    yield client
    await client.aclose()


def day_block() -> dict[str, Any]:
    return queue_block(
        max_workers=4,
        poll_interval="60s",
        boot_timeout="10m",
        scale_up=[
            {"trigger": "no_workers"},
            {"trigger": "queue_depth", "threshold": 20},
            {"trigger": "latency", "max_latency": "5m"},
            {"trigger": "schedule", "cron": "0 8 * * 1-5", "workers": 2, "duration": "10h"},
        ],
        scale_down=[{"trigger": "idle", "timeout": "10m"}, {"trigger": "schedule", "cron": "0 22 * * *"}],
    )


def new_scaler(r: AdminRedis, clock: Clock, owner: str) -> tuple[Autoscaler, MockProvider]:
    scaler, _ = make_scaler(r, clock, day_block(), owner=owner, server={"leader_ttl": 90})
    mock = CrashingMock(
        "m",
        MockConfig(boot_seconds=BOOT_SECONDS, fail_destroys=2, price_per_hour=0.4, allow_worker_protect=True),
        r,
        clock,
    )
    scaler.override = {"m": mock}
    return scaler, mock


async def test_a_day_of_bursty_load(r: AdminRedis) -> None:
    clock = Clock(DAY_START)
    store = QueueStore(r, clock_ms=lambda: int(clock() * 1000))
    scaler, mock = new_scaler(r, clock, "server-1")
    fleet = Fleet(r, store, mock, clock)
    stacked: list[str] = []
    max_active = 0
    restarted = preempted = False
    enqueued = 0
    while clock() < DAY_START + 86_400 + 3 * 3600:
        hhmm = datetime.fromtimestamp(clock(), UTC).strftime("%H:%M")
        if clock() < DAY_START + 86_400 and hhmm in BURSTS:
            await store.enqueue_many("gpu", [JobSpec(input={"n": enqueued + i}) for i in range(BURSTS[hhmm])])
            enqueued += BURSTS[hhmm]
            if hhmm == "09:40" and not restarted:
                CrashingMock.crash_next = True  # the next rental dies mid-create
        if hhmm == "14:00" and not preempted and fleet.workers:
            victim = next(w for w in fleet.workers.values() if not w.protected)
            fleet.preempted.add(victim.provider_id)
            await mock.vanish(victim.provider_id)
            preempted = True
        if hhmm == "23:30":  # the protected worker is restarted without OFFLOAD_PROTECTED
            for w in fleet.workers.values():
                w.protected = False
        await fleet.step(scaler)
        live_before = await scaler.instances.live()
        registered = {w.instance for w in fleet.workers.values()}
        hold = boot_hold((await QueueState.load(r, "gpu")).boot_ewma, 600.0)  # then it is presumed stuck
        booting = any(
            i.status in ("provisioning", "booting")
            and i.id not in registered
            and i.teardown != "pending"
            and clock() - i.created_at < hold
            for i in live_before
        )  # still booting, and within its expected boot, after this tick
        before_ids = {i.id for i in live_before}
        try:
            await scaler.tick()
        except Crash:
            restarted = True
            await scaler.alerter.aclose()
            clock.advance(TICK * 2)  # the dead server's lock runs out; a new process starts
            scaler, mock = new_scaler(r, clock, "server-2")
            fleet.mock = mock
            continue
        live = await scaler.instances.live()
        active = [i for i in live if i.status in ("provisioning", "booting", "running")]
        max_active = max(max_active, len(active))
        new = [i.id for i in live if i.id not in before_ids]
        if booting and new:
            reasons = [
                e["message"]
                for _, e in await r.xrange(keyspace.EVENTS)
                if e.get("kind") == "provisioning" and e.get("instance") in new
            ]
            stacked += [m for m in reasons if "schedule" not in m and "no_workers" not in m and "min_workers" not in m]
        clock.advance(TICK)
    await fleet.step(scaler)

    assert restarted and preempted
    totals = (await store.stats("gpu")).counts
    assert totals["succeeded"] == enqueued and totals["queued"] == totals["active"] == 0, totals
    assert await mock.all_ids() == []  # zero leaked machines
    assert await scaler.instances.live() == []
    assert fleet.busy_destroyed == [] and fleet.protected_destroyed == []
    assert stacked == []
    assert max_active <= 4
    history = await scaler.instances.recent(500)
    ended = " ".join(i.reason for i in history)
    assert "boot_timeout" in ended and "vanished" in ended
    adopted = [e for _, e in await r.xrange(keyspace.EVENTS) if e.get("kind") == "adopted"]
    assert len(adopted) == 1  # the machine rented by the crashed server was found by its label
    assert any(i.teardown_attempts >= 1 for i in history)  # teardown failed and was retried
    assert sum(i.cost for i in history) > 0
