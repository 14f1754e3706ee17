"""The dispatch worker against lease and store defects found before: leases it does not know of, a job leased to it
again, store writes that fail, exact caps, a cancel during the rate-limit wait, a stale worker's output, the submit
intent. Real Valkey, the real simulator over HTTP, real S3 (helpers and fixtures from test_worker_faults).

A store write that "fails" is a real Redis error raised in place of one call (a connection reset at that
instant); everything else goes to the real server.
"""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import orjson
import pytest
import test_worker_faults as faults
from mypy_boto3_s3 import S3Client
from redis.exceptions import ConnectionError as RedisConnectionError
from support.s3server import RcloneS3
from test_worker import BACKENDS, BUCKET
from test_worker_faults import configure, enqueue, make_settings, stats, until, until_state, worker

from offload.queue.keyspace import prefix
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

# the fixtures this module shares with test_worker_faults (module-scoped servers, a clean simulator per test)
sim, no_outputs, bucket, store = faults.sim, faults.no_outputs, faults.bucket, faults.store
_quick_backoff, _clean_sim = faults._quick_backoff, faults._clean_sim
QUICK_LEASE_MS = 1500  # beats every 0.5 s: a lease the worker does not know of is handed back within ~1 s


def fail_first(monkeypatch: pytest.MonkeyPatch, name: str, times: int = 1) -> list[int]:
    """QueueStore.<name> raises a Redis connection error on its first `times` calls; returns the call count."""
    real = getattr(QueueStore, name)
    calls = [0]

    async def flaky(self: QueueStore, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] <= times:
            raise RedisConnectionError("Connection reset by peer (injected)")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(QueueStore, name, flaky)
    return calls


# -- a worker restarted with its predecessor's id; a task that ended after one failed write ---------------------


