"""Provider faults, end to end through the dispatch worker: real Valkey, the real simulator over HTTP, real S3.

Each test drives one fault of the simulator (remote failures, 503 outages, 429s with and without Retry-After,
slow jobs, garbage bodies, cancels, expired results, wrong credentials) against every backend kind it applies
to, and checks both sides: the job record in Valkey and what the simulator saw (submissions per input id,
cancels, faults served). The synchronous `openai` backend has nothing to poll or cancel, so poll-side faults
skip it. Phases are switched by polling for an observable condition, never by sleeping. Retry backoff keeps
its formula (exponential, equal jitter: `retry_delay_ms`, tested in test_queue.py) with a 0.25 s base instead of
1 s, so the whole file fits in a minute on two slow cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from mypy_boto3_s3 import S3Client
from support.admin_redis import AdminRedis, redis_admin
from support.eventually import eventually
from support.s3server import RcloneS3
from test_worker import BACKENDS as BACKENDS
from test_worker import BUCKET as BUCKET

from bench import web
from offload.backoff import retry_delay_ms
from offload.config import Settings
from offload.connection import connect, is_outage
from offload.eventloop import within
from offload.models import Job
from offload.queue.replies import Checkpointed
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim
from offload.worker import endings
from offload.worker.dispatch import Worker
from offload.worker.run import run_worker

LATENCY = 0.2  # seconds a simulated remote job runs unless a test says otherwise
POLL = 0.1  # the queue's poll_interval
KEY = "offload-test-key-7c1e9a53d2"  # a credential that must never reach a job record or a log line
COOL_DOWN_KEY = "offload:{backend:gpu}:cooldown"
BACKOFF_MS = 250  # retry backoff base in these tests (production: 1 s)


@dataclass(frozen=True)
class Kind:
    """Where a backend kind shows up in the simulator: its route family and the routes its calls hit."""

    family: str
    submit: str
    status: str | None  # None: synchronous, nothing to poll
    remote_error: str  # what a failed remote job says, as it must appear in job.error
    auth_error: str  # the provider's complaint about a wrong API key


FAILURE = "GPU fell over: CUDA error 700"
KINDS: dict[str, Kind] = {
    "http-job": Kind("jobs", "jobs.submit", "jobs.status", FAILURE, "Unauthorized"),
    "runpod": Kind("runpod", "runpod.run", "runpod.status", FAILURE, "Unauthorized"),
    "replicate": Kind(
        "replicate", "replicate.create_model", "replicate.get", FAILURE, "You did not pass a valid authentication token"
    ),
    "fal": Kind("fal", "fal.submit", "fal.status", FAILURE, "Authentication is required"),
    "openai": Kind(
        "openai",
        "openai.chat",
        None,
        "The server had an error while processing your request",
        "Incorrect API key provided",
    ),
}
ALL = list(KINDS)
POLLED = [k for k in KINDS if KINDS[k].status is not None]
assert set(ALL) == set(BACKENDS)


# -- fixtures and helpers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with running_sim(SimConfig()) as url:
        yield str(url)


@pytest.fixture(scope="module")
def no_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Storage for tests whose jobs never succeed: local files, because every worker start with S3 storage
    builds a boto3 client (~0.5 s of CPU on a slow core), and these tests store nothing."""
    return {"kind": "local", "path": str(tmp_path_factory.mktemp("no-outputs"))}


@pytest.fixture(scope="module")
def bucket(s3: RcloneS3) -> S3Client:
    """One boto3 client for reading results back (making one is costly in CPU)."""
    return s3.client()


@pytest.fixture(autouse=True)
def _quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's retry delays with a 0.25 s base: same formula, a quarter of the wait."""
    monkeypatch.setattr(endings, "retry_delay_ms", functools.partial(retry_delay_ms, base_ms=BACKOFF_MS))


@pytest.fixture(autouse=True)
def _clean_sim(sim: str) -> None:
    """A fault-free simulator with no jobs and zeroed counters for every test."""
    with web.client(base_url=sim) as client:
        client.post("/_sim/config", json={"default": {"latency": LATENCY}}).raise_for_status()
        client.post("/_sim/reset").raise_for_status()


@pytest.fixture
async def store(valkey_url: str) -> AsyncIterator[QueueStore]:
    redis = await connect(valkey_url)
    yield QueueStore(redis)
    await redis.aclose()


