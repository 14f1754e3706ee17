"""The job store under lost replies, client retries, restarted workers, outages and big batches: each test is a
defect found before that the scripts must not show (on Valkey 9 and, when present, the system Redis 7).

A lost reply followed by a retry is what a cluster client does on its own after a timeout: the command ran,
its answer never arrived, the same command is sent again. `Replaying` is that client: it runs the chosen
scripts twice with the same arguments (optionally letting something happen in between) and answers with the
second reply, against the real server.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import orjson
import pytest
from support.admin_redis import AdminRedis, redis_admin

from offload.connection import connect
from offload.models import JobState
from offload.queue.keyspace import prefix
from offload.queue.scripts import SCRIPTS
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

Hook = Callable[[], Awaitable[None]]


class Replaying:
    """A Redis client whose chosen scripts run twice per call (the first reply is lost), via evalsha and via
    pipelines; everything else goes straight to the real client."""

    def __init__(self, redis: AdminRedis, shas: set[str], between: Hook | None = None) -> None:
        self._redis, self._shas, self._between = redis, shas, between

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)

    def client(self) -> RedisClient:
        """This proxy as the client it stands in for (every command it does not replay passes through)."""
        return cast(RedisClient, self)

    async def evalsha(self, sha: str, numkeys: int, *args: Any) -> Any:
        if sha in self._shas:
            await self._redis.evalsha(sha, numkeys, *args)  # ran; its reply is lost on the way back
            if self._between is not None:
                await self._between()
        return await self._redis.evalsha(sha, numkeys, *args)

    async def eval(self, source: str, numkeys: int, *args: Any) -> Any:  # after NOSCRIPT: the same, by source
        if hashlib.sha1(source.encode()).hexdigest() in self._shas:
            await self._redis.eval(source, numkeys, *args)
            if self._between is not None:
                await self._between()
        return await self._redis.eval(source, numkeys, *args)

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self)


class _Pipeline:
    def __init__(self, client: Replaying) -> None:
        self._client, self._calls = client, []  # type: tuple[Replaying, list[tuple[Any, ...]]]

    def evalsha(self, *args: Any) -> None:
        self._calls.append(args)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        out = []
        for args in self._calls:
            try:
                out.append(await self._client.evalsha(*args))
            except Exception as exc:
                if raise_on_error:
                    raise
                out.append(exc)
        return out


@pytest.fixture
async def redis(backend_url: str) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(backend_url))
    for script in (SCRIPTS.claim, SCRIPTS.enqueue):  # so the repeat goes by EVALSHA, as in production
        await client.script_load(script.source)
    yield client
    await client.aclose()


async def owners(store: QueueStore, ids: list[str]) -> dict[str, str | None]:
    return {j: (await store.get(j)).lease_owner for j in ids}


# -- a first claim batch whose reply a cluster client retried ---------------------------------------------


async def test_a_repeated_claim_answers_the_same_jobs_and_leases_no_more(redis: AdminRedis) -> None:
    plain = QueueStore(redis)
    ids = await plain.enqueue_many("q", [JobSpec(input=i, deadline_in=3600, max_cost=0.5) for i in range(4)])
    replaying = QueueStore(Replaying(redis, {SCRIPTS.claim.sha}).client())
    got = await replaying.claim("q", "w", 2)
    assert [c.id for c in got] == ids[:2]
    # the replayed answer carries each job's limits too (a routed queue routes by them)
    deadlines = [(await plain.get(i)).deadline for i in ids[:2]]
    assert [(c.deadline, c.max_cost) for c in got] == [(d, 0.5) for d in deadlines] and None not in deadlines
    counts = (await plain.stats("q")).counts
    assert (counts["active"], counts["queued"]) == (2, 2), "the repeat leased two more jobs nobody knows of"
    assert await owners(plain, ids) == {ids[0]: "w", ids[1]: "w", ids[2]: None, ids[3]: None}
    assert [c.attempt for c in got] == [1, 1]


# -- enqueue replayed without explicit ids --------------------------------------------------------------------


async def test_a_repeated_enqueue_leaves_a_job_claimed_meanwhile_alone(redis: AdminRedis) -> None:
    plain = QueueStore(redis)
    claimed: list[str] = []

    async def claim_meanwhile() -> None:
        claimed.extend(c.id for c in await plain.claim("q", "w1", 10))

    store = QueueStore(Replaying(redis, {SCRIPTS.enqueue.sha}, claim_meanwhile).client())
    ids = await store.enqueue_many("q", [JobSpec(input={"n": 1}), JobSpec(input={"n": 2})])
    assert claimed == ids  # a worker took them between the first run and its repeat
    counts = (await plain.stats("q")).counts
    assert (counts["queued"], counts["active"]) == (0, 2), "the repeat put claimed jobs back into ready"
    assert await plain.claim("q", "w2", 10) == [], "a second worker would submit them again"
    assert (await plain.stats("q")).totals["enqueued"] == 2


# -- heartbeat judged by job id, not token -------------------------------------------------------------------


async def test_heartbeat_judges_a_lease_by_its_token(backend_url: str) -> None:
    now = [7_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=1000, excuse_outages=False)
    [job_id] = await store.enqueue_many("q", [JobSpec(input=1)])
    (first,) = await store.claim("q", "w", 1)
    now[0] += 1001  # w stalls past its lease; the maintenance reaps it
    assert (await store.reap("q"))[1] == 1
    (second,) = await store.claim("q", "w", 1)  # and w's own claim gets the job again, under a new lease
    assert second.id == job_id and second.token != first.token
    stale = await store.heartbeat("q", "w", [(job_id, first.token)])
    assert stale.lost == [job_id], "the old task's lease is gone: it must stop"
    assert (await store.heartbeat("q", "w", [(job_id, second.token)])).lost == []
    await store.redis.aclose()


# -- a worker restarted with the same id inherits its predecessor's leases ------------------------------------


async def test_leases_a_worker_does_not_know_of_are_handed_back_uncounted(store: QueueStore) -> None:
    ids = await store.enqueue_many("q", [JobSpec(input=i) for i in range(3)])
    await store.claim("q", "box:1", 2)  # the predecessor (same hostname, PID 1), then it is killed
    first = await store.heartbeat("q", "box:1", [])  # the new process knows nothing: no watermark yet
    assert first.released == 0
    (mine,) = await store.claim("q", "box:1", 1)  # after that heartbeat: may still be on its way back
    second = await store.heartbeat("q", "box:1", [(mine.id, mine.token)], since=first.seq)
    assert second.released == 2 and second.lost == []
    jobs = {j: await store.get(j) for j in ids}
    assert {j for j, job in jobs.items() if job.state is JobState.QUEUED} == set(ids[:2])
    assert all(jobs[j].lease_expiries == 0 and jobs[j].attempts == 0 for j in ids[:2])  # not the jobs' fault
    assert jobs[mine.id].state is JobState.ACTIVE and jobs[mine.id].lease_owner == "box:1"
    # the claim that came after the watermark is never handed back, even unlisted
    assert (await store.heartbeat("q", "box:1", [], since=first.seq)).released == 0


# -- each lease expiry caused by an outage counted as an attempt --------------------------------------------


async def test_an_outage_costs_no_lease_expiry_but_a_dead_worker_is_still_reaped(backend_url: str) -> None:
    now = [3_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=10_000)
    a, b = await store.enqueue_many("q", [JobSpec(input=1), JobSpec(input=2)])
    (ja,) = await store.claim("q", "alive", 1)
    await store.claim("q", "dies", 1)
    now[0] += 30_000  # 30 s in which nobody reached Valkey; the server's maintenance is back first
    assert (await store.reap("q"))[1] == 0, "an outage was taken for two dead workers"
    now[0] += 1_000
    assert (await store.heartbeat("q", "alive", [(ja.id, ja.token)])).lost == []
    for _ in range(4):  # the queue is heard from again: "dies" never comes back, its lease runs out (and
        now[0] += 3_000  # the heartbeat of "alive" reaps it)
        await store.heartbeat("q", "alive", [(ja.id, ja.token)])
    job_a, job_b = await store.get(a), await store.get(b)
    assert job_a.state is JobState.ACTIVE and job_a.lease_expiries == 0
    assert job_b.state is JobState.QUEUED and job_b.lease_expiries == 1  # a crash: counted
    await store.redis.aclose()


async def test_an_outage_is_excused_once_per_worker_until_it_speaks(backend_url: str) -> None:
    """A queue whose only voice is a dead worker is silent by nature: it is excused one silence, then
    reaped, never postponed forever."""
    now = [4_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=10_000)
    [job_id] = await store.enqueue_many("q", [JobSpec(input=1)])
    await store.claim("q", "gone", 1)
    now[0] += 20_000
    assert (await store.reap("q"))[1] == 0  # first silence: excused
    now[0] += 20_000
    assert (await store.reap("q"))[1] == 1  # second: it had its chance
    assert (await store.get(job_id)).lease_expiries == 1
    await store.redis.aclose()


# -- an idempotency key expires while its job still waits ----------------------------------------------------


async def test_an_idempotency_key_lives_as_long_as_its_job_waits(store: QueueStore) -> None:
    later = time.time() + 3 * 86_400
    first = await store.enqueue("q", JobSpec(input=1, idempotency_key="order-9", run_at=later, retention=0))
    key = prefix("q") + "idem:order-9"
    assert await redis_admin(store.redis).ttl(key) == -1, "the key would expire before the job even runs"
    assert await store.enqueue("q", JobSpec(input=2, idempotency_key="order-9")) == first
    await store.cancel(first)  # finished: the key now lives as long as the record (retention 0: a century)
    assert await redis_admin(store.redis).ttl(key) > 86_400 * 365
    short = await store.enqueue("q", JobSpec(input=3, idempotency_key="order-10", retention=60))
    (c,) = await store.claim("q", "w", 1)
    assert c.id == short and await redis_admin(store.redis).ttl(prefix("q") + "idem:order-10") == -1
    await store.complete(c.id, c.token, "s3://b/r.json")
    assert 86_000 < await redis_admin(store.redis).ttl(prefix("q") + "idem:order-10") <= 86_400  # at least a day


# -- tutorial ingest rewrites the input through cjson -------------------------------------------------------


async def test_tutorial_input_is_kept_byte_for_byte(store: QueueStore) -> None:
    raw_input = (
        '{"n": 123456789012345678, "tags": [], "nested": {"a": [], "b": {}}, "f": 1.5e300, '
        '"s": "caf\\u00e9 \\"quoted\\" [x] {y}", "neg": -0.0000001}'
    )
    entries = [
        '{"id": "big", "input": ' + raw_input + ', "output_key": "results/big.json", "attempt": 1}',
        '{"id": 12345678901234567, "input": [1, [], {}]}',
    ]
    await redis_admin(store.redis).rpush("tut:jobs", *entries)
    assert await store.ingest("tut:jobs", "q") == (2, 0)
    (c1, c2) = await store.claim("q", "w", 2)
    assert c1.id == "q:big" and c1.input_json == raw_input
    assert c1.input["n"] == 123456789012345678 and c1.input["tags"] == [] and c1.input["nested"]["b"] == {}
    assert c2.id == "q:12345678901234567" and c2.input_json == "[1, [], {}]"
    assert (await store.get("q:big")).input == orjson.loads(raw_input)


# -- held-job release as one script of up to 100,000 jobs ---------------------------------------------------


async def test_held_jobs_are_released_in_small_steps_until_none_is_due(valkey_url: str) -> None:
    """Counted in the slow log (every command, on this test's Valkey only): each run of the release script
    is one entry, so a backlog released in one run blocked Valkey for all of it."""
    store = QueueStore(await connect(valkey_url))
    n = 1_200
    await store.enqueue_many("q", [JobSpec(input=i) for i in range(n + 10)])
    claimed = await store.claim("q", "w", n + 10)
    for at in range(0, len(claimed), 50):
        await asyncio.gather(
            *(
                store.hold(c.id, c.token, "daily jobs cap reached", "20200101" if i < n else "99991231")
                for i, c in enumerate(claimed[at : at + 50], start=at)
            )
        )
    await store.redis.script_load(SCRIPTS.release_window.source)
    await redis_admin(store.redis).config_set("slowlog-log-slower-than", 0)
    await redis_admin(store.redis).config_set("slowlog-max-len", 10_000)
    await redis_admin(store.redis).slowlog_reset()
    try:
        assert (await store.release_held("q")).released == n  # the store's day is past 2020, before 9999
        runs = [
            e
            for e in await redis_admin(store.redis).slowlog_get(10_000)
            if SCRIPTS.release_window.sha in str(e["command"])
        ]
    finally:
        await redis_admin(store.redis).config_set("slowlog-log-slower-than", 10_000)
    counts = (await store.stats("q")).counts
    assert (counts["queued"], counts["held"]) == (n, 10)
    assert len(runs) >= 3, f"released in {len(runs)} script run(s): Redis blocked for all of them at once"
    await store.redis.aclose()


# -- minor: one event entry could hold 100k ids; record trimming fell behind ---------------------------------


async def test_event_entries_are_bounded(store: QueueStore) -> None:
    await store.enqueue_many("q", [JobSpec(input=i) for i in range(1_000)])
    await store.claim("q", "w", 1_000)
    entries = await store.events("q", "0", count=10_000)
    sizes = [len(fields["jobs"].split()) for _, fields in entries]
    assert sum(sizes) == 2_000 and max(sizes) <= 100


async def test_trimming_keeps_up_with_the_claim_rate(backend_url: str) -> None:
    now = [2_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0])
    await store.enqueue_many("q", [JobSpec(input=i, retention=1) for i in range(1_000)])
    claimed = await store.claim("q", "w", 1_000)
    await store.complete_many("q", [(c.id, c.token, "r", None) for c in claimed])
    now[0] += 2_000  # every record's retention ran out
    await store.enqueue_many("q", [JobSpec(input=i) for i in range(500)])
    assert len(await store.claim("q", "w", 500)) == 500
    succeeded = (await store.stats("q")).counts["succeeded"]
    assert succeeded == 0, "a claim of 500 trims 1,100 records: as fast as jobs finish"
    await store.redis.aclose()