async def test_a_worker_restarted_with_the_same_id_finishes_its_predecessors_jobs(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OFFLOAD_LEASE_MS", str(QUICK_LEASE_MS))
    jobs = await enqueue(store, "restart", 3)
    wid = f"{socket.gethostname()}:1"  # a container: same hostname, PID 1
    await store.claim("q", wid, 2, lease_ms=QUICK_LEASE_MS)  # the predecessor, killed after its claim
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job"), worker_id=wid) as (task, _):
        done = await until_state(store, [j for j, _ in jobs], "succeeded", task, timeout=20)
    assert [j.lease_expiries for j in done] == [0, 0, 0], "handing back a lease we never knew of costs nothing"
    assert (await stats(sim))["submissions_by_input_id"] == {i: 1 for _, i in jobs}


async def test_a_verdict_that_hit_a_store_error_is_sent_again(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The remote job fails; the worker's `fail` meets Redis errors (twice: also the fallback verdict would). The
    job must not stay active forever (heartbeats renewing a lease nobody works on), nor end with the store's
    error instead of its own: the verdict is sent again and the job ends dead with the provider's error."""
    calls = fail_first(monkeypatch, "fail", times=2)
    await configure(sim, fail_rate=1.0, error_message="CUDA error")
    [(job_id, _)] = await enqueue(store, "verdict", max_attempts=1)
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job")) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task, timeout=15)
    assert calls[0] >= 3 and job.attempts == 1 and "CUDA error" in (job.error or "")


# -- a Redis error on complete after the output is stored ------------------------------------------------------


async def test_complete_is_sent_again_after_the_output_is_stored(
    valkey_url: str,
    s3: RcloneS3,
    sim: str,
    store: QueueStore,
    bucket: S3Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = fail_first(monkeypatch, "complete_many")
    [(job_id, input_id)] = await enqueue(store, "ack", max_attempts=1)
    async with worker(make_settings(valkey_url, s3, sim, "http-job")) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task, timeout=15)
    assert calls[0] >= 2 and job.attempts == 1 and job.error is None
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}
    assert input_id in bucket.get_object(Bucket=BUCKET, Key=job.output_key)["Body"].read().decode()


async def test_a_storage_blip_costs_the_job_no_attempt(
    valkey_url: str,
    s3: RcloneS3,
    sim: str,
    store: QueueStore,
    bucket: S3Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Object storage is our infrastructure too: a failed write is tried again in place (the job keeps its lease
    and its finished remote result), not charged to the job as a failed attempt."""
    from offload.storage import StorageError
    from offload.storage import store_output as real
    from offload.worker import run as run_module

    calls = [0]

    async def blip(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise StorageError("S3 answered 503 SlowDown (injected)")
        return await real(*args, **kwargs)

    monkeypatch.setattr(run_module, "store_output", blip)
    [(job_id, input_id)] = await enqueue(store, "s3-blip", max_attempts=1)
    async with worker(make_settings(valkey_url, s3, sim, "http-job")) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task, timeout=15)
    assert calls[0] == 2 and job.attempts == 1 and job.error is None
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}


# -- a stalled worker re-claims its own job ---------------------------------------------------------------------


async def test_a_job_leased_again_to_the_same_worker_runs_in_one_task(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
) -> None:
    """The worker stalls past its lease (here: its deadline is moved into the past), the maintenance returns
    its job to ready, and the worker's own next claim gets it again. The old task must stop before the new
    one runs, and the worker must keep seeing the job it runs (its drain and heartbeat depend on that)."""
    await configure(sim, latency=1.5)
    [(job_id, input_id)] = await enqueue(store, "again")
    peak = 0
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job")) as (task, w):
        await until_state(store, [job_id], "submitted", task)

        async def polling() -> bool:  # out of the submit call (a task inside it is left to record its answer)
            return not ((run := w.ctx.runs.get(job_id)) and run.calling())

        await until(polling, "the job's task to poll", task)
        async with w.leases.lock:  # the worker stalls: no claim or heartbeat of it can say it is alive meanwhile
            await store.redis.zadd(prefix("q") + "workers", {w.id: 0})
            assert (await store.reap("q"))[1] == 1  # back to ready, with its remote id

        async def finished() -> bool:
            nonlocal peak
            mine = [t for t in asyncio.all_tasks() if _runs(t, job_id)]
            peak = max(peak, len(mine))
            if mine:
                assert job_id in w.tasks and w.tasks[job_id] in mine, "a task runs that the worker cannot see"
            return (await store.get(job_id)).state == "succeeded" and not mine

        await until(finished, "the job to succeed", task, timeout=20)
    assert peak == 1, f"{peak} tasks ran one job at once"
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}


def _runs(task: asyncio.Task[Any], job_id: str) -> bool:
    frame = task.get_coro().cr_frame  # type: ignore[union-attr]
    run = frame.f_locals.get("run") if frame is not None else None
    job = getattr(run, "job", None)
    return not task.done() and getattr(job, "id", None) == job_id and task.get_coro().__name__ == "run_job"  # type: ignore[union-attr]


# -- the spend cap reserved `price_per_job or 0` ----------------------------------------------------------------


async def test_the_spend_cap_holds_with_price_per_second(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
) -> None:
    """$0.025 per billed second, 0.2 s jobs ($0.005 each), a cap of $0.1, poll_timeout 2 s: each submission
    is reserved at its worst case ($0.05) and settled to its real cost, so the cap is never passed."""
    await configure(sim, latency=0.2)
    jobs = await enqueue(store, "spend", 30)
    settings = make_settings(valkey_url, no_outputs, sim, "runpod", daily_spend_cap=0.1, poll_timeout=2)
    settings.backends["gpu"].price_per_second = 0.025
    async with worker(settings) as (task, _):

        async def settled() -> bool:
            c = (await store.stats("q")).counts
            return c["succeeded"] >= 2 and c["active"] + c["submitted"] == 0

        await until(settled, "the queue to settle at the cap", task, timeout=30)
    done = [j for j in [await store.get(j) for j, _ in jobs] if j.state == "succeeded"]
    spent = (await store.usage("q"))[2]
    real = sum(j.cost or 0 for j in done)
    submitted = (await stats(sim))["submissions"]
    assert spent <= 0.1 + 1e-9, f"spent {spent} over a cap of 0.1"
    assert abs(spent - real) < 1e-9 and submitted == len(done), (spent, real, submitted, len(done))


# -- once capped, workers kept claiming and holding the whole backlog -------------------------------------------


async def test_a_capped_queue_is_not_claimed_and_held_whole(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
) -> None:
    jobs = await enqueue(store, "capped", 40)
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job", daily_job_cap=2, concurrency=4)) as (
        task,
        _,
    ):

        async def settled() -> bool:
            c = (await store.stats("q")).counts
            return c["succeeded"] == 2 and c["active"] + c["submitted"] == 0

        await until(settled, "two jobs to succeed and the rest to wait", task)
        c = (await store.stats("q")).counts
    assert c["held"] <= 4 and c["queued"] == 38 - c["held"], c  # at most the claim that met the cap
    assert (await stats(sim))["submissions"] == 2 and len(jobs) == 40


# -- a job cancelled while its worker waits on the rate limit is still submitted ---------------------------------


async def test_a_cancel_during_the_rate_limit_wait_is_never_submitted(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
) -> None:
    await configure(sim, latency=30)
    settings = make_settings(valkey_url, no_outputs, sim, "http-job")
    settings.backends["gpu"].rate_limit = "1/hour"
    pairs = await enqueue(store, "ratelimited", 2)
    async with worker(settings, lease_ms=3000) as (task, _):
        # The two jobs ask for the one token at once, on two connections: either may get it (it was assumed
        # to be the first enqueued, and once under load the second won and the test waited on the first).
        async def one_submitted() -> bool:
            return "submitted" in [(await store.get(job_id)).state for job_id, _ in pairs]

        await until(one_submitted, "one job to take the only token", task)
        states = {job_id: (await store.get(job_id)).state for job_id, _ in pairs}
        assert sorted(states.values()) == ["active", "submitted"]  # the other waits for a token an hour away
        waiting, waiting_input = next((j, i) for j, i in pairs if states[j] == "active")
        assert await store.cancel(waiting) == "requested"
        [job] = await until_state(store, [waiting], "cancelled", task, timeout=10)
    assert job.submission is None
    assert waiting_input not in (await stats(sim))["submissions_by_input_id"]


# -- a worker reaped while storing the output still writes it ---------------------------------------------------


async def test_a_reaped_worker_does_not_overwrite_the_new_owners_output(
    valkey_url: str,
    s3: RcloneS3,
    sim: str,
    store: QueueStore,
    bucket: S3Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from offload.storage import store_output as real
    from offload.worker import run as run_module

    stalled, go = asyncio.Event(), asyncio.Event()

    async def stalls(*args: Any, **kwargs: Any) -> Any:
        stalled.set()
        await go.wait()  # the worker stops here (a GC pause, a SIGSTOP) after its remote job finished
        return await real(*args, **kwargs)

    monkeypatch.setattr(run_module, "store_output", stalls)
    [(job_id, _)] = await enqueue(store, "stale-writer")
    key = f"results/{job_id}.json"
    async with worker(make_settings(valkey_url, s3, sim, "http-job", concurrency=1)) as (task, w):
        await until(lambda: _is_set(stalled), "the worker to reach its output write", task)
        taken: list[Any] = []

        async def taken_over() -> bool:  # its lease is gone; a new owner finishes the job (from a newer remote run)
            await store.redis.zadd(prefix("q") + "workers", {w.id: 0})  # (again if the worker's own claim loop
            await store.reap("q")  # spoke between the two and so renewed itself: a race under load)
            taken[:] = await store.claim("q", "new-owner", 1, lease_ms=60_000)
            return bool(taken)

        await until(taken_over, "a new owner to take the reaped job", task)
        (new,) = taken
        bucket.put_object(Bucket=BUCKET, Key=key, Body=b'{"from": "the new owner"}')
        await store.complete(job_id, new.token, f"s3://{BUCKET}/{key}")
        go.set()

        async def gave_up() -> bool:
            return not w.tasks

        await until(gave_up, "the stale worker to give the job up", task)
    assert orjson.loads(bucket.get_object(Bucket=BUCKET, Key=key)["Body"].read()) == {"from": "the new owner"}
    assert (await store.get(job_id)).state == "succeeded"


async def _is_set(event: asyncio.Event) -> bool:
    return event.is_set()


# -- minor: a fatal submit counted against the job cap --------------------------------------------------------


async def test_a_refused_submission_does_not_use_up_the_job_cap(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
) -> None:
    """Replicate refuses an input that is not an object before anything runs: that job is dead, and the two
    others still fit a cap of two."""
    bad = await store.enqueue("q", JobSpec(input=["not", "an", "object"], max_attempts=1))
    good = await enqueue(store, "cap-left", 2)
    settings = make_settings(valkey_url, no_outputs, sim, "replicate", daily_job_cap=2, concurrency=1)
    async with worker(settings) as (task, _):
        await until_state(store, [j for j, _ in good], "succeeded", task)
        [dead] = await until_state(store, [bad], "dead", task)
    assert "must be a JSON object" in (dead.error or "")


# -- the submit window -----------------------------------------------------------------------------------------


async def test_an_intent_left_open_by_a_killed_worker_is_sent_again_under_its_key_and_counted(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
) -> None:
    [(job_id, input_id)] = await enqueue(store, "reopened")
    [dead] = await store.claim("q", "killed-worker", 1, lease_ms=200)
    assert await store.begin_many("q", [(dead.id, dead.token, 0.0)], backend="gpu") == ["OK:1"]
    # killed here, inside the submit call: the intent stays open
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job")) as (task, w):
        [job] = await until_state(store, [job_id], "succeeded", task)
        wid = w.id
    assert (job.submission, job.possible_duplicates, job.intent_by) == (1, 1, wid)
    assert await store.possible_duplicates("q") == {"gpu": 1}
    assert job.lease_expiries == 1 and (await stats(sim))["submissions_by_input_id"] == {input_id: 1}


def test_every_process_gets_its_own_worker_id() -> None:
    from offload.worker.dispatch import default_worker_id

    first, second = default_worker_id(), default_worker_id()
    assert first != second
    assert re.fullmatch(rf"{re.escape(socket.gethostname())}:\d+:[0-9a-f]{{6}}", first), first


async def test_a_longer_cool_down_is_never_shortened(valkey_url: str, store: QueueStore) -> None:
    """Two workers' 429s at once: one asks for 1 s, one for 10 s. Reading the TTL and setting it in two
    commands lets the short one overwrite the long one."""
    from offload.queue.backend_limits import BackendLimits

    class SlowSet:
        def __init__(self, redis: RedisClient) -> None:
            self._redis = redis

        def __getattr__(self, name: str) -> Any:
            return getattr(self._redis, name)

        async def set(self, *args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.3)  # this worker is slow between its two commands
            return await self._redis.set(*args, **kwargs)

    short = BackendLimits(SlowSet(store.redis), "gpu", None)
    long = BackendLimits(store.redis, "gpu", None)

    async def later() -> None:
        await asyncio.sleep(0.1)
        await long.cool_down(10)

    await asyncio.gather(short.cool_down(1), later())
    assert await store.redis.pttl("offload:{backend:gpu}:cooldown") > 9_000


async def test_every_backend_sends_the_idempotency_key_and_the_worker_in_its_user_agent() -> None:
    from aiohttp import web

    from offload.backends import create_backend, new_client
    from offload.backends.http import user_agent

    seen: list[dict[str, str]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        base = f"http://{request.host}"
        return web.json_response(
            {
                "id": "r-1",
                "request_id": "r-1",
                "status": "starting",
                "choices": [],
                "status_url": f"{base}/s",
                "response_url": f"{base}/r",
                "cancel_url": f"{base}/c",
            }
        )

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    agent = user_agent("gpu-box:1:abc123")
    try:
        async with new_client(agent=agent) as http:
            for kind, settings in BACKENDS.items():
                backend = create_backend(
                    "gpu", {**settings, "base_url": f"{base}/v1" if kind == "openai" else base}, client=http
                )
                await backend.submit({"prompt": "hi", "messages": []}, tag="q:job1", idempotency_key="q:job1.3")
    finally:
        await runner.cleanup()
    assert len(seen) == len(BACKENDS)
    assert [h.get("Idempotency-Key") for h in seen] == ["q:job1.3"] * len(BACKENDS)
    assert {h.get("User-Agent") for h in seen} == {agent} and agent.endswith(" worker/gpu-box:1:abc123")
    assert re.fullmatch(r"offload/\S+ worker/gpu-box:1:abc123", agent)


async def test_a_lease_lost_while_the_submit_call_is_out_costs_no_second_submission(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
) -> None:
    """The worker stalls inside a slow submit call (its lease lapses and is reaped), then gets the job again.
    The provider ignores Idempotency-Key, so a second send would be a second paid run: the first task must
    record its answer (attached to the job) and the new lease poll it, with one submission in all."""
    await configure(sim, honour_idempotency_key=False, latency=0.2, submit_latency=1.5)
    [(job_id, input_id)] = await enqueue(store, "slow-submit")
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job")) as (task, w):
        await until(lambda: _intent(store, job_id), "the submit call to be out (1.5 s long)", task)

        async def reaped() -> bool:  # its beat deadline put in the past (again, should a beat renew it): reaped
            await store.redis.zadd(prefix("q") + "workers", {w.id: 0})
            return (await store.reap("q"))[1] == 1 or (await store.get(job_id)).lease_expiries >= 1

        await until(reaped, "the lease to be reaped", task)
        [job] = await until_state(store, [job_id], "succeeded", task, timeout=20)
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}
    assert (job.submission, job.possible_duplicates) == (1, 0)


async def _intent(store: QueueStore, job_id: str) -> bool:
    return (await store.get(job_id)).submission == 1
