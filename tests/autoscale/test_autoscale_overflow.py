"""A fleet that has serverless overflow (`autoscale.overflow`): the pure sizing pieces (offload/autoscale/overflow.py),
the block's validation, and the real autoscaler sizing such a queue on bench.cost's simulated clock (real Valkey,
the real store, the mock provider; the overflow routing is bench/cost/hybrid.py's).

- the predicted wait and the capacity within a horizon are each other's inverse, and never start a job before an
  idle or booted machine can take it;
- the base load is a low quantile of the window's buckets: a burst leaves it alone, a steady load sets it;
- a base machine is kept only while it would be busy at least `keep_busy` of the time;
- a `run_time` prior stands in for the mean run time until runs are measured, and weighs as PRIOR_RUNS runs
  after; with it the first burst, before any run is measured, rents machines and stays on them; without it, that
  burst is overflow's;
- bad blocks fail naming the field; overflow backends must be configured backends of a GPU-worker queue;
- on the simulated clock, a steady load and a burst: the fleet holds the base, the burst goes to overflow, every
  job is completed once by one kind, and the decision says why; a damaged arrivals record does not fail the
  evaluation (the measurement starts over); a new leader goes on with the measured window;
- a queue without overflow is sized as before.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from test_autoscale_scale_in import second_server

from bench.cost.hybrid import HybridWorld, Prices
from bench.cost.world import QUEUE, START, CostWorld, Hosts, Policy
from offload.autoscale import overflow
from offload.autoscale.hybrid import PRIOR_RUNS, expected_run, parse_samples, with_prior
from offload.autoscale.keyspace import queue_state
from offload.autoscale.settings import Overflow, validate_autoscale
from offload.autoscale.state import QueueState, load_decision
from offload.config import load_settings
from offload.connection import connect
from offload.errors import ConfigError

FLOW = Overflow.model_validate({"backends": ["sls"]})


@pytest.fixture
async def r(fast_valkey_url: str) -> AsyncIterator[Any]:
    client = await connect(fast_valkey_url)
    yield client
    await client.aclose()


def test_predicted_wait_counts_idle_serving_and_booting_machines() -> None:
    assert overflow.predicted_wait(0, 1, 1, 1.0, []) == 0.0  # an idle machine takes it now
    assert overflow.predicted_wait(1, 1, 1, 1.0, []) == 60.0  # the next frees in a run (1 job a minute)
    assert overflow.predicted_wait(3, 0, 2, 1.0, []) == 120.0  # two machines, four jobs to start
    assert overflow.predicted_wait(0, 0, 0, 1.0, [120.0, 300.0]) == 120.0  # the first boot takes it
    assert overflow.predicted_wait(1, 0, 0, 1.0, [120.0, 300.0]) == 180.0  # it frees before the second boots
    assert overflow.predicted_wait(0, 0, 0, 1.0, [-30.0]) == 0.0  # overdue: any moment
    assert overflow.predicted_wait(0, 0, 0, 1.0, []) is None  # no fleet: never
    assert overflow.predicted_wait(5, 0, 0, 0.0, [60.0]) is None  # no rate measured: only the boot's one job


def test_predicted_wait_and_capacity_are_inverse_and_monotone() -> None:
    for serving, idle, rate, booting in [(0, 0, 0.7, [50.0, 200.0]), (3, 1, 2.0, []), (2, 0, 0.4, [0.0, 400.0])]:
        last = 0.0
        for position in range(40):
            wait = overflow.predicted_wait(position, idle, serving, rate, booting)
            assert wait is not None and wait >= last, (serving, position)
            last = wait
            assert overflow.capacity(idle, serving, rate, booting, wait) >= position + 1 - 1e-6
            if wait > 1:
                assert overflow.capacity(idle, serving, rate, booting, wait - 1) < position + 1


def samples(rate_per_min: float, minutes: int, burst_at: int | None = None, burst: int = 0) -> list[overflow.Sample]:
    out, total = [], 0
    for m in range(minutes + 1):
        out.append((START + 60 * m, total))
        total += round(rate_per_min) + (burst if m == burst_at else 0)
    return out


def test_base_load_is_a_low_quantile_of_the_window() -> None:
    now = START + 60 * 60
    steady = overflow.base_load(samples(1, 60), now, 120.0, FLOW)  # 1 job a minute x 2 min: 2 machines' worth
    assert steady == (2.0, 6)
    base, buckets = overflow.base_load(samples(0, 60, burst_at=30, burst=200), now, 60.0, FLOW)
    assert (base, buckets) == (0.0, 6)  # one bucket holds the burst; the quantile does not see it
    assert overflow.base_load(samples(1, 5), START + 300, 120.0, FLOW) == (0.0, 0)  # no whole bucket yet
    assert overflow.base_load([], now, 120.0, FLOW) == (0.0, 0)
    median = Overflow.model_validate({"backends": ["sls"], "quantile": 1.0})
    assert overflow.base_load(samples(0, 60, burst_at=30, burst=200), now, 60.0, median)[0] == 200 * 60 / 600


def test_samples_keep_one_window_and_start_over_on_a_reset_store_or_clock() -> None:
    kept = overflow.keep_samples(samples(1, 120), START + 121 * 60, 121, 3600)
    assert kept[0][0] < START + 61 * 60 <= kept[1][0] and kept[-1] == (START + 121 * 60, 121)
    assert overflow.keep_samples(kept, START + 122 * 60, 3, 3600) == [(START + 122 * 60, 3)]  # total went down
    assert overflow.keep_samples(kept, START, 200, 3600) == [(START, 200)]  # the clock went back
    assert parse_samples("1.5:3,2.5:4") == [(1.5, 3), (2.5, 4)]
    assert parse_samples("1.5:3,garbage") == [] and parse_samples("") == []


def test_keep_machines_pays_for_each_machine_it_keeps() -> None:
    assert overflow.keep_machines(0.0, 0.4, 16) == 0
    assert overflow.keep_machines(1.5, 0.4, 16) == 2  # Erlang: the 2nd carries 0.43, the 3rd 0.26
    assert overflow.keep_machines(0.5, 0.4, 16) == 0  # alone it would be busy 33 % of the time
    assert overflow.keep_machines(100.0, 0.4, 8) == 8  # max_workers caps it
    assert overflow.keep_machines(1.5, 0.01, 16) > 4  # near-free machines: keep many


def test_the_delay_model_is_erlang_b_at_no_patience_and_erlang_c_at_a_long_one() -> None:
    """overflowed(n, A, p) = E / n / (1 / (A B(n-1)) + (1 - E) / (n - A) + E / n), E = e^-(n - A)p, by hand:
    - n 1, A 1, p 1: B(0) = 1, E = 1 and (1 - E) / (n - A) -> p = 1: (1 / 1) / (1 + 1 + 1) = 1/3 (the machine is
      busy 2/3 of the time);
    - n 2, A 1, p 0: B(1) = 1/2, E = 1: (1/2) / (2 + 0 + 1/2) = 1/5 = Erlang B(2) at A 1;
    - n 2, A 1, p ln 2: E = 1/2: (1/4) / (2 + 1/2 + 1/4) = 1/11;
    - n 1, A 2, p ln 2 (overloaded): E = 2: 2 / (1/2 + (1 - 2) / (1 - 2) + 2) = 4/7, so the machine carries
      2 x 3/7 = 6/7;
    - a long patience: Erlang C's tail, 0 with more machines than load, 1 - n / A with fewer (each is busy)."""
    assert overflow.overflowed(1, 1.0, 1.0) == pytest.approx(1 / 3)
    assert overflow.overflowed(2, 1.0, 0.0) == pytest.approx(1 / 5)
    assert overflow.overflowed(2, 1.0, math.log(2)) == pytest.approx(1 / 11)
    assert overflow.overflowed(1, 2.0, math.log(2)) == pytest.approx(4 / 7)
    assert overflow.overflowed(1, 2.0, 1000.0) == pytest.approx(1 / 2)  # r = e^-1000: no float overflow
    assert overflow.overflowed(3, 2.0, 1000.0) == pytest.approx(0.0, abs=1e-12)
    assert overflow.overflowed(0, 2.0, 5.0) == 1.0 and overflow.overflowed(3, 0.0, 5.0) == 0.0
    for n in range(1, 8):  # more patience, fewer overflow; more machines, fewer overflow
        shares = [overflow.overflowed(n, 3.0, p) for p in (0.0, 0.5, 1.0, 3.0, 10.0)]
        assert shares == sorted(shares, reverse=True)
        assert overflow.overflowed(n + 1, 3.0, 1.0) < overflow.overflowed(n, 3.0, 1.0)


