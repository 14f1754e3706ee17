"""The cluster-safety claim, shown on a real 3-master Valkey cluster: every script of a queue runs on
the node that owns the queue's hash tag, for queues spread over all three nodes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import test_lost_cancels
from redis.crc import key_slot
from support.admin_redis import redis_admin
from support.servers import SLOT_RANGES, ValkeyCluster

from offload.connection import connect
from offload.errors import ConfigError, UnsafeEvictionPolicy
from offload.eventloop import within
from offload.models import JobState
from offload.queue.keyspace import prefix, wake_channel
from offload.queue.memory import read_memory, require_noeviction
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.worker import wakeups


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    with ValkeyCluster(Path(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


@pytest.fixture
async def cstore(cluster: ValkeyCluster) -> AsyncIterator[QueueStore]:
    client = await connect(cluster.url + "?cluster=1")
    await redis_admin(client).flushall()
    yield QueueStore(client)
    await client.aclose()


def queues_on_every_node() -> list[str]:
    """One queue name per master, so the test proves all three nodes serve scripts."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < 3:
        name = f"q{n}"
        slot = key_slot(prefix(name).encode())
        node = next(i for i, (lo, hi) in enumerate(SLOT_RANGES) if lo <= slot <= hi)
        found.setdefault(node, name)
        n += 1
    return list(found.values())


async def test_full_lifecycle_on_each_master(cstore: QueueStore) -> None:
    for queue in queues_on_every_node():
        ids = await cstore.enqueue_many(queue, [JobSpec(input=i, priority=i % 3) for i in range(30)])
        later = await cstore.enqueue(queue, JobSpec(input="later", delay=3600))
        claimed = await cstore.claim(queue, "w", 30)
        assert sorted(c.id for c in claimed) == sorted(ids)
        await cstore.checkpoint(claimed[0].id, claimed[0].token, "runpod", "r-1")
        assert (await cstore.heartbeat(queue, "w", [c.id for c in claimed])).lost == []
        codes = await cstore.complete_many(queue, [(c.id, c.token, "res", 0.1) for c in claimed[:20]])
        assert codes == ["OK"] * 20
        assert await cstore.fail(claimed[20].id, claimed[20].token, "boom", retryable=False) == "dead"
        await cstore.hold(claimed[21].id, claimed[21].token, "cap")
        assert await cstore.release(queue) == [claimed[21].id]
        assert await cstore.requeue_dead(queue) == [claimed[20].id]
        assert await cstore.release_leases(queue, "w") == 8
        stats = await cstore.stats(queue)
        assert stats.counts["succeeded"] == 20 and stats.counts["queued"] == 10
        assert stats.counts["delayed"] == 1
        assert (await cstore.get(claimed[0].id)).state is JobState.SUCCEEDED
        assert await cstore.cancel(later) == "cancelled"
        assert len(await cstore.events(queue, "0")) > 5
        await cstore.reap(queue)
        _, points = await cstore.history(queue, "hour")  # written by the scripts on the queue's node, read back
        assert sum(p.counts["succeeded"] for p in points) == 20 and sum(p.counts["dead"] for p in points) == 1
        assert sum(p.counts["enqueued"] for p in points) == 31 and sum(p.counts["cancelled"] for p in points) == 1
    assert sorted(await cstore.queues()) == sorted(queues_on_every_node())
    _, summed = await cstore.history(queues_on_every_node(), "day")  # three nodes' buckets, summed point by point
    assert sum(p.counts["succeeded"] for p in summed) == 60


async def test_ingest_from_a_list_in_the_queue_slot(cstore: QueueStore) -> None:
    await redis_admin(cstore.redis).rpush("{gpu}:jobs", '{"id": "a1", "input": {"p": 1}}')
    assert await cstore.ingest("{gpu}:jobs", "gpu") == (1, 0)
    assert (await cstore.get("gpu:a1")).state is JobState.QUEUED


async def test_ingest_from_a_list_in_another_slot_names_the_fix(cstore: QueueStore) -> None:
    with pytest.raises(ConfigError, match=r"\{gpu\}"):
        await cstore.ingest("gpu:jobs", "gpu")


def _setter(event: asyncio.Event) -> Callable[[str | None], None]:
    """A wake-up handler that sets `event`."""
    return lambda _: event.set()


async def test_idle_workers_are_woken_on_every_master(cstore: QueueStore) -> None:
    """The wake-up (wakeups.py) on a cluster: the script PUBLISHes on the node of the queue's slot and classic
    pub/sub carries it to a subscriber connected anywhere. Until the subscription is in place a message is
    lost, so the test claims (leaving `idle`) and enqueues again until one arrives."""
    for queue in queues_on_every_node():
        woken = asyncio.Event()
        listener = asyncio.create_task(wakeups.listen(cstore.redis, {wake_channel(queue): _setter(woken)}))
        try:
            deadline = asyncio.get_running_loop().time() + 10
            while not woken.is_set():
                assert asyncio.get_running_loop().time() < deadline, f"no wake-up for {queue}"
                await cstore.claim(queue, "w", 100)  # empties the ready set: leaves `idle`
                await cstore.enqueue(queue, JobSpec(input="x"))
                with contextlib.suppress(TimeoutError):
                    await within(woken.wait(), 0.2)
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)


async def test_every_primary_is_read_for_its_memory_and_eviction_policy(
    cluster: ValkeyCluster, cstore: QueueStore
) -> None:
    """One primary of three switched to volatile-lru is enough to refuse the store, and the line names it; a
    full primary makes the store full (a cluster checks every master)."""
    memory = await read_memory(cstore.redis)
    assert sorted(n.node for n in memory.nodes) == sorted(f"127.0.0.1:{n.port}" for n in cluster.nodes)
    assert memory.problem is None and not memory.full
    odd = cluster.nodes[2]
    with odd.client() as c:
        c.config_set("maxmemory-policy", "volatile-lru")
    try:
        with pytest.raises(UnsafeEvictionPolicy) as refused:
            await require_noeviction(cstore.redis)
        assert str(refused.value).startswith(f"maxmemory-policy is volatile-lru on 127.0.0.1:{odd.port}:")
        with odd.client() as c:
            c.config_set("maxmemory", 1)
        assert (await read_memory(cstore.redis)).full
    finally:
        with odd.client() as c:
            c.config_set("maxmemory-policy", "noeviction")
            c.config_set("maxmemory", 0)


@pytest.mark.parametrize("command", ["set", "script"])
async def test_a_cancel_at_any_step_of_a_cluster_command_is_delivered(cstore: QueueStore, command: str) -> None:
    """As on one node (test_lost_cancels.py): the cluster client writes through the same connection class."""
    seen = await test_lost_cancels.outcomes_of(cstore.redis, test_lost_cancels.commands(cstore.redis)[command])
    assert seen["ran on"] == 0, seen
    assert seen["cancelled"] >= 4 * test_lost_cancels.TRIES, seen
