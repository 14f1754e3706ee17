"""Scale-in by cost (`scale_down: [{trigger: cost}]`) on the simulated clock of bench/cost/world.py: the real
autoscaler and store, the mock provider, machines that boot in a fixed time and serve one job at a time.

- an expected gap shorter than a boot keeps the machines through it (the idle timer alone re-rents them);
- an expected gap longer than a boot releases them at once, not after the idle timeout;
- with no gap seen yet the idle timeout holds, and the first gap seen turns it round;
- the gaps learnt survive a leader change (they live in the queue's state in Redis).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench.cost.world import QUEUE, START, CostWorld, Hosts, Policy
from offload.autoscale.safety import RECENT_TASK
from offload.autoscale.scale_in import cost_trigger, hold, idle_tail
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.settings import Cost, validate_autoscale
from offload.autoscale.state import QueueState, load_decision
from offload.autoscale.status import explain
from offload.config import Settings
from offload.connection import connect

LIMIT = 6 * 3600.0


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[Any]:
    client = await connect(fast_valkey_url)
    yield client
    await client.aclose()


class Watched(CostWorld):
    """Records every reason the autoscaler gave, with its time; `swap_at` hands the queue to a second server."""

    def __init__(self, *args: Any, swap_at: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reasons: list[tuple[float, str]] = []
        self.swap_at = swap_at

    async def machines(self) -> None:
        await super().machines()
        decision = await load_decision(self.r, QUEUE)
        if decision is not None:
            self.reasons += [(decision["at"], why) for why in decision["reasons"] if why.startswith("cost:")]
        if self.swap_at is not None and self.clock() >= START + self.swap_at:
            self.swap_at = None
            self.scaler = second_server(self)

    def said(self, text: str, after: float = 0.0) -> bool:
        return any(text in why for at, why in self.reasons if at >= START + after)


def second_server(world: CostWorld) -> Autoscaler:
    """Another server over the same Redis: it leads once the first one's lease runs out (4 polls)."""
    block = world.policy.block(world.hosts.price)
    settings = Settings.model_validate(
        {"queues": {QUEUE: {"autoscale": block}}, "autoscaler": {"worker_key": "ofk_worker_key", "leader_ttl": 120}}
    )
    return Autoscaler(
        world.r,
        settings,
        clock=world.clock,
        owner="second",
        provider_override={"m": world.provider},
        drain_settle=0.0,
        env={},
    )


def bursts(*at: float, jobs: int = 2, run: float = 60.0) -> list[tuple[float, float]]:
    return [(t, run) for t in at for _ in range(jobs)]


def lives(world: CostWorld) -> list[float]:
    """How long each rental billed, create to destroy, in order of renting."""
    return [(x.gone or 0.0) - x.created for x in world.served.rentals]


def test_the_cost_trigger_is_a_scale_down_setting() -> None:
    cfg = validate_autoscale({"scale_down": [{"trigger": "idle", "timeout": "5m"}, {"trigger": "cost"}]})
    assert [t.trigger for t in cfg.scale_down] == ["idle", "cost"]
    cfg = validate_autoscale({"scale_down": [{"trigger": "cost", "boot_time": "4m"}]})
    assert isinstance(cfg.scale_down[0], Cost) and cfg.scale_down[0].boot_time == 240.0


async def test_a_short_gap_keeps_the_machines(r: Any) -> None:
    """Gaps of ~2 min against a 200 s boot: the machines stay through each, although the idle timer (60 s) would
    drain them and rent again every burst."""
    jobs = bursts(0, 400, 580, 760, 940)
    hosts = Hosts(boot=(200.0, 200.0))
    await QueueState().save(r, QUEUE, gap_ewma=90.0, gaps=1)
    world = Watched(r, jobs, Policy("cost", 2, 1, idle_timeout=60.0, by_cost=True), hosts)
    served = await world.run(LIMIT)
    assert served.done == len(jobs) and len(served.rentals) == 2
    assert world.said("cost: keep idle machines up to")

    await r.flushdb()
    timer = await CostWorld(r, jobs, Policy("timer", 2, 1, idle_timeout=60.0), hosts).run(LIMIT)
    assert timer.done == len(jobs) and len(timer.rentals) > 2