def test_jobs_that_wait_keep_fewer_busier_base_machines() -> None:
    """keep_machines keeps the n-th while load x (O(n-1) - O(n)) >= busy, by hand:
    - A 4 at patience 0 (Erlang B): B(4) = 0.3107, B(5) = 0.1991, B(6) = 0.1172: the 5th carries
      4 x 0.1116 = 0.45, the 6th 4 x 0.0819 = 0.33: 5 kept;
    - A 4 at patience 10 (`after` 15 min, 90 s runs): O(3) = 1/4 and O(4) = 1/4 / (1 / (4 B(3)) + 10 + 1/4), B(3)
      = 0.4507, = 0.0231: the 4th carries 4 x 0.227 = 0.91 and the 5th 4 x (0.0231 - 0.0000) = 0.09: 4 kept;
    - A 0.5 at patience 1: O(1) = e^-0.5 / (2 + (1 - e^-0.5) / 0.5 + e^-0.5) = 0.6065 / 3.3935 = 0.179, so one
      machine carries 0.5 x 0.821 = 0.41 >= 0.4 and is kept, where Erlang B gives it 0.5 x 2/3 = 0.33: none."""
    assert overflow.overflowed(4, 4.0, 10.0) == pytest.approx(0.0231, abs=1e-4)
    assert overflow.keep_machines(4.0, 0.4, 16) == 5
    assert overflow.keep_machines(4.0, 0.4, 16, 10.0) == 4
    assert overflow.overflowed(1, 0.5, 1.0) == pytest.approx(0.1787, abs=1e-4)
    assert overflow.keep_machines(0.5, 0.4, 16, 1.0) == 1
    assert overflow.keep_machines(0.5, 0.4, 16, 0.0) == 0
    assert overflow.keep_machines(4.0, 0.4, 3, 10.0) == 3  # max_workers caps it
    sized = overflow.size(4.0, 6, 0, 0, 16, Overflow.model_validate({"backends": ["s"], "after": "15m"}), 90.0)
    assert (sized.target, sized.floor) == (4, 4)  # `after` / the run time is the patience
    assert overflow.size(4.0, 6, 0, 0, 16, FLOW, 0.0).floor == 5  # no run time: Erlang B, as before


