"""How many jobs a dispatch worker leases ahead of its slots (offload/worker/prefetch.py): the floor for slow
jobs, up to `concurrency` for jobs that leave their slots faster than a claim comes back, and exactly what it
is told where a `prefetch` is given or a daily cap holds it at none. Times are passed in: no sleeps, no clock."""

from __future__ import annotations

from offload.worker.options import WorkerOptions
from offload.worker.prefetch import Prefetch


def paced(p: Prefetch, *, jobs_per_s: float, rtt_s: float, seconds: float, start: float = 0.0) -> float:
    """Feed `p` jobs leaving at `jobs_per_s` and a claim answered every 10 ms after `rtt_s`; returns the time."""
    now, owed = start, 0.0
    while now < start + seconds:
        now += 0.01
        owed += jobs_per_s * 0.01
        while owed >= 1:
            p.left()
            owed -= 1
        p.claimed(now - rtt_s, now)
    return now


def test_slow_jobs_get_the_floor_and_fast_ones_up_to_concurrency() -> None:
    options = WorkerOptions(queue="q", backend_name="b", concurrency=100)
    p = Prefetch(options, now=0.0)
    assert p.ahead() == 25 and p.leased_max() == 125  # nothing measured yet: a quarter of concurrency
    paced(p, jobs_per_s=3, rtt_s=0.005, seconds=5)  # GPU jobs: a few a second
    assert p.ahead() == 25
    mid = Prefetch(options, now=0.0)
    paced(mid, jobs_per_s=4000, rtt_s=0.005, seconds=2)  # 20 jobs leave during one round trip
    assert 36 <= mid.ahead() <= 44, mid.ahead()  # two round trips' worth
    paced(p, jobs_per_s=6000, rtt_s=0.02, seconds=2, start=5)  # no-op jobs: far more than one claim's worth
    assert p.ahead() == 100 and p.leased_max() == 200  # at most concurrency


def test_the_pace_decays_when_the_jobs_slow_down() -> None:
    p = Prefetch(WorkerOptions(queue="q", backend_name="b", concurrency=40), now=0.0)
    end = paced(p, jobs_per_s=5000, rtt_s=0.01, seconds=1)
    assert p.ahead() == 40
    paced(p, jobs_per_s=0, rtt_s=0.01, seconds=2, start=end)  # an empty queue: claims answered, nothing leaves
    assert p.ahead() == 10


def test_a_given_prefetch_and_a_daily_cap_are_kept_as_they_are() -> None:
    given = Prefetch(WorkerOptions(queue="q", backend_name="b", concurrency=100, prefetch=7), now=0.0)
    capped = Prefetch(WorkerOptions(queue="q", backend_name="b", concurrency=100, daily_job_cap=50), now=0.0)
    spend = Prefetch(WorkerOptions(queue="q", backend_name="b", concurrency=100, daily_spend_cap=5.0), now=0.0)
    for p in (given, capped, spend):
        paced(p, jobs_per_s=6000, rtt_s=0.02, seconds=1)
    assert (given.ahead(), capped.ahead(), spend.ahead()) == (7, 0, 0)


def test_the_ceiling_is_also_one_claim_batch_and_never_below_the_floor() -> None:
    small_batch = Prefetch(WorkerOptions(queue="q", backend_name="b", concurrency=400, claim_batch=50), now=0.0)
    paced(small_batch, jobs_per_s=20000, rtt_s=0.02, seconds=1)
    assert small_batch.ahead() == 50  # one claim batch, however fast (the floor too is at most one batch)
    one = Prefetch(WorkerOptions(queue="q", backend_name="b", concurrency=1), now=0.0)
    paced(one, jobs_per_s=20000, rtt_s=0.02, seconds=1)
    assert one.ahead() == 1


def test_a_clock_that_stands_still_or_steps_back_changes_nothing() -> None:
    """Claims answered within the same instant (or, from a misbehaving clock, before they were sent) neither
    divide by zero nor turn the pace negative."""
    p = Prefetch(WorkerOptions(queue="q", backend_name="b", concurrency=100), now=10.0)
    for _ in range(100):
        p.left()
        p.claimed(10.0, 10.0)
    p.claimed(10.0, 9.0)
    assert p.ahead() == 25


def bursts(p: Prefetch, *, size: int, every_s: float, rtt_s: float, seconds: float, start: float = 0.0) -> float:
    """Feed `p` jobs that leave in step: `size` at once every `every_s`, each burst answered by one claim after
    `rtt_s`, and a claim every 10 ms in between (answered, nothing left meanwhile); returns the time."""
    now, next_burst = start, start + every_s
    while now < start + seconds:
        now += 0.01
        if now >= next_burst:
            for _ in range(size):
                p.left()
            next_burst += every_s
        p.claimed(now - rtt_s, now)
    return now


def test_short_jobs_leaving_in_bursts_get_the_burst_covered() -> None:
    """100 jobs of 50 ms in step: on average 4 leave during a 2 ms round trip, so the pace alone asks for the
    floor (25), and 75 slots would wait for each claim. The burst is covered (up to concurrency); it decays when
    the jobs leave evenly again, and GPU jobs leaving in the same bursts keep the floor."""
    options = WorkerOptions(queue="q", backend_name="b", concurrency=100)
    even = Prefetch(options, now=0.0)
    paced(even, jobs_per_s=2000, rtt_s=0.002, seconds=2)
    assert even.ahead() == 25
    p = Prefetch(options, now=0.0)
    end = bursts(p, size=100, every_s=0.05, rtt_s=0.002, seconds=2)
    assert p.ahead() == 100 and p.leased_max() == 200
    end = paced(p, jobs_per_s=2000, rtt_s=0.002, seconds=30, start=end)  # six half-lives of even departures
    assert p.ahead() == 25, p.ahead()
    gpu = Prefetch(options, now=0.0)
    bursts(gpu, size=100, every_s=30.0, rtt_s=0.002, seconds=95)  # 30 s jobs, all 100 in step
    assert gpu.ahead() == 25
