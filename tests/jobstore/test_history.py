"""The queue's history (lua/includes/history.lua, offload/queue/history.py): jobs that succeed, retry, die and are
cancelled in known minutes land in exactly those minutes' points, and the same sums in the hour's and the day's;
percentiles fall in the bucket their runs and waits were in; every bucket expires its resolution's retention;
a repeat counts nothing; the gauges keep each bucket's peak; and the buckets are named by the store's clock.

On Valkey 9 and Redis 7 (`backend_url`) with the scripts' `now` given (a virtual clock: the ARGV the scripts take
their time from), and on a Valkey whose own clock the test steps (no `now` given: the store's TIME).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from support.admin_redis import redis_admin
from support.servers import ValkeyServer
from test_clock import step_store_clock, store_now

from offload.connection import connect
from offload.queue import history, keyspace
from offload.queue.scripts import HIST_BUCKETS_S, HISTORY_KEEP_S
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

T0_MS = int(datetime(2026, 11, 30, 10, 0, tzinfo=UTC).timestamp() * 1000)  # an hour's first minute
MIN_MS = 60_000
BOUNDS_MS = [b * 1000 for b in HIST_BUCKETS_S]


class Clock:
    """The scripts' `now` (ms), moved by the test."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def bucket_of(ms: float) -> tuple[float, float]:
    """The (low, high] histogram bucket a duration falls in."""
    low = 0.0
    for b in BOUNDS_MS:
        if ms <= b:
            return low, b
        low = b
    return low, BOUNDS_MS[-1]


async def hour_points(store: QueueStore, queue: str) -> dict[int, history.HistoryPoint]:
    step, points = await store.history(queue, "hour")
    assert step == 60 and len(points) == 60
    assert [p.t for p in points] == list(range(points[0].t, points[0].t + 3600, 60))  # the whole axis, in order
    return {p.t: p for p in points}


async def test_outcomes_land_in_their_minutes_and_roll_up(backend_url: str) -> None:
    redis = await connect(backend_url)
    clock = Clock(T0_MS + 5000)
    store = QueueStore(redis, clock_ms=clock)
    q = "hist"
    try:
        # minute 0: five enqueued; four claimed 200 ms later and begun at sim-a (provider calls); A succeeds in 2 s
        a, b, c, d, e = await store.enqueue_many(q, [JobSpec(input=i, max_attempts=3) for i in range(5)])
        clock.ms += 200
        claimed = {j.id: j for j in await store.claim(q, "w1", 4, request_id="r1")}
        assert set(claimed) == {a, b, c, d}
        again_claimed = await store.claim(q, "w1", 4, request_id="r1")  # a lost reply's resend: the same jobs
        assert {j.id for j in again_claimed} == set(claimed)
        begun = await store.begin_many(q, [(j, claimed[j].token, 0.0) for j in (a, b, c)], backend="sim-a")
        assert [str(x) for x in begun] == ["OK:1"] * 3
        clock.ms += 2000
        await store.complete(a, claimed[a].token, "results/a.json", cost=0.5)
        await store.complete(a, claimed[a].token, "results/a.json", cost=0.5)  # a lost reply's retry: counts once
        # minute 1: B fails and is retried (a provider error that cost $0.25), C fails for good, E (never claimed)
        # is cancelled
        clock.ms = T0_MS + MIN_MS + 1000
        assert await store.fail(b, claimed[b].token, "5xx", delay_ms=0, cost=0.25) == "retrying"
        assert await store.fail(c, claimed[c].token, "bad input", retryable=False) == "dead"
        assert await store.cancel(e) == "cancelled"
        # minute 2: B claimed again and succeeds after a 40 s run (no provider call: no backend)
        clock.ms = T0_MS + 2 * MIN_MS + 1000
        (again,) = await store.claim(q, "w1", 1)
        assert again.id == b
        clock.ms += 40_000
        await store.complete(b, again.token, "results/b.json")

        points = await hour_points(store, q)
        t0 = T0_MS // 1000
        m0, m1, m2 = points[t0], points[t0 + 60], points[t0 + 120]
        assert m0.counts == dict(
            enqueued=5, succeeded=1, failed=0, dead=0, cancelled=0, provider_calls=3, provider_errors=0
        )
        assert m1.counts == dict(
            enqueued=0, succeeded=0, failed=1, dead=1, cancelled=1, provider_calls=0, provider_errors=2
        )
        assert m2.counts == dict(
            enqueued=0, succeeded=1, failed=0, dead=0, cancelled=0, provider_calls=0, provider_errors=0
        )
        assert m0.spend_usd == {"serverless": 0.5, "fleet": 0.0} and m0.spend_by_backend == {"sim-a": 0.5}
        assert m1.spend_usd == {"serverless": 0.25, "fleet": 0.0} and m1.spend_by_backend == {"sim-a": 0.25}
        for p in (m0, m2):  # one wait and one run each: every percentile inside that value's bucket
            for name, ms in (("run_ms", 2000 if p is m0 else 40_000),):
                low, high = bucket_of(ms)
                assert all(low <= v <= high for v in getattr(p, name).values() if v is not None), (name, p)
                assert None not in getattr(p, name).values()
        low, high = bucket_of(200)
        assert all(low <= v <= high for v in m0.wait_ms.values() if v is not None) and m0.wait_ms["p50"] is not None
        assert m1.run_ms == {"p50": None, "p95": None, "p99": None}  # nothing ran to success there
        (raw0,) = await history.read_raw(redis, q, 60, [t0])
        assert sum(v for k, v in raw0.items() if k.startswith("wait:")) == 4  # four waits: the resend added none
        empty = points[t0 - 600]
        assert empty.counts == dict.fromkeys(history.COUNTS, 0) and empty.gauges == dict.fromkeys(history.GAUGES)

        # the hour's and the day's points hold the minutes' sums; the run histogram the same buckets as /metrics'
        minutes = [p for p in points.values()]
        for step in (3600, 86400):
            (raw,) = await history.read_raw(redis, q, step, [t0 - t0 % step])
            rolled = history.to_point(t0 - t0 % step, raw)
            assert rolled.counts == {k: sum(p.counts[k] for p in minutes) for k in history.COUNTS}
            assert rolled.spend_usd == {"serverless": 0.75, "fleet": 0.0}
            assert rolled.spend_by_backend == {"sim-a": 0.75}
            metrics = await redis.hgetall(keyspace.histograms(q))
            assert {k: int(v) for k, v in raw.items() if k.startswith("run:")} == {
                k: int(v) for k, v in metrics.items() if k.startswith("run:") and k[4:].isdigit()
            }
        await _retention_is_set(redis, q, t0, clock.ms)
    finally:
        await redis.aclose()