def test_burst_machines_only_when_a_machine_pays_for_its_boot() -> None:
    cost = overflow.BurstCost(boot=180.0, keep_busy=0.4, tail=30.0)
    assert overflow.burst_machines(100, 10.0, 1.0, 300.0, cost) == 0  # 2 min of work, a 3-min boot
    assert overflow.burst_machines(100, 10.0, 1.0, 1800.0, cost) == math.ceil(90 / 27)
    assert overflow.burst_machines(5, 10.0, 1.0, 1800.0, cost) == 0  # the fleet starts them in time
    sized = overflow.size(2.1, 6, 0, 3, 16, FLOW, 60.0)
    assert (sized.target, sized.floor) == (2, 2) and "base load 2.1 machines" in sized.why
    assert "burst carried by overflow" in sized.why
    grown = overflow.size(2.1, 6, 4, 3, 5, FLOW, 60.0)
    assert grown.target == 5 and "justifies 4 more" in grown.why  # max_workers caps the burst


def test_the_last_burst_machine_is_held_to_its_share_unless_the_arrivals_keep_it_busy() -> None:
    """90-s runs, 17 a machine starts in time, a 3.5-min boot and a 30-s tail (240 s besides its work)."""
    assert overflow.machines_for(35, 17, 90, 0.4, 240) == 3  # the arrivals keep a third busy after (as before)
    assert overflow.machines_for(35, 17, 90, 0.4, 240, lasting=False) == 2  # its one job does not pay its boot
    assert overflow.machines_for(40, 17, 90, 0.4, 240, lasting=False) == 3  # six do
    assert overflow.machines_for(1, 17, 90, 0.4, 240, lasting=False) == 0  # a lone job of a trickle: overflow's
    assert overflow.machines_for(2, 17, 90, 0.4, 240, lasting=False) == 1  # two pay: 270 s saved > 240 s
    assert overflow.machines_for(1, 17, 90, 0.4, 240) == 1  # a rise's first job: the next ones keep it busy
    samples = [(0.0, 0), (300.0, 10), (600.0, 30)]
    assert overflow.recent_load(samples, 600.0, 90.0, 600.0) == pytest.approx(30 * 90 / 600)
    assert overflow.recent_load(samples, 600.0, 90.0, 300.0) == pytest.approx(20 * 90 / 300)
    assert overflow.recent_load([(0.0, 0), (150.0, 5)], 150.0, 90.0, 600.0) == 5 * 90 / 150  # a quarter bucket
    assert overflow.recent_load([(600.0, 30)], 600.0, 90.0, 600.0) == math.inf  # nothing covered: as before


