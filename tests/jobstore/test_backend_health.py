"""Issue 39, item 2: a routed backend's health in the store, shared by every worker (offload/queue/backend_health.py,
lua/health.lua), each transition against real Valkey: closed -> open on the threshold, a Retry-After longer than
the cool-down honoured, errors outside the window forgotten, the half-open probe given to one caller, its success
closing the backend and its failure opening it again for a longer cool-down. (Before: no such state existed.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from support.eventually import eventually

from offload.connection import connect
from offload.queue.backend_health import BackendHealth, HealthPolicy
from offload.queue.backend_limits import BackendLimits
from offload.queue.keyspace import backend_cooldown, backend_health
from offload.redis_client import RedisClient

POLICY = HealthPolicy(failures=3, window_s=60.0, cool_down_s=0.4, max_cool_down_s=10.0)


@pytest.fixture
async def redis(valkey_url: str) -> AsyncIterator[RedisClient]:
    client = await connect(valkey_url)
    for name in ("hb", "hb2"):
        await client.delete(backend_health(name), backend_cooldown(name))
    yield client
    await client.aclose()


async def cooled(health: BackendHealth) -> bool:
    health.forget()
    return (await health.read()).probe_free


async def test_errors_past_the_threshold_open_the_backend_for_its_cool_down(redis: RedisClient) -> None:
    health = BackendHealth(redis, "hb", POLICY)
    for _ in range(2):
        assert not (await health.failed()).granted
    assert (await health.read()).usable
    opened = await health.failed()
    assert opened.granted and opened.state == "open" and 300 < opened.cool_ms <= 400
    # every worker sees it, also through the 429 cool-down key the rate limiter reads
    other = BackendHealth(redis, "hb", POLICY)
    assert not (await other.read()).usable
    assert not await BackendLimits(redis, "hb", None).ready()


async def test_a_retry_after_longer_than_the_cool_down_is_honoured(redis: RedisClient) -> None:
    health = BackendHealth(redis, "hb", POLICY)
    for _ in range(2):
        await health.failed()
    opened = await health.failed(retry_after_s=5.0)
    assert opened.granted and 4_500 < opened.cool_ms <= 5_000


async def test_errors_outside_the_window_are_forgotten(redis: RedisClient) -> None:
    health = BackendHealth(redis, "hb", HealthPolicy(failures=2, window_s=0.2, cool_down_s=1.0))
    assert not (await health.failed()).granted
    await asyncio.sleep(0.3)  # (the window itself is what is tested: it must pass)
    assert not (await health.failed()).granted, "an error of an earlier window still counted"
    assert (await health.failed()).granted


async def test_the_half_open_probe_goes_to_one_caller_and_its_success_closes(redis: RedisClient) -> None:
    a, b = BackendHealth(redis, "hb", POLICY), BackendHealth(redis, "hb", POLICY)
    for _ in range(3):
        await a.failed()
    assert not await a.probe(5.0), "a probe while it still cools down"
    await eventually(lambda: cooled(a), 3.0, "the cool-down to run out")
    granted = await asyncio.gather(a.probe(5.0), b.probe(5.0))
    assert sorted(granted) == [False, True], "exactly one probe"
    b.forget()
    assert not (await b.read()).usable and not (await b.read()).probe_free  # skipped while the probe is out
    prober = a if granted[0] else b
    await prober.succeeded()
    prober.forget()
    assert (await prober.read()).usable
    assert await b.probe(5.0)  # closed: every caller may send


async def test_a_failed_probe_opens_it_again_for_longer(redis: RedisClient) -> None:
    health = BackendHealth(redis, "hb", POLICY)
    for _ in range(3):
        await health.failed()
    await eventually(lambda: cooled(health), 3.0, "the cool-down to run out")
    assert await health.probe(5.0)
    again = await health.failed()
    assert again.granted and again.state == "open" and 700 < again.cool_ms <= 800  # compute_backoff: 2 x 0.4 s


async def test_a_lost_probe_is_given_to_another_caller_after_its_lease(redis: RedisClient) -> None:
    health = BackendHealth(redis, "hb", POLICY)
    for _ in range(3):
        await health.failed()
    await eventually(lambda: cooled(health), 3.0, "the cool-down to run out")
    assert await health.probe(0.2)  # its worker dies with the probe out
    other = BackendHealth(redis, "hb", POLICY)
    assert not await other.probe(5.0)
    await eventually(lambda: other.probe(5.0), 3.0, "the probe's lease to run out")


async def test_the_mean_run_time_is_measured(redis: RedisClient) -> None:
    health = BackendHealth(redis, "hb2", POLICY)
    assert (await health.read()).mean_run_s is None
    await health.succeeded(2.0)
    await health.succeeded(4.0)
    health.forget()
    assert (await health.read()).mean_run_s == pytest.approx(3.0, abs=0.01)