def make_settings(
    valkey_url: str, storage: RcloneS3 | dict[str, Any], sim: str, kind: str, *, api_key: str = "sim-key", **queue: Any
) -> Settings:
    """Queue `q` on backend `gpu` of `kind` at the simulator; results in the S3 bucket (or `storage` as given)."""
    base = f"{sim}/v1" if kind == "openai" else sim
    return Settings.model_validate(
        {
            "redis_url": valkey_url,
            "storage": storage.settings(BUCKET) if isinstance(storage, RcloneS3) else storage,
            "backends": {"gpu": {**BACKENDS[kind], "base_url": base, "api_key": api_key}},
            "queues": {"q": {"backend": "gpu", "poll_interval": POLL, "poll_timeout": 30, **queue}},
        }
    )


async def sim_call(sim: str, method: str, path: str, body: Any = None) -> Any:
    async with web.async_client(base_url=sim, timeout=10) as client:
        response = await client.request(method, path, json=body)
        response.raise_for_status()
        return response.json()


async def configure(
    sim: str, *, api_key: str | None = None, honour_idempotency_key: bool = True, **behaviour: Any
) -> None:
    """Replace the simulator's whole config (jobs and counters stay): `behaviour` is the default family's."""
    config: dict[str, Any] = {
        "default": {"latency": LATENCY, **behaviour},
        "honour_idempotency_key": honour_idempotency_key,
    }
    if api_key is not None:
        config["api_key"] = api_key
    await sim_call(sim, "POST", "/_sim/config", config)


async def outage(sim: str, family: str, on: bool) -> None:
    await sim_call(sim, "POST", "/_sim/outage", {"family": family, "mode": "503" if on else None})


async def stats(sim: str) -> dict[str, Any]:
    result: dict[str, Any] = await sim_call(sim, "GET", "/_sim/stats")
    return result


async def fault_count(sim: str, route: str, kind: str) -> int:
    return int((await stats(sim))["faults"].get(f"{route} {kind}", 0))


async def remote_jobs(sim: str, input_id: str) -> list[dict[str, Any]]:
    """The simulator's remote jobs for one input id, oldest first (expired ones are gone)."""
    jobs: list[dict[str, Any]] = (await sim_call(sim, "GET", f"/_sim/jobs?input_id={input_id}"))["jobs"]
    return sorted(jobs, key=lambda j: j["created"])


def job_input(input_id: str, secret: str | None = None) -> dict[str, Any]:
    """An input every simulated API accepts; `id` lets the simulator count submissions per job. With `secret`,
    the input carries it, so any response that echoes the input (Replicate, OpenAI) carries it too."""
    note = f" (token {secret})" if secret else ""
    return {
        "id": input_id,
        "prompt": f"a haiku about {input_id}{note}",
        "messages": [{"role": "user", "content": f"hi{note}"}],
    }


async def enqueue(
    store: QueueStore, prefix: str, n: int = 1, *, max_attempts: int = 3, secret: str | None = None
) -> list[tuple[str, str]]:
    """(job id, input id) pairs."""
    inputs = [f"{prefix}-{i}" for i in range(n)]
    specs = [JobSpec(input=job_input(i, secret), max_attempts=max_attempts) for i in inputs]
    return list(zip(await store.enqueue_many("q", specs), inputs, strict=True))


@contextlib.asynccontextmanager
async def worker(
    settings: Settings, *, grace_s: float = 1.0, worker_id: str | None = None, **options: Any
) -> AsyncIterator[tuple[asyncio.Task[Any], Worker]]:
    """A dispatch worker on queue `q` for the block; yields (its task, the Worker once it runs). `options`
    override WorkerOptions fields (a quick first poll by default, so a 0.2 s remote job is seen finished at once)."""
    stop = asyncio.Event()
    ready: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()

    def tune(w: Worker) -> None:
        for name, value in {"first_poll": 0.05, **options}.items():
            setattr(w.options, name, value)
        ready.set_result(w)

    task = asyncio.create_task(
        run_worker(settings, "q", stop=stop, install_signals=False, grace_s=grace_s, worker_id=worker_id, on_ready=tune)
    )
    try:
        await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        yield task, ready.result()
    finally:
        stop.set()
        await within(task, 30)


@contextlib.asynccontextmanager
async def serving(settings: Settings, *, grace_s: float = 1.0, **options: Any) -> AsyncIterator[asyncio.Task[Any]]:
    """`worker`, for a block that needs only its task."""
    async with worker(settings, grace_s=grace_s, **options) as (task, _):
        yield task