async def _retention_is_set(redis: RedisClient, q: str, t0: int, now_ms: int) -> None:
    """Each bucket expires its resolution's retention after it ends (counted from the scripts' `now`)."""
    for step, keep_s in zip((60, 3600, 86400), HISTORY_KEEP_S, strict=True):
        start = t0 - t0 % step
        ttl = await redis.pttl(keyspace.history_bucket(q, step, start))
        last_write = now_ms if step > 60 else T0_MS + 5000 + 200 + 2000  # minute 0's last write: A's complete
        expected = (start + step + keep_s) * 1000 - last_write
        assert abs(ttl - expected) < 5000, (step, ttl, expected)


async def test_settings_turn_it_off_and_set_the_retention(backend_url: str) -> None:
    redis = await connect(backend_url)
    clock = Clock(T0_MS)
    store = QueueStore(redis, clock_ms=clock)
    try:
        off = history.HistoryKeep(enabled=False)
        await history.sample(redis, "off", off, {}, str(clock.ms))
        await store.enqueue_many("off", [JobSpec(input=1)])
        assert [k async for k in redis_admin(redis).scan_iter(match=keyspace.prefix("off") + "history:[mhd]:*")] == []
        short = history.HistoryKeep(minutes_s=600, hours_s=7200, days_s=86400 * 3)
        await history.sample(redis, "short", short, {"backlog": 4}, str(clock.ms))
        await store.enqueue_many("short", [JobSpec(input=1)])
        for step, keep_s in ((60, 600), (3600, 7200), (86400, 86400 * 3)):
            start = (T0_MS // 1000) - (T0_MS // 1000) % step
            ttl = await redis.pttl(keyspace.history_bucket("short", step, start))
            assert abs(ttl - ((start + step + keep_s) * 1000 - T0_MS)) < 1000, (step, ttl)
        for queue, longest_s in (("short", 86400 * 3), ("off", history.HistoryKeep().days_s)):
            # the settings live as long as the history they set: a queue no longer sampled leaves no key for ever
            ttl = await redis.pttl(keyspace.history_config(queue))
            assert abs(ttl - (longest_s + 86400) * 1000) < 5000, (queue, ttl)
    finally:
        await redis.aclose()


async def test_gauges_keep_each_buckets_peak_whoever_samples(backend_url: str) -> None:
    """Several servers sample the same minute: the bucket keeps the highest value, whatever the order; a later
    minute has its own peak, the hour the highest of its minutes."""
    redis = await connect(backend_url)
    clock = Clock(T0_MS + 1000)
    store = QueueStore(redis, clock_ms=clock)
    keep = history.HistoryKeep()
    try:
        await store.enqueue_many("g", [JobSpec(input=1)])
        for backlog, flying in ((5, 1), (9, 0), (7, 3)):  # three servers, one minute
            await history.sample(redis, "g", keep, {"backlog": backlog, "in_flight": flying}, str(clock.ms))
        clock.ms += MIN_MS
        await history.sample(redis, "g", keep, {"backlog": 2, "fleet_usd_per_h": 1.5}, str(clock.ms))
        points = await hour_points(store, "g")
        t0 = T0_MS // 1000
        assert points[t0].gauges == {"backlog": 9.0, "in_flight": 3.0, "fleet_machines": None, "fleet_usd_per_h": None}
        assert points[t0 + 60].gauges["backlog"] == 2.0 and points[t0 + 60].gauges["fleet_usd_per_h"] == 1.5
        (raw,) = await history.read_raw(redis, "g", 3600, [t0])
        assert raw["g:backlog"] == 9.0
    finally:
        await redis.aclose()


async def test_an_idle_queue_reads_zero_where_a_server_sampled_and_none_elsewhere(backend_url: str) -> None:
    """The sampler writes nothing for an idle queue (no bucket a minute for nothing) but marks each minute it
    sampled, once for all queues: there an idle queue's gauges read 0, in a minute nobody sampled None (unknown),
    and a queue's own sample stays its peak. The markers expire with the buckets."""
    redis = await connect(backend_url)
    clock = Clock(T0_MS + 5 * MIN_MS + 1000)
    store = QueueStore(redis, clock_ms=clock)
    keep = history.HistoryKeep()
    try:
        await store.enqueue_many("busy", [JobSpec(input=1)])
        minute_ms = await history.sample(redis, "busy", keep, {"backlog": 3}, str(clock.ms))
        await history.sample(redis, "idle", keep, {}, str(clock.ms))  # what the sampler sends for an idle queue
        await history.mark_sampled(redis, keep, minute_ms)
        t = minute_ms // 1000
        idle, busy = await hour_points(store, "idle"), await hour_points(store, "busy")
        assert idle[t].gauges == {"backlog": 0.0, "in_flight": 0.0, "fleet_machines": 0.0, "fleet_usd_per_h": 0.0}
        assert busy[t].gauges["backlog"] == 3.0 and busy[t].gauges["in_flight"] == 0.0
        assert idle[t - 60].gauges["backlog"] is None and idle[t - 60].to_dict()["backlog"] is None  # not sampled
        step, days = await store.history("idle", "day")
        assert step == 3600 and days[-1].gauges["backlog"] == 0.0  # the hour's marker too
        ttl = await redis.pttl(keyspace.history_sampled(60, t))
        assert abs(ttl - (60 + keep.minutes_s) * 1000) < 1000, ttl  # as long as the minute's buckets
        await history.mark_sampled(redis, history.HistoryKeep(enabled=False), minute_ms + MIN_MS)
        assert not await redis.exists(keyspace.history_sampled(60, t + 60))  # history off: no marker
    finally:
        await redis.aclose()


async def test_buckets_are_named_by_the_stores_clock(stepped_valkey: ValkeyServer) -> None:
    """No `now` given: the scripts read the store's TIME. With it a day ahead of this machine's, the jobs land in
    the store's minute, and the history read through the store ends there."""
    redis = await connect(stepped_valkey.url)
    store = QueueStore(redis)
    try:
        await step_store_clock(stepped_valkey, redis, 86_400)
        await store.enqueue_many("ahead", [JobSpec(input=i) for i in range(3)])
        store_s = await store_now(redis)
        _, points = await store.history("ahead", "hour")
        assert abs(points[-1].t - store_s) <= 120 and points[-1].t - time.time() > 80_000
        assert sum(p.counts["enqueued"] for p in points[-3:]) == 3
    finally:
        await redis.aclose()
