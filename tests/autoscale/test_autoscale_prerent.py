"""The learned pre-rent of a queue with overflow (`overflow.predict`, offload/autoscale/predict.py) and the rule that
sizes a burst's machines by what they cost (overflow.burst_machines), on bench.cost's simulated clock (real
Valkey, the real autoscaler and store, the mock provider; the overflow routing is bench/cost/hybrid.py's).

- a machine rented for a burst must pay for its boot and its idle tail from the work it starts in time;
- the profile keeps the last `recur` periods (bounded), a forecast needs the burst in every one of them, and a
  damaged record is learnt afresh; bad `predict` blocks fail naming the field;
- bursts every 10 minutes: from the fourth, machines are rented a boot ahead and serve the burst as it lands,
  and the decision says why; a new leader after a restart goes on with the profile in Valkey; a burst that does
  not come leaves its machines to the scale-in rules (gone within minutes, none rented after);
- a steady load with one spike (no recurrence): the same rentals, to the second, as without `predict`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_autoscale_scale_in import second_server

from bench.cost.hybrid import HybridWorld, Prices
from bench.cost.world import QUEUE, START, Hosts, Policy
from offload.autoscale import overflow, predict
from offload.autoscale.settings import Predict, validate_autoscale
from offload.autoscale.state import QueueState, load_decision
from offload.connection import connect
from offload.errors import ConfigError

TEN = Predict(period=600.0, bin=60.0, recur=3)


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[Any]:
    client = await connect(fast_valkey_url)
    yield client
    await client.aclose()


def test_a_burst_machine_pays_for_its_boot_and_its_tail() -> None:
    spare = overflow.BurstCost(boot=180.0, keep_busy=0.4, tail=30.0)  # a 3-minute boot, the 30 s spare
    timeout = overflow.BurstCost(boot=180.0, keep_busy=0.4, tail=600.0)  # a 10-minute idle timeout
    # `after` 5 min, 3-minute boot: 2 jobs x 60 s in time (180 s of work saves 90 s' worth) against boot + tail
    assert overflow.burst_machines(100, 10.0, 1.0, 300.0, spare) == 0
    # `after` 7.5 min: 4.5 jobs each, which pays with a 30 s tail but not with a 10-minute idle timeout
    assert overflow.burst_machines(100, 10.0, 1.0, 450.0, spare) == 20
    assert overflow.burst_machines(100, 10.0, 1.0, 450.0, timeout) == 0
    assert overflow.burst_machines(100, 10.0, 1.0, 1800.0, timeout) == 4  # 27 each: 27 min pays
    assert overflow.burst_machines(92, 10.0, 1.0, 1800.0, spare) == 4  # enough for all, once one pays
    assert overflow.burst_machines(5, 10.0, 1.0, 1800.0, spare) == 0  # the fleet starts them in time
    assert overflow.burst_machines(100, 0.0, 0.0, 1800.0, spare) == 0  # no rate: nothing counted on
    assert overflow.pays(100.0, 150.0, 0.4) and not overflow.pays(100.0, 151.0, 0.4)  # 100 x (1/0.4 - 1)


def test_the_profile_is_bounded_and_a_forecast_needs_every_period() -> None:
    profile: predict.Profile = {}
    for minute in range(591):  # 59 10-minute periods, a job a minute and 40 at :02 of each
        now = START + 60 * minute + 15
        profile = predict.record(profile, now, 1 + (40 if minute % 10 == 2 else 0), TEN)
        assert len(profile) <= (TEN.recur + 1) * 10 + 1
    now = START + 590 * 60 + 30  # :00:30 of a period: the burst at :02 is 90 s away
    fc = predict.forecast(profile, now, 200.0, TEN)
    assert fc is not None and fc.jobs == 4 + 40 and fc.at == 120.0  # bins :00-:03 of each period, most at :02
    gone = {k: n for k, n in profile.items() if not START / 60 + 570 <= k < START / 60 + 580}  # one period lost
    assert predict.forecast(gone, now, 200.0, TEN) is None  # the burst in 2 of the last 3 periods: none
    assert predict.forecast({}, now, 200.0, TEN) is None
    assert predict.parse(predict.dump(profile)) == profile
    assert predict.parse("1:2,oops") == {} and predict.parse("") == {}
    assert predict.phase_text(START + 120, 3600) == ":02" and predict.phase_text(START + 3720, 86400) == "09:02"


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({}, "q.overflow.predict.period: Field required"),
        ({"period": "1h", "bin": "2h"}, "q.overflow.predict.bin: 7200s is longer than period (3600s)"),
        ({"period": "7d"}, "q.overflow.predict: period / bin: 10080 bins, at most 1440"),
        ({"period": "1h", "recur": 0}, "q.overflow.predict.recur"),
        ({"period": "soon"}, "q.overflow.predict.period"),
    ],
)
def test_bad_predict_blocks_name_the_field(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_autoscale({"overflow": {"backends": ["a"], "predict": block}}, "q")
    assert str(err.value).startswith(message), str(err.value)


class Watched(HybridWorld):
    """Keeps the decision's reasons; may hand the queue to a second server once (as if the first were killed)."""

    def __init__(self, *args: Any, swap_at: float | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reasons: list[tuple[float, str]] = []
        self.swap_at = swap_at

    async def after_tick(self) -> None:
        await super().after_tick()
        decision = await load_decision(self.r, QUEUE)
        assert decision is not None
        self.reasons += [(self.clock() - START, why) for why in decision["reasons"]]
        if self.swap_at is not None and self.clock() >= START + self.swap_at:
            self.swap_at = None
            self.scaler = second_server(self)  # it leads once the first one's lease runs out


def bursts(minutes: list[int], size: int = 40) -> list[tuple[float, float]]:
    return [(60.0 * m, 60.0) for m in minutes for _ in range(size)]


async def play(r: Any, jobs: list[tuple[float, float]], predicted: bool = True, **kwargs: Any) -> Watched:
    await r.flushdb()
    flow: dict[str, Any] = {"backends": ["serverless"], "after": "5m", "run_time": "1m", "window": "20m", "span": "2m"}
    if predicted:
        flow["predict"] = {"period": "10m", "bin": "1m", "recur": 3}
    policy = Policy("hybrid", 8, poll=30.0, by_cost=True, overflow=flow)
    world = Watched(r, jobs, policy, Hosts(boot=(120.0, 180.0)), Prices(), 0, **kwargs)
    await world.run(3 * 3600.0)
    return world


def rented_between(world: HybridWorld, lo_min: float, hi_min: float) -> list[Any]:
    return [x for x in world.served.rentals if START + 60 * lo_min <= x.created < START + 60 * hi_min]


def every_job_once(world: HybridWorld) -> None:
    done = world.served.done_by
    assert sorted(done) == list(range(len(world.jobs))) and all(len(k) == 1 for k in done.values())


async def test_recurring_bursts_are_met_by_machines_rented_a_boot_ahead(r: Any) -> None:
    world = await play(r, bursts([8, 18, 28, 38, 48]))
    every_job_once(world)
    assert not rented_between(world, 0, 33), "the first three bursts are overflow's: nothing recurred yet"
    ahead = rented_between(world, 33, 38)
    assert len(ahead) >= 5, len(ahead)  # 40 jobs, 6 a machine within 5 min: 7 machines rented before :38
    on_fleet = [n for n, (a, _) in enumerate(world.jobs) if a == 38 * 60 and world.served.done_by[n] == ["fleet"]]
    assert len(on_fleet) >= 25, len(on_fleet)  # they serve the burst as it lands
    why = [w for t, w in world.reasons if 33 * 60 <= t < 38 * 60 and w.startswith("pre-rent")]
    assert why and "for the burst of 40 job(s) seen at 480s into the period" in why[0], why[0]
    assert "in each of the last 3 period(s) of 10 min" in why[0], why[0]
    state = await QueueState.load(r, QUEUE)
    assert 0 < len(predict.parse(state.profile)) <= 4 * 10 + 1  # bounded: the last periods only


async def test_a_new_leader_pre_rents_from_the_profile_in_valkey(r: Any) -> None:
    world = await play(r, bursts([8, 18, 28, 38]), swap_at=30 * 60.0)
    every_job_once(world)
    assert len(rented_between(world, 33, 38)) >= 5  # the second server leads from about :32 and rents ahead
    assert any(w.startswith("pre-rent") for t, w in world.reasons if 33 * 60 <= t < 38 * 60)


async def test_a_burst_that_does_not_come_leaves_its_machines_to_scale_in(r: Any) -> None:
    world = await play(r, [*bursts([8, 18, 28, 38]), (70 * 60.0, 60.0)])  # and one job later: the world goes on
    every_job_once(world)
    for_48 = rented_between(world, 43, 48)
    assert for_48, "the burst expected at :48 was pre-rented"
    assert all(x.jobs == 0 and x.gone is not None and x.gone <= START + 52 * 60 for x in for_48), [
        (x.jobs, (x.gone or 0) - START) for x in for_48
    ]
    assert not rented_between(world, 49, 70), "nothing rented once the burst's time has passed"
    assert not [w for t, w in world.reasons if t >= 49 * 60 and w.startswith("pre-rent")]


async def test_without_recurrence_predict_changes_nothing(r: Any) -> None:
    """A spike seen once rents nothing ahead: every job starts when and where it did without `predict`, on the
    same machines. The steady load itself came in every period, so once it ends (and the base with it) the
    forecast holds two machines for its next few minutes, then lets them go."""
    steady = [(40.0 * i, 100.0) for i in range(int(2700 / 40))]  # 2.5 machines' worth for 45 min, and a spike
    jobs = sorted(steady + [(30 * 60.0, 100.0)] * 60)
    plain = await play(r, jobs, predicted=False)
    learnt = await play(r, jobs)
    every_job_once(learnt)
    assert plain.served.rentals, "the base load rents machines"
    assert [(x.created, x.jobs) for x in learnt.served.rentals] == [(x.created, x.jobs) for x in plain.served.rentals]
    assert learnt.served.started == plain.served.started and learnt.served.serverless_s == plain.served.serverless_s
    ended = max(plain.served.started.values()) - START + 100.0
    assert not any(w.startswith("pre-rent") for t, w in learnt.reasons if t < ended)
    assert all(x.gone is not None and x.gone - START <= ended + 600 for x in learnt.served.rentals)


async def test_two_plays_of_one_trace_are_the_same(r: Any) -> None:
    """Machines rented in one evaluation, registering in another: the measured boot folds their boots in the
    order they registered, not the store's order of their random ids, so the pre-rent's lead (and every later
    decision) is the same each play; the burst's jobs, arriving together, are claimed in trace order."""
    jobs = bursts([8, 18, 28, 38, 48, 58])
    plays = [await play(r, jobs) for _ in range(3)]
    seen = [
        ([(x.created, x.boot_at, x.gone, x.jobs) for x in w.served.rentals], w.served.started, w.served.serverless_s)
        for w in plays
    ]
    assert seen[0] == seen[1] == seen[2]
    assert [w.reasons for w in plays[1:]] == [plays[0].reasons] * 2
    state = await QueueState.load(r, QUEUE)
    assert 120.0 <= state.boot_ewma <= 180.0