async def test_a_long_gap_releases_the_machines_at_once(r: Any) -> None:
    """An expected gap of 30 min against a 2 min boot: each machine goes within a poll or two of its last job
    (2 min boot + 1 min job + ~1 min), not after the 10-minute idle timeout."""
    await QueueState().save(r, QUEUE, gap_ewma=1800.0, gaps=1)
    world = Watched(r, bursts(0, 1800), Policy("cost", 2, 1, by_cost=True), Hosts(boot=(120.0, 120.0)))
    served = await world.run(LIMIT)
    assert served.done == 4 and len(served.rentals) == 4
    assert all(life <= 300.0 for life in lives(world)), lives(world)
    assert world.said("cost: release idle machines at once: expected gap 30.0 min ($0.250) idle vs re-rent")


async def test_no_history_falls_back_to_the_idle_timeout(r: Any) -> None:
    """No gap seen yet: the first burst's machines idle the full 10 minutes; the gap that follows (~26 min) is
    learnt, and the second burst's machines go at once."""
    world = Watched(r, bursts(0, 1800), Policy("cost", 2, 1, by_cost=True), Hosts(boot=(120.0, 120.0)))
    served = await world.run(LIMIT)
    first, second = lives(world)[:2], lives(world)[2:]
    assert served.done == 4 and len(second) == 2
    assert all(life >= 120.0 + 60.0 + 600.0 - 30.0 for life in first), first
    assert all(life <= 300.0 for life in second), second
    assert world.said("cost: no gap between bursts seen yet; idle timeout 10.0 min")
    assert world.said("cost: release idle machines at once", after=1800.0)


async def test_the_gaps_learnt_survive_a_leader_change(r: Any) -> None:
    """A second server takes over between the second and third bursts: it releases the third burst's machines at
    once from the gap the first one learnt, and goes on counting the gaps."""
    world = Watched(r, bursts(0, 1800, 3600), Policy("cost", 2, 1, by_cost=True), Hosts(boot=(120.0, 120.0)))
    world.swap_at = 2400.0
    served = await world.run(LIMIT)
    assert served.done == 6 and world.scaler.leader.owner == "second"
    assert all(life <= 300.0 for life in lives(world)[2:]), lives(world)
    assert world.said("cost: release idle machines at once", after=3600.0)
    state = await QueueState.load(r, QUEUE)
    assert state.gaps == 2 and 1500.0 < state.gap_ewma < 1800.0 and 120.0 <= state.boot_ewma <= 160.0


def test_status_shows_the_reckoning_apart() -> None:
    why = "cost: release idle machines at once: expected gap 35.0 min idle vs re-rent 3.0 min configured boot"
    lines = explain({"decision": {"at": 0.0, "pending": 0, "live_workers": 2, "reasons": [why]}}, 0.0)
    assert "because: no trigger fired (0 ready, 2 live workers)" in lines and f"scale-in by {why}" in lines


def test_a_queue_whose_jobs_wait_two_runs_for_a_machine_keeps_no_idle_one() -> None:
    """With overflow, `after` of at least two runs: idle machines above the base go at once, whatever the gaps
    say (a job that finds the fleet busy waits for one to finish); under two runs, or no run time known, the
    gaps decide as without overflow."""
    cfg = validate_autoscale(
        {"scale_down": [{"trigger": "cost"}], "overflow": {"backends": ["sls"], "after": "5m"}, "max_workers": 4}
    )
    trig = cost_trigger(cfg)
    assert trig is not None
    short_gaps = QueueState(gap_ewma=60.0, gaps=3, boot_ewma=180.0)
    patient = hold(cfg, trig, short_gaps, 1.0, run_s=150.0)
    assert patient.seconds == 0.0 and "above the base at once" in patient.why and "2.0 runs of 150s" in patient.why
    assert hold(cfg, trig, short_gaps, 1.0, run_s=151.0).seconds == 180.0  # under two runs: keep for a boot
    assert hold(cfg, trig, short_gaps, 1.0).seconds == 180.0  # no run time known
    assert idle_tail(cfg, short_gaps, 150.0) == RECENT_TASK and idle_tail(cfg, short_gaps, 151.0) == 180.0
    plain = validate_autoscale({"scale_down": [{"trigger": "cost"}], "max_workers": 4})
    assert hold(plain, trig, short_gaps, 1.0, run_s=10.0).seconds == 180.0  # no overflow: nothing changes