def test_waiting_jobs_ages_are_read_off_the_arrival_samples() -> None:
    samples = [(0.0, 0), (30.0, 10), (60.0, 10), (90.0, 40), (120.0, 45)]
    # 12 wait: the newest 12 arrivals, 5 counted at 120 s and 7 of the 30 counted at 90 s, oldest first
    assert overflow.waiting_ages(samples, 120.0, 12, None) == [(30.0, 7), (0.0, 5)]
    assert overflow.waiting_ages(samples, 120.0, 12, 20.0) == [(20.0, 7), (0.0, 5)]  # none older than the oldest
    assert overflow.waiting_ages(samples, 120.0, 50, None) == [(120.0, 5), (90.0, 10), (30.0, 30), (0.0, 5)]
    assert overflow.waiting_ages(samples, 120.0, 0, None) == []
    assert overflow.waiting_ages([], 120.0, 3, None) == [(0.0, 3)]  # nothing measured yet: as if just come
    # samples started over (a reset store, a clock that stepped back): one sample, as if just come, as before
    assert overflow.waiting_ages([(120.0, 45)], 120.0, 12, 600.0) == [(0.0, 12)]


def test_a_burst_that_has_waited_is_sized_against_the_time_it_has_left() -> None:
    """14 machines serving 90-s runs, 280 of a burst waiting, `after` 30 min, a 3.5-min boot: counted from now
    they start all 280 in time; the burst came 5 minutes ago, and in its 25 minutes left they start 233."""
    rate, after = 60 / 90, 1800.0
    cost = overflow.BurstCost(boot=210.0, keep_busy=0.4, tail=30.0)
    assert overflow.burst_machines(280, overflow.capacity(0, 14, rate, [], after), rate, after, cost) == 0
    waited = overflow.burst_for_ages([(300.0, 280)], 0, 14, rate, [], after, cost)
    assert waited == math.ceil((280 - 14 * 1500 / 90) / ((1500 - 210) / 90))  # 3 machines for the 47 left over
    fresh = overflow.burst_for_ages([(0.0, 280)], 0, 14, rate, [], after, cost)
    assert fresh == 0  # a new burst: as burst_machines counts it
    # a job with less time left than a boot is the router's: no machine rented now would start it in time
    assert overflow.burst_for_ages([(1700.0, 50)], 0, 0, rate, [], after, cost) == 0
    # a steady queue: each job against its own deadline, the oldest few need nothing the newest do not
    steady = [(600.0, 5), (300.0, 5), (0.0, 60)]
    need = overflow.burst_for_ages(steady, 0, 2, rate, [], after, cost)
    assert need == 2 == overflow.burst_machines(70, overflow.capacity(0, 2, rate, [], after), rate, after, cost)