async def until(
    check: Callable[[], Awaitable[bool]], what: str, worker: asyncio.Task[Any] | None = None, timeout: float = 20.0
) -> None:
    """`eventually`, through the test's own stall-tolerant read, failing at once when the worker ends."""
    await eventually(lambda: _observed(check), timeout, what, task=worker)


async def _observed(check: Callable[[], Awaitable[bool]]) -> bool:
    """The test's own read, which rides out a stalled Valkey as the worker does (its `StoreHealth`): these
    servers fsync every write, and on a loaded CI machine one read waited past redis-py's 5 s socket timeout
    while the worker under test carried on. A stall only means "not yet"; `until`'s deadline still holds."""
    try:
        return await check()
    except Exception as exc:
        if is_outage(exc):  # the worker's own rule for what an outage is
            return False
        raise


async def until_state(
    store: QueueStore, job_ids: list[str], state: str, worker: asyncio.Task[Any], timeout: float = 20.0
) -> list[Job]:
    async def reached() -> bool:
        return all([(await store.get(j)).state == state for j in job_ids])

    try:
        await until(reached, f"{len(job_ids)} job(s) to be {state}", worker, timeout)
    except AssertionError:
        jobs = [await store.get(j) for j in job_ids]
        seen = [(j.id, j.state.value, j.attempts, j.error) for j in jobs]
        raise AssertionError(f"not all {state}: {seen}") from None
    return [await store.get(j) for j in job_ids]


def assert_stored(bucket: S3Client, job: Job, input_id: str) -> None:
    """Guarantee 5 (docs/explanation/architecture.md): the output is in object storage at the job's key, and it is
    this job's."""
    assert job.result == f"s3://{BUCKET}/{job.output_key}"
    body = bucket.get_object(Bucket=BUCKET, Key=job.output_key)["Body"].read()
    assert input_id in orjson.dumps(orjson.loads(body)).decode()


async def redis_text(redis: AdminRedis) -> str:
    """Every key and value in the database, as text, to search for a leaked secret."""
    parts = []
    async for key in redis.scan_iter(count=1000):
        kind = await redis.type(key)
        value: Any
        if kind == "string":
            value = await redis.get(key)
        elif kind == "hash":
            value = await redis.hgetall(key)
        elif kind == "list":
            value = await redis.lrange(key, 0, -1)
        elif kind == "set":
            value = await redis.smembers(key)
        elif kind == "zset":
            value = await redis.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            value = await redis.xrange(key)
        else:
            value = kind
        parts.append(f"{key} {value!r}")
    return "\n".join(parts)


