"""An idle dispatch worker claims new work at once, not at its next poll (wakeups.py, ready.lua's `wake`).

A claim that finds the ready set empty leaves `idle`; the next script that makes a job ready deletes it and
PUBLISHes once on the queue's wake channel. The worker's poll (20 ms doubling to `idle_poll_max`, 0.5 s by
default) stays as the fallback. The worker tests set `idle_poll_max` to 60 s and let the worker idle for 3 s
first, so its poll in progress ends at least 2 s later (waits of 0.02, 0.04, ... 1.28 s add up to 2.54 s; the
next is 2.56 s): a job claimed within 1 s of its enqueue was claimed on the wake-up, nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_worker_faults as faults
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from support.admin_redis import redis_admin
from support.servers import ValkeyServer
from test_worker_faults import make_settings, until, until_state, worker

from offload.connection import connect
from offload.queue import keyspace
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient
from offload.worker import wakeups

sim, _clean_sim, store = faults.sim, faults._clean_sim, faults.store  # the simulator, its reset, a QueueStore
IDLE_S = 3.0  # see the module docstring
PROMPT_S = 1.0


@pytest.fixture
def outputs(tmp_path: Path) -> dict[str, Any]:
    return {"kind": "local", "path": str(tmp_path / "results")}


async def wakes_before(redis: RedisClient, pubsub: PubSub, channel: str) -> int:
    """Wake messages received on `channel` before a marker this test publishes now (pub/sub keeps order)."""
    await redis.publish(channel, "marker")
    count = 0
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline:
        message = await pubsub.get_message(timeout=1.0)
        if message is None or message["type"] != "message":  # the subscription's confirmation
            continue
        if message["data"] == "marker":
            return count
        count += 1
    raise AssertionError("the marker never came back")


async def test_one_wake_per_idle_spell_and_none_under_a_pause_or_a_cap(store: QueueStore) -> None:
    redis, idle, channel = store.redis, keyspace.prefix("wq") + "idle", keyspace.wake_channel("wq")
    pubsub = redis_admin(redis).pubsub()
    await pubsub.subscribe(channel)
    try:
        assert await store.claim("wq", "w1", 10) == []
        assert await redis.exists(idle) == 1  # the ready set ran dry
        await store.enqueue_many("wq", [JobSpec(input={"i": 1})])
        await store.enqueue_many("wq", [JobSpec(input={"i": 2}), JobSpec(input={"i": 3})])
        await store.enqueue_many("wq", [JobSpec(input={"i": 4}, delay=60)])  # delayed: nothing ready
        assert await wakes_before(redis, pubsub, channel) == 1  # the first enqueue woke; the flag was gone after
        assert await redis.exists(idle) == 0
        assert len(await store.claim("wq", "w1", 3)) == 3  # took all it asked for: not idle
        assert await redis.exists(idle) == 0
        assert await store.claim("wq", "w1", 3) == []
        await store.pause("wq")
        await store.enqueue_many("wq", [JobSpec(input={"i": 5})])  # woke (the flag was set), then:
        assert await store.claim("wq", "w1", 3) == []  # paused: no flag, so no wake-ups for nothing
        await store.enqueue_many("wq", [JobSpec(input={"i": 6})])
        assert await wakes_before(redis, pubsub, channel) == 1
        await store.resume("wq")  # resuming tells the idle workers itself
        assert await wakes_before(redis, pubsub, channel) == 1
        capped = await store.claim("wq", "w1", 3, job_cap=0)
        assert capped == [] and await redis.exists(idle) == 0  # over a cap: claims take nothing however many come
        await store.enqueue_many("wq", [JobSpec(input={"i": 7})])
        assert await wakes_before(redis, pubsub, channel) == 0
    finally:
        await pubsub.aclose()


async def idle_then_enqueue(store: QueueStore, task: asyncio.Task[Any], tag: str) -> None:
    """Let the worker idle past its backoff, enqueue one job, and check it was claimed on the wake-up."""
    await until(lambda: _exists(store, keyspace.prefix("q") + "idle"), "the worker to find the queue empty", task)
    await asyncio.sleep(IDLE_S)  # not a synchronisation: the worker's poll interval grows meanwhile
    (job_id,) = await store.enqueue_many("q", [JobSpec(input=faults.job_input(tag))])
    (job,) = await until_state(store, [job_id], "succeeded", task)
    assert job.started_at is not None
    waited = (job.started_at - job.created_at) / 1000
    assert waited < PROMPT_S, f"claimed {waited:.2f} s after its enqueue: at a poll, not on the wake-up"


async def _exists(store: QueueStore, key: str) -> bool:
    return bool(await store.redis.exists(key))


async def test_an_idle_worker_claims_a_new_job_at_once(
    store: QueueStore, valkey_url: str, sim: str, outputs: dict[str, Any]
) -> None:
    settings = make_settings(valkey_url, outputs, sim, "http-job")
    async with worker(settings, idle_poll_max=60.0) as (task, _):
        await idle_then_enqueue(store, task, "wake-1")
        await idle_then_enqueue(store, task, "wake-2")  # a second idle spell wakes it again


async def test_a_resumed_queue_is_claimed_at_once(
    store: QueueStore, valkey_url: str, sim: str, outputs: dict[str, Any]
) -> None:
    settings = make_settings(valkey_url, outputs, sim, "http-job")
    await store.pause("q")
    try:
        async with worker(settings, idle_poll_max=60.0) as (task, _):
            (job_id,) = await store.enqueue_many("q", [JobSpec(input=faults.job_input("paused-1"))])
            await asyncio.sleep(IDLE_S)  # the worker's poll interval grows; the paused queue keeps the job
            assert (await store.get(job_id)).state.value == "queued"
            seconds, micros = await store.redis.time()  # the store's clock, as the job's started_at
            await store.resume("q")
            await until(lambda: _claimed(store, job_id), "the job to be claimed", task, timeout=10)
            started_at = (await store.get(job_id)).started_at
            assert started_at is not None
            waited = started_at / 1000 - (seconds + micros / 1e6)  # not counting this test's own polling
            assert waited < PROMPT_S, f"claimed {waited:.2f} s after the resume: at a poll, not on the wake-up"
            await until_state(store, [job_id], "succeeded", task)
    finally:
        await store.resume("q")


async def _claimed(store: QueueStore, job_id: str) -> bool:
    return (await store.get(job_id)).started_at is not None


async def test_after_a_valkey_restart_the_worker_is_woken_again(
    own_valkey: ValkeyServer, sim: str, outputs: dict[str, Any]
) -> None:
    """The subscription dies with the connection; the worker subscribes again and claims once (a wake-up may
    have been lost), which leaves the flag behind again, so the next job is claimed at once too."""
    redis = await connect(own_valkey.url)
    store = QueueStore(redis)
    channel = keyspace.wake_channel("q")
    try:
        async with worker(make_settings(own_valkey.url, outputs, sim, "http-job"), idle_poll_max=60.0) as (task, _):
            await idle_then_enqueue(store, task, "restart-1")
            own_valkey.kill()
            own_valkey.restart()

            async def subscribed() -> bool:
                return dict(await redis_admin(store.redis).pubsub_numsub(channel)).get(channel, 0) >= 1

            await until(subscribed, "the worker to subscribe again", task, timeout=30)
            await idle_then_enqueue(store, task, "restart-2")
    finally:
        await redis.aclose()


async def test_listen_routes_by_channel_and_tells_every_handler_once_subscribed(own_valkey: ValkeyServer) -> None:
    """Each handler gets None whenever the subscription is (again) in place, the first time included: a wake
    published before it was lost, and the worker's first claims may have run ahead of it. Then messages go to
    their channel's handler only. After a Valkey SIGKILL and restart both handlers are told again."""
    redis = await connect(own_valkey.url)
    got: dict[str, list[str | None]] = {"a": [], "b": []}
    news = asyncio.Event()

    def handler(name: str) -> Callable[[str | None], None]:
        def handle(data: str | None) -> None:
            got[name].append(data)
            news.set()

        return handle

    listener = asyncio.create_task(wakeups.listen(redis, {"chan-a": handler("a"), "chan-b": handler("b")}))

    async def heard(expected: dict[str, list[str | None]]) -> None:
        async def equal() -> bool:
            return got == expected

        await until(equal, f"the handlers to have heard {expected} (they heard {got})", timeout=30)

    try:
        await heard({"a": [None], "b": [None]})
        await redis.publish("chan-b", "hello")
        await redis.publish("chan-other", "not ours")
        await heard({"a": [None], "b": [None, "hello"]})
        own_valkey.kill()
        own_valkey.restart()
        await heard({"a": [None, None], "b": [None, "hello", None]})
        try:
            await redis.publish("chan-a", "again")
        except RedisConnectionError:  # this test's own pooled connection died with the server: once more
            await redis.publish("chan-a", "again")
        await heard({"a": [None, None, "again"], "b": [None, "hello", None]})
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await redis.aclose()