def test_a_run_time_prior_stands_until_runs_are_measured() -> None:
    assert with_prior(0.0, 0, None) == 0.0  # no prior, nothing measured: no machine is counted on
    assert with_prior(40.0, 1, None) == 40.0  # no prior: the measured mean alone, as before
    assert with_prior(0.0, 0, 60.0) == 60.0  # nothing measured: the prior
    assert with_prior(600.0, 1, 60.0) == pytest.approx((5 * 60 + 600) / 6)  # one long first run does not set it
    assert with_prior(120.0, PRIOR_RUNS, 60.0) == pytest.approx(90.0)  # PRIOR_RUNS runs: half each
    assert abs(with_prior(120.0, 1000, 60.0) - 120.0) < 0.5  # the queue's own outweighs it
    flow = Overflow.model_validate({"backends": ["a"], "run_time": "90s"})
    assert flow.run_time == 90.0 and FLOW.run_time is None  # unset by default


@pytest.mark.parametrize(
    ("flow", "message"),
    [
        ({}, "q.overflow.backends: Field required"),
        ({"backends": []}, "q.overflow.backends: List should have at least 1 item"),
        ({"backends": ["a", "a"]}, "q.overflow.backends: a backend is named twice"),
        ({"backends": ["a"], "after": "-5m"}, "q.overflow.after"),
        ({"backends": ["a"], "span": "2h"}, "q.overflow.span: 7200s is longer than window"),
        ({"backends": ["a"], "quantile": 1.5}, "q.overflow.quantile"),
        ({"backends": ["a"], "keep_busy": 0}, "q.overflow.keep_busy"),
        ({"backends": ["a"], "run_time": "0s"}, "q.overflow.run_time"),
        ({"backends": ["a"], "run_time": "soon"}, "q.overflow.run_time"),
        ({"backends": ["a"], "later": "5m"}, "q.overflow.later"),
    ],
)
def test_bad_overflow_blocks_name_the_field(flow: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_autoscale({"overflow": flow}, "q")
    assert str(err.value).startswith(message), str(err.value)


def test_overflow_backends_must_be_configured_for_a_gpu_worker_queue(tmp_path: Path) -> None:
    f = tmp_path / "offload.yaml"
    backend = "backends:\n  sls: {kind: http-job, base_url: 'http://127.0.0.1:1'}\n"
    block = "autoscale: {enabled: true, provider: p, max_workers: 4, overflow: {backends: [%s], after: 5m}}"
    f.write_text(backend + "queues:\n  gpu:\n    " + block % "sl" + "\n")
    with pytest.raises(ConfigError, match=r"^queues\.gpu\.autoscale\.overflow\.backends\.0: no backend named 'sl'"):
        load_settings(f, env={})
    f.write_text(backend + "queues:\n  gpu:\n    backend: sls\n    " + block % "sls" + "\n")
    with pytest.raises(ConfigError, match=r"^queues\.gpu\.autoscale\.overflow: only a queue served by GPU workers"):
        load_settings(f, env={})
    f.write_text(backend + "queues:\n  gpu:\n    " + block % "sls" + "\n")
    cfg = validate_autoscale(load_settings(f, env={}).queues["gpu"].autoscale, "gpu")
    assert cfg.overflow is not None and cfg.overflow.after == 300 and cfg.overflow.backends == ["sls"]


def steady_and_burst() -> list[tuple[float, float]]:
    """3 h of one job every 40 s x 100 s (2.5 machines' worth) and, at 2 h, 120 jobs at once."""
    jobs = [(40.0 * i, 100.0) for i in range(int(3 * 3600 / 40))]
    return sorted(jobs + [(2 * 3600.0, 100.0)] * 120)


class Recorded(HybridWorld):
    """Records the fleet's size and the decision's reasons after each evaluation; may damage the arrivals record
    or hand the queue to a second server once."""

    def __init__(self, *args: Any, damage_at: float | None = None, swap_at: float | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sizes: list[tuple[float, int]] = []
        self.reasons: list[tuple[float, str]] = []
        self.damage_at, self.swap_at = damage_at, swap_at

    async def after_tick(self) -> None:
        await super().after_tick()
        decision = await load_decision(self.r, QUEUE)
        assert decision is not None
        self.sizes.append((self.clock() - START, len(await self.provider.all_ids())))
        self.reasons += [(self.clock() - START, why) for why in decision["reasons"]]
        if self.swap_at is not None and self.clock() >= START + self.swap_at:
            self.swap_at = None
            self.scaler = second_server(self)  # the first one stops: as if SIGKILLed, its lease runs out
        if self.damage_at is not None and self.clock() >= START + self.damage_at:
            self.damage_at = None
            await self.r.hset(queue_state(QUEUE), "arrivals", "not:a,record")


async def play(r: Any, after: str = "5m", **kwargs: Any) -> Recorded:
    await r.flushdb()
    flow = {"backends": ["serverless"], "after": after, "quantile": 0.25}
    policy = Policy("hybrid", 8, poll=30.0, by_cost=True, overflow=flow)
    world = Recorded(r, steady_and_burst(), policy, Hosts(boot=(120.0, 180.0)), Prices(), 0, **kwargs)
    await world.run(8 * 3600.0)
    return world


async def test_the_fleet_holds_the_base_and_the_burst_overflows(r: Any) -> None:
    """`after` 3 min: a machine rented for the burst would work a minute of it before the deadline, which does not
    pay for its boot (at 5 min it does, and the burst is partly the machines': the next test)."""
    world = await play(r, after="3m")
    done = world.served.done_by
    assert sorted(done) == list(range(len(world.jobs))) and all(len(k) == 1 for k in done.values())
    burst = [n for n, (a, _) in enumerate(world.jobs) if a == 2 * 3600.0]
    on_sls = [n for n in burst if done[n] == ["serverless"]]
    assert len(on_sls) > 80, len(on_sls)  # a 3-min allowance: the base fleet starts only a few of 120
    during = [n for t, n in world.sizes if 2 * 3600 <= t < 2 * 3600 + 600]
    assert during and max(during) <= 4, during  # the burst rented nothing beyond the base (2-3)
    settled = [n for t, n in world.sizes if 3600 <= t < 2 * 3600]
    assert settled and min(settled) >= 2, settled  # 2.5 machines' worth keeps two or three
    assert any("base load" in why and "burst carried by overflow" in why for _, why in world.reasons)
    waits = [world.served.started[n] - START - a for n, (a, _) in enumerate(world.jobs)]
    assert sorted(waits)[int(0.95 * len(waits))] <= 180, "the p95 wait is within `after`"


async def test_a_patient_queue_releases_idle_machines_above_the_base_at_once(r: Any) -> None:
    """`after` 15 min is 9 runs of 100 s: a job that finds the fleet busy waits for a machine rather than
    overflowing, so the burst's machines go as soon as the safety rules let them (30 s after their last task,
    a poll to drain, one to destroy), not a measured boot later; the base stays."""
    world = await play(r, after="15m")
    done = world.served.done_by
    assert sorted(done) == list(range(len(world.jobs))) and all(len(k) == 1 for k in done.values())
    burst = [n for n, (a, _) in enumerate(world.jobs) if a == 2 * 3600.0]
    assert sum(1 for n in burst if done[n] == ["fleet"]) >= 50  # 8 machines x ~12 min of 100-s jobs
    waits = {n: world.served.started[n] - START - a for n, (a, _) in enumerate(world.jobs)}
    ended = max(world.served.started[n] - START + 100.0 for n, w in waits.items() if w > 60)  # the backlog's end
    peak = max(n for t, n in world.sizes if 2 * 3600 <= t < ended)
    later = [n for t, n in world.sizes if ended + 120 <= t < ended + 600]
    assert peak >= 6 and later and max(later) <= 3, (peak, later)  # down to the base within 2 min, and stays
    assert any("release idle machines above the base at once" in why for _, why in world.reasons)


async def test_a_damaged_record_restarts_the_measurement_without_failing(r: Any) -> None:
    world = await play(r, damage_at=5400.0)
    assert all(len(k) == 1 for k in world.served.done_by.values()) and len(world.served.done_by) == len(world.jobs)
    state = await QueueState.load(r, QUEUE)
    assert parse_samples(state.arrivals), "measuring again after the damage"
    late = [n for t, n in world.sizes if 5400 + 700 <= t < 2 * 3600]
    assert late and min(late) >= 1, late  # one whole bucket later the base holds again


def test_the_docs_overflow_example_loads(tmp_path: Path) -> None:
    page = (Path(__file__).parents[2] / "docs" / "how-to" / "autoscaling.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", page, re.S) if "overflow:" in b)
    f = tmp_path / "offload.yaml"
    f.write_text(block)
    settings = load_settings(f, env={"RUNPOD_API_KEY": "k"})
    cfg = validate_autoscale(settings.queues["gpu"].autoscale, "gpu")
    assert cfg.overflow is not None and cfg.overflow.backends == ["sdxl-serverless"] and cfg.overflow.after == 300


async def first_burst(r: Any, **flow: Any) -> HybridWorld:
    """100 jobs x 60 s at once on an empty queue (no run measured), `after: 30m`: the burst-day's first burst."""
    await r.flushdb()
    policy = Policy("hybrid", 8, poll=30.0, by_cost=True, overflow={"backends": ["serverless"], "after": "30m", **flow})
    world = HybridWorld(r, [(0.0, 60.0)] * 100, policy, Hosts(boot=(120.0, 180.0)), Prices(), 0)
    await world.run(4 * 3600.0)
    return world


async def test_a_run_time_prior_lets_the_first_burst_count_on_machines(r: Any) -> None:
    blind = await first_burst(r)
    assert all(k == ["serverless"] for k in blind.served.done_by.values()) and not blind.served.rentals
    primed = await first_burst(r, run_time="1m")
    done = primed.served.done_by
    assert len(done) == 100 and all(len(k) == 1 for k in done.values())
    on_fleet = sum(1 for k in done.values() if k == ["fleet"])
    assert on_fleet >= 90, on_fleet  # 4 machines rented at once start 100 jobs x 1 min within 30 min
    waits = sorted(primed.served.started[n] - START for n in range(100))
    assert waits[94] <= 1800, waits[94]  # the p95 is within `after`
    measured = await expected_run(primed.store, QUEUE, primed.flow)
    assert measured == pytest.approx(60.0, abs=1.0)  # 100 runs of 60 s blended with a 60 s prior


async def test_a_burst_whose_runs_outlast_the_prior_gets_machines_once_they_are_measured(r: Any) -> None:
    """200 jobs x 90 s at once, a 60-s prior, `after` 20 min: the first evaluation rents for 60-s runs (12
    machines); once runs are measured at 90 s, the burst has less than 20 minutes left and the fleet grows to
    start it in time rather than leave the last quarter to overflow (before: 12 machines, 64 jobs on overflow)."""
    await r.flushdb()
    flow = {"backends": ["serverless"], "after": "20m", "run_time": "60s"}
    policy = Policy("hybrid", 16, poll=30.0, by_cost=True, overflow=flow)
    world = HybridWorld(r, [(0.0, 90.0)] * 200, policy, Hosts(boot=(120.0, 180.0)), Prices(), 0)
    served = await world.run(4 * 3600.0)
    done = served.done_by
    assert len(done) == 200 and all(len(k) == 1 for k in done.values())
    first = min(rental.created for rental in served.rentals)
    later = [rental for rental in served.rentals if rental.created > first + 60]
    assert later and len(served.rentals) > 12, [rental.created - first for rental in served.rentals]
    on_sls = sum(1 for k in done.values() if k == ["serverless"])
    assert on_sls < 40, on_sls


async def test_a_trickle_overflows_and_a_rise_rents(r: Any) -> None:
    """`after` 30 min: a job every 20 min (75 s) keeps no machine busy, and one rented for it pays a boot and a
    tail for 75 s of work (before: a machine each); a rise to a job a minute rents and stays on the fleet."""
    await r.flushdb()
    flow = {"backends": ["serverless"], "after": "30m", "run_time": "75s"}
    policy = Policy("hybrid", 8, poll=30.0, by_cost=True, overflow=flow)
    trickle = [(1200.0 * i, 75.0) for i in range(12)]
    world = HybridWorld(r, trickle, policy, Hosts(boot=(120.0, 240.0)), Prices(), 0)
    served = await world.run(6 * 3600.0)
    # the first job comes before any arrival is measured and rents as before; the rest find the trickle measured
    assert len(served.rentals) == 1 and served.done_by[0] == ["fleet"], served.rentals
    assert [served.done_by[n] for n in range(1, 12)] == [["serverless"]] * 11
    await r.flushdb()
    rise = trickle + [(4 * 3600.0 + 60.0 * i, 75.0) for i in range(60)]
    world = HybridWorld(r, rise, policy, Hosts(boot=(120.0, 240.0)), Prices(), 0)
    served = await world.run(8 * 3600.0)
    assert len(served.done_by) == 72 and all(len(k) == 1 for k in served.done_by.values())
    on_fleet = sum(1 for n, k in served.done_by.items() if k == ["fleet"] and n >= 12)
    assert served.rentals and on_fleet >= 50, on_fleet


async def test_a_queue_without_overflow_is_sized_as_before(r: Any) -> None:
    """The same arrivals without `overflow`: the ramp sizes the fleet for the burst, nothing measures arrivals."""
    await r.flushdb()
    world = CostWorld(r, steady_and_burst(), Policy("ramp", 8, 25, poll=30.0), Hosts(boot=(120.0, 180.0)))
    await world.run(8 * 3600.0)
    decision = await load_decision(r, QUEUE)
    assert decision is not None and not any("base load" in why for why in decision["reasons"])
    assert (await QueueState.load(r, QUEUE)).arrivals == ""
    assert len(world.served.started) == len(world.jobs) and world.served.serverless_s == 0
    assert all(k == ["fleet"] for k in world.served.done_by.values())
    at = START + 2 * 3600 + 300
    renting = [x for x in world.served.rentals if x.created <= at < (x.gone or at + 1)]
    assert len(renting) >= 5, len(renting)  # the ramp rents for the burst's 120 jobs (ceil(125 / 25))


async def test_a_new_leader_goes_on_with_the_measured_base(r: Any) -> None:
    world = await play(r, swap_at=5400.0)
    assert all(len(k) == 1 for k in world.served.done_by.values()) and len(world.served.done_by) == len(world.jobs)
    after = [why for t, why in world.reasons if 5400 + 240 <= t < 5400 + 600 and "base load" in why]
    assert after and all("of 6 bucket(s)" in why for why in after), after  # the window, not a fresh start
    kept = [n for t, n in world.sizes if 5400 + 240 <= t < 2 * 3600]
    assert kept and min(kept) >= 2, kept