# -- remote failure --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL)
async def test_remote_failure_is_retried_with_backoff_then_dead(
    kind: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """Every remote job fails: each job is submitted exactly max_attempts times, each retry waits the backoff
    for its attempt number (scheduled in Redis: half to all of base * 2^(attempt-1)), and the job ends dead
    with the provider's error in job.error."""
    k = KINDS[kind]
    # The backoff is the worker's, not the backend's: its growth is shown once, the other kinds save a retry
    attempts = 3 if kind == "http-job" else 2
    await configure(sim, fail_rate=1.0, error_message=FAILURE)
    jobs = await enqueue(store, f"fail-{kind}", 2, max_attempts=attempts)
    async with serving(make_settings(valkey_url, no_outputs, sim, kind)) as worker:
        dead = await until_state(store, [j for j, _ in jobs], "dead", worker, timeout=30)
    seen = await stats(sim)
    events = await store.events("q", "0", count=10_000)
    for job, (_, input_id) in zip(dead, jobs, strict=True):
        assert job.attempts == attempts
        assert k.remote_error in (job.error or ""), job.error
        assert seen["submissions_by_input_id"][input_id] == attempts
        # The stream entry of each retry is stamped with the Redis time of the failure; the record keeps the
        # due time of the last retry, so their difference is exactly the backoff the worker chose.
        failed_at = [
            int(eid.split("-")[0]) for eid, e in events if e["state"] == "retrying" and job.id in e["jobs"].split()
        ]
        assert len(failed_at) == attempts - 1
        assert job.run_at is not None
        ceiling = BACKOFF_MS * 2 ** (attempts - 2)  # the last retry followed attempt number attempts-1
        assert ceiling / 2 - 2 <= job.run_at - failed_at[-1] <= ceiling + 2, (job.run_at, failed_at)


# -- transient errors (503 outages) ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", POLLED)
async def test_status_outage_never_resubmits(
    kind: str, valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, bucket: S3Client
) -> None:
    """503s on every status poll of a submitted job. The worker rides out nine in a row inside the attempt;
    at the tenth it gives the attempt up with the remote id kept, and the next attempt resumes polling the same
    remote job once the outage is over: it succeeds with exactly one submission."""
    k = KINDS[kind]
    assert k.status is not None
    # still running when the outage starts (set once the job is seen submitted: a loaded machine took over a
    # second for that, and a 1 s job had finished by then), done when it is over
    await configure(sim, latency=3.0)
    [(job_id, input_id)] = await enqueue(store, f"outage-{kind}")
    async with serving(make_settings(valkey_url, s3, sim, kind, poll_interval=0.05)) as worker:
        [submitted] = await until_state(store, [job_id], "submitted", worker)
        await outage(sim, k.family, True)
        [retrying] = await until_state(store, [job_id], "retrying", worker)
        assert await fault_count(sim, k.status, "outage_503") >= 10, "gave up before ten failed polls in a row"
        assert retrying.remote_id == submitted.remote_id, "a transient poll error must keep the remote id"
        assert "transient" in (retrying.error or "") and "503" in (retrying.error or ""), retrying.error
        await outage(sim, k.family, False)
        [job] = await until_state(store, [job_id], "succeeded", worker)
    seen = await stats(sim)
    # one attempt given up per ten failed polls in a row (normally one; more if the outage outlived a retry)
    assert job.attempts == 1 + seen["faults"][f"{k.status} outage_503"] // 10 >= 2
    assert job.remote_id == submitted.remote_id
    assert seen["submissions_by_input_id"] == {input_id: 1}
    assert_stored(bucket, job, input_id)


@pytest.mark.parametrize("kind", ALL)
async def test_submit_outage_is_retried(
    kind: str, valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, bucket: S3Client
) -> None:
    """503s on submit: nothing was created remotely, so the job is retried later (backoff in Redis) and
    succeeds; it is submitted once, after one failed attempt per 503 it got."""
    k = KINDS[kind]
    await outage(sim, k.family, True)
    [(job_id, input_id)] = await enqueue(store, f"submit-outage-{kind}", max_attempts=5)
    async with serving(make_settings(valkey_url, s3, sim, kind)) as worker:
        [retrying] = await until_state(store, [job_id], "retrying", worker)
        assert "transient" in (retrying.error or "") and "503" in (retrying.error or ""), retrying.error
        await outage(sim, k.family, False)
        [job] = await until_state(store, [job_id], "succeeded", worker)
    seen = await stats(sim)
    failed_submits = seen["faults"][f"{k.submit} outage_503"]
    assert failed_submits >= 1
    assert job.attempts == 1 + failed_submits
    assert seen["submissions_by_input_id"] == {input_id: 1}
    assert_stored(bucket, job, input_id)


# -- 429s ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", [True, False], ids=["retry-after", "no-retry-after"])
@pytest.mark.parametrize("kind", ALL)
async def test_throttling_shares_a_cool_down(
    kind: str, header: bool, valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, bucket: S3Client
) -> None:
    """429s on every submit, then on every poll. The first 429 sets the backend's shared cool-down in Redis,
    and every job waits it out instead of retrying at once: the simulator sees about one submit per job per
    cool-down (a naive retry loop would make hundreds), 429s never cost an attempt or create a remote job, and
    all jobs succeed once the provider stops throttling. Without Retry-After the worker backs off on its own
    (Replicate's body still says "Expected available in 1 second"). The variant without Retry-After also
    throttles every poll for a while: a throttled poll waits (a poll interval, or the provider's hint) and
    polls again within the same attempt. (With Retry-After a throttled poll would wait the full second; the
    header itself is already exercised by the submits.)"""
    k = KINDS[kind]
    n = 3
    fault = "429" if header else "429_bare"
    throttle: dict[str, Any] = {"rate_429": 1.0, "retry_after_header": header, "retry_after_seconds": 1.0}
    await configure(sim, faults_on=["submit"], **throttle)
    jobs = await enqueue(store, f"throttle-{kind}-{header}", n)
    started = time.monotonic()
    async with serving(make_settings(valkey_url, s3, sim, kind)) as worker:

        async def all_throttled() -> bool:
            return await fault_count(sim, k.submit, fault) >= n

        async def cooling() -> bool:
            return int(await store.redis.pttl(COOL_DOWN_KEY)) > 0

        await until(all_throttled, f"{n} submits answered 429", worker)
        await until(cooling, "the shared cool-down key", worker)
        # at most one round of submits per cool-down (1 s), plus the round in flight: far below a busy loop
        elapsed = time.monotonic() - started
        submits = (await stats(sim))["requests"][k.submit]
        assert submits <= n * (elapsed / 1.0 + 2), (submits, elapsed)
        if k.status is None or header:
            await configure(sim)
        else:
            await configure(sim, faults_on=["status"], **throttle)

            async def polls_throttled() -> bool:
                return await fault_count(sim, k.status or "", fault) >= n

            await until(polls_throttled, f"{n} polls answered 429", worker)
            await configure(sim)
        done = await until_state(store, [j for j, _ in jobs], "succeeded", worker)
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {i: 1 for _, i in jobs}, seen["submissions_by_input_id"]
    for job, (_, input_id) in zip(done, jobs, strict=True):
        assert job.attempts == 1, "a 429 is waited out inside the attempt, not charged as a failure"
        assert_stored(bucket, job, input_id)


# -- poll timeout ----------------------------------------------------------------------------------------


# The throttled case exercises the worker's poll loop, which is the same for every kind: one kind suffices.
@pytest.mark.parametrize(("kind", "cause"), [*((k, "slow") for k in POLLED), ("http-job", "throttled")])
async def test_poll_timeout_cancels_the_remote_job(
    kind: str, cause: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """A remote job that is not done within poll_timeout is cancelled at the provider (no GPU keeps burning for
    a job we gave up on); the job is retried with a fresh submission, then dead with a "not done after" error.
    Slow: the remote job just runs long. Throttled: every poll is answered 429, which must not keep the job
    polling (and leased) forever."""
    k = KINDS[kind]
    if cause == "slow":
        await configure(sim, latency=30)
    else:
        await configure(sim, rate_429=1.0, retry_after_header=False, faults_on=["status"])
    [(job_id, input_id)] = await enqueue(store, f"timeout-{kind}-{cause}", max_attempts=2)
    async with serving(make_settings(valkey_url, no_outputs, sim, kind, poll_timeout=0.4)) as worker:
        [job] = await until_state(store, [job_id], "dead", worker)
    assert job.attempts == 2
    assert "polltimeout" in (job.error or "") and "not done after 0.4s" in (job.error or ""), job.error
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {input_id: 2}
    if cause == "throttled":
        assert seen["faults"][f"{k.status} 429_bare"] >= 2
        return  # the remote jobs (0.2 s) had ended before the worker gave up: nothing left to cancel
    assert seen["cancels"] == {k.family: 2}
    assert [r["status"] for r in await remote_jobs(sim, input_id)] == ["cancelled", "cancelled"]


# -- malformed responses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", POLLED)
async def test_malformed_poll_responses_are_retried(
    kind: str, valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, bucket: S3Client
) -> None:
    """Status answers that are truncated JSON or lack the status field are transient: the worker polls again
    and the jobs succeed, each submitted once, with the real output stored. (fal's result body has no schema,
    so valid JSON missing a field is indistinguishable from an output; fal gets only truncated JSON.)"""
    k = KINDS[kind]
    assert k.status is not None
    garbage: dict[str, Any] = {
        "malformed_rate": 1.0,
        "malformed_kind": "invalid_json" if kind == "fal" else "mixed",
        "faults_on": ["status", "result"],
    }
    await configure(sim, latency=0.3, **garbage)
    jobs = await enqueue(store, f"garbled-{kind}", 2)
    async with serving(make_settings(valkey_url, s3, sim, kind)) as worker:

        async def garbled() -> bool:
            return await fault_count(sim, k.status or "", "malformed") >= 4

        await until(garbled, "four garbled status answers", worker)
        await configure(sim, latency=0.3)
        done = await until_state(store, [j for j, _ in jobs], "succeeded", worker)
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {i: 1 for _, i in jobs}
    for job, (_, input_id) in zip(done, jobs, strict=True):
        assert_stored(bucket, job, input_id)


@pytest.mark.parametrize("kind", ALL)
async def test_malformed_submit_responses_dead_letter_without_secrets(
    kind: str,
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every submit answer is garbage, from a provider that ignores Idempotency-Key: retried up to max_attempts,
    then dead with an excerpt of the response. The input carries the API key, so providers that echo the input
    (Replicate, OpenAI) put it in the garbage: the excerpt in job.error and the logs show [REDACTED] instead."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="offload")
    await configure(
        sim,
        api_key=KEY,
        malformed_rate=1.0,
        malformed_kind="invalid_json",
        faults_on=["submit"],
        honour_idempotency_key=False,
    )
    [(job_id, input_id)] = await enqueue(store, f"garbage-{kind}", max_attempts=2, secret=KEY)
    async with serving(make_settings(valkey_url, no_outputs, sim, kind, api_key=KEY)) as worker:
        [job] = await until_state(store, [job_id], "dead", worker)
    error = job.error or ""
    assert job.attempts == 2
    assert "not valid JSON" in error and '{"' in error, error  # names the problem and shows the response
    assert KEY not in error
    if kind in ("replicate", "openai"):
        assert "[REDACTED]" in error, error
    assert f"{job_id}: " in caplog.text and "-> dead" in caplog.text
    assert KEY not in caplog.text
    # the provider accepted each submit before its answer was garbled: one remote job per attempt, no more, and
    # the second one counted (the first answer, unreadable, was a 2xx)
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 2}
    assert job.possible_duplicates == 1


@pytest.mark.parametrize("kind", POLLED)
async def test_a_garbled_submit_answer_costs_nothing_where_the_key_is_honoured(
    kind: str,
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
) -> None:
    """The first submit's answer is garbage although the provider accepted it: the retry carries the same
    Idempotency-Key, so a provider that honours it answers with the first remote job. One remote job, paid once,
    and the job succeeds. The resend is counted as a possible duplicate all the same: a 2xx the worker could not
    read was accepted, and the worker cannot know that the provider honours the key."""
    await configure(sim, malformed_rate=1.0, malformed_kind="invalid_json", faults_on=["submit"])
    [(job_id, input_id)] = await enqueue(store, f"garbled-once-{kind}", max_attempts=3)
    async with serving(make_settings(valkey_url, no_outputs, sim, kind)) as worker:
        [job] = await until_state(store, [job_id], "succeeded", worker)
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}
    assert job.possible_duplicates == 1


# -- cancel ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", POLLED)
async def test_cancel_stops_the_remote_job(
    kind: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """`store.cancel` on a submitted job: the worker hears of it with its next heartbeat, cancels the remote
    job at the provider and the job ends cancelled, without a result."""
    k = KINDS[kind]
    await configure(sim, latency=30)
    [(job_id, input_id)] = await enqueue(store, f"cancel-{kind}")
    # a 3 s lease: the heartbeat (which carries cancel requests) runs every second instead of every 3.3 s
    async with serving(make_settings(valkey_url, no_outputs, sim, kind), lease_ms=3000) as worker:
        [submitted] = await until_state(store, [job_id], "submitted", worker)
        assert submitted.remote_id is not None
        assert await store.cancel(job_id) == "requested"
        [job] = await until_state(store, [job_id], "cancelled", worker)
    assert job.result is None
    seen = await stats(sim)
    assert seen["cancels"] == {k.family: 1}
    assert seen["submissions_by_input_id"] == {input_id: 1}
    [remote] = await remote_jobs(sim, input_id)
    assert remote["status"] == "cancelled"


# -- expired remote result -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", POLLED)
async def test_expired_result_is_resubmitted(
    kind: str, valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, bucket: S3Client
) -> None:
    """The provider drops results the moment a job ends (result_ttl 0, shorter than any poll interval): the
    poll gets 404 -> NotFound, the job is retried without its dead remote id and submitted again (a second,
    counted spend: the only way to get the output). Once results live long enough again, it succeeds."""
    k = KINDS[kind]
    await configure(sim, result_ttl=0)
    [(job_id, input_id)] = await enqueue(store, f"expired-{kind}", max_attempts=6)
    # a short grace: on a loaded machine the first poll may come after the 0.2 s job ended, and a 404 for a remote
    # job no poll has seen yet is taken for the status lagging its submit until the grace is over (worker/lag.py)
    async with serving(make_settings(valkey_url, s3, sim, kind), not_found_grace_s=0.5) as worker:
        [retrying] = await until_state(store, [job_id], "retrying", worker)
        assert "remote result expired" in (retrying.error or "") and "404" in (retrying.error or ""), retrying.error
        assert retrying.remote_id is None, "an expired remote job must not be polled again"
        await configure(sim)
        [job] = await until_state(store, [job_id], "succeeded", worker)
    seen = await stats(sim)
    submissions = seen["submissions_by_input_id"][input_id]
    # normally 2; one more for each further expiry if this test was slow to restore the TTL
    assert submissions >= 2 and job.attempts == submissions
    assert seen["duplicate_input_ids"] == [input_id]
    assert seen["responses"][f"{k.status} 404"] == submissions - 1
    assert (await store.stats("q")).totals.get("failed") == submissions - 1  # each expiry: one failed attempt
    assert_stored(bucket, job, input_id)


async def test_an_unexpected_error_after_submit_keeps_the_paid_for_remote_job(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, bucket: S3Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in our own code (here: the first output store raises something no handler expects) after the
    remote id was recorded: the job is retried with that remote id kept, the retry polls the finished remote
    job instead of paying for a new one, and it succeeds with exactly one submission."""
    from offload.storage import store_output as real
    from offload.worker import run as run_module

    failures = 0

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise RuntimeError("a bug in the output path")
        return await real(*args, **kwargs)

    monkeypatch.setattr(run_module, "store_output", flaky)
    [(job_id, input_id)] = await enqueue(store, "bug-after-submit", max_attempts=3)
    async with serving(make_settings(valkey_url, s3, sim, "http-job")) as worker:
        [retrying] = await until_state(store, [job_id], "retrying", worker)
        assert "RuntimeError" in (retrying.error or "") and retrying.remote_id, retrying
        [job] = await until_state(store, [job_id], "succeeded", worker)
    assert failures == 1
    assert job.remote_id == retrying.remote_id and job.attempts == 2
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}
    assert_stored(bucket, job, input_id)


CLOSED_TRANSPORT = "unable to perform operation on <TCPTransport closed=True>; the handler is closed"  # uvloop's


@pytest.mark.parametrize(
    ("lost", "error", "attempts"),
    [(1, "a reply garbled in transit", 1), (2, "a reply garbled in transit", 2), (3, CLOSED_TRANSPORT, 1)],
)
async def test_a_checkpoint_reply_lost_without_a_connection_error_never_pays_twice(
    valkey_url: str,
    s3: RcloneS3,
    sim: str,
    store: QueueStore,
    bucket: S3Client,
    monkeypatch: pytest.MonkeyPatch,
    lost: int,
    error: str,
    attempts: int,
) -> None:
    """The checkpoint of an accepted submission is written, and its reply is lost `lost` times in a row as a
    RuntimeError. The provider ignores the Idempotency-Key, so a second submission would be a second paid run.
    An error that is not an outage, once: the checkpoint is sent again and the job goes on in the same attempt;
    twice: the attempt fails as a worker error, keeping the remote id the store holds, and the retry polls it.
    uvloop's closed-transport error is an outage (connection.is_outage): waited out, however often, at no
    attempt. One submission in all, every time (before the fix, 2 and 3)."""
    real = QueueStore.checkpoint_many
    failures = 0

    async def reply_lost(self: QueueStore, queue: str, items: Any) -> list[Checkpointed]:
        nonlocal failures
        codes = await real(self, queue, items)
        if failures < lost:
            failures += 1
            raise RuntimeError(error)
        return codes

    monkeypatch.setattr(QueueStore, "checkpoint_many", reply_lost)
    await configure(sim, honour_idempotency_key=False)
    [(job_id, input_id)] = await enqueue(store, f"lost-checkpoint-{lost}", max_attempts=3)
    async with serving(make_settings(valkey_url, s3, sim, "http-job")) as worker:
        [job] = await until_state(store, [job_id], "succeeded", worker)
    assert failures == lost
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}
    assert job.attempts == attempts, job
    assert_stored(bucket, job, input_id)


async def test_an_orphan_of_a_crash_inside_submit_is_adopted_by_its_tag(
    valkey_url: str, s3: RcloneS3, sim: str, store: QueueStore, bucket: S3Client
) -> None:
    """A worker that died inside the submit call: the provider accepted the prediction (tagged with the job id in
    its input) but the id was never recorded. When the lease expires, the next worker finds that prediction by
    its tag and polls it instead of paying again: one submission in all. A job claimed for the first time never
    pays for the lookup."""
    from offload.backends import create_backend, new_client

    settings = Settings.model_validate(
        {
            "redis_url": valkey_url,
            "storage": s3.settings(BUCKET),
            "backends": {
                "gpu": {**BACKENDS["replicate"], "base_url": sim, "api_key": "sim-key", "tag_input_key": "offload_job"}
            },
            "queues": {"q": {"backend": "gpu", "poll_interval": POLL, "poll_timeout": 30}},
        }
    )
    [(orphan_id, orphan_input), (fresh_id, fresh_input)] = await enqueue(store, "orphan", 2)
    [claimed] = await store.claim("q", "crashed-worker", 1, lease_ms=200)
    assert claimed.id == orphan_id and not claimed.redelivered and not claimed.intent_open
    # as a worker does right before the provider call: the submit intent (submission 1) is recorded
    assert await store.begin_many("q", [(claimed.id, claimed.token, 0.0)]) == ["OK:1"]
    name, bs = settings.backend_for("q")
    async with new_client() as http:
        backend = create_backend(name, bs, client=http)
        submission = await backend.submit(claimed.input, tag=claimed.id)  # accepted; the crash loses the answer
    async with serving(settings) as worker:
        jobs = await until_state(store, [orphan_id, fresh_id], "succeeded", worker)
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {orphan_input: 1, fresh_input: 1}
    assert jobs[0].remote_id == submission.remote_id
    assert seen["requests"].get("replicate.list", 0) == 1, seen["requests"]  # the lookup: only for the orphan
    for job, input_id in zip(jobs, (orphan_input, fresh_input), strict=True):
        assert_stored(bucket, job, input_id)


async def test_a_worker_whose_lease_lapsed_does_not_submit(valkey_url: str, sim: str, store: QueueStore) -> None:
    """A worker process starved of CPU misses its beats; meanwhile its lease runs out and another worker takes
    the job. Before submitting, the starved worker beats first, learns the job is no longer its own and drops
    it: nothing is submitted, so the job is not paid for twice."""
    from offload.backends import create_backend, new_client
    from offload.queue.backend_limits import BackendLimits
    from offload.worker.dispatch import WorkerOptions

    [(job_id, input_id)] = await enqueue(store, "starved")
    [mine] = await store.claim("q", "starved-worker", 1, lease_ms=100)

    async def taken_over() -> bool:  # the other worker's claim reaps the lapsed lease and takes the job
        return bool(await store.claim("q", "other-worker", 1, lease_ms=60_000))

    await until(taken_over, "another worker to take over the lapsed job")
    async with new_client() as http:
        backend = create_backend("gpu", {"kind": "http-job", "base_url": sim, "api_key": "sim-key"}, client=http)
        worker = Worker(
            store,
            backend,
            _no_output,
            BackendLimits(store.redis, "gpu", None),
            WorkerOptions(queue="q", backend_name="gpu", lease_ms=3000),
            worker_id="starved-worker",
        )
        worker.leases.beat_at -= 10  # its last beat is long past: it was starved (and so was its claim)
        worker._start(mine, time.monotonic() - 10)
        task = worker.tasks[mine.id]
        await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert (await stats(sim))["submissions_by_input_id"].get(input_id, 0) == 0
    assert (await store.get(job_id)).state == "active"  # still the other worker's


async def _no_output(key: str, output: Any, run: str, fence: Any) -> str:
    raise AssertionError("nothing may finish here")


# -- fatal 4xx -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL)
async def test_wrong_api_key_is_fatal_and_never_leaks(
    kind: str,
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 401 cannot be fixed by retrying: the job is dead after one attempt, job.error names the HTTP status and
    the provider's complaint, nothing was submitted, and the key the worker holds appears nowhere in Valkey or
    in the logs."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="offload")
    await configure(sim, api_key="the-right-key-0000")
    [(job_id, _)] = await enqueue(store, f"badkey-{kind}", max_attempts=3)
    async with serving(make_settings(valkey_url, no_outputs, sim, kind, api_key=KEY)) as worker:
        [job] = await until_state(store, [job_id], "dead", worker)
    error = job.error or ""
    assert job.attempts == 1
    assert error.startswith("fatal:") and "HTTP 401" in error, error
    assert error.count(KINDS[kind].auth_error) == 1, error  # the provider's complaint, once
    assert (await stats(sim))["submissions"] == 0
    assert KEY not in orjson.dumps(job.to_dict()).decode()
    assert KEY not in await redis_text(redis_admin(store.redis))
    assert f"{job_id}: " in caplog.text and "-> dead" in caplog.text
    assert KEY not in caplog.text
