"""Issue 34, item 4 and two bounds of item 8, end to end through the dispatch worker (real Valkey, the real
simulator over HTTP, real worker processes where memory is measured):

- a submit whose outcome is unknown (a gateway's 502/504/524 after the provider accepted it, a timeout after
  sending) keeps its intent open: the next claim adopts the remote job where the provider can be asked, else the
  resend is counted as a possible duplicate (and paid once where the key is honoured); a connection refused before
  anything was sent closes it (nothing to count);
- a status read that lags the submit (404 at first) is not expiry, for the worker that submitted and for one that
  resumes the job, until a bounded grace;
- an answer over `max_response_bytes` ends its job dead with the reason instead of growing the worker;
- a remote job still running at `poll_timeout` is submitted again only once its cancel was accepted: a backend that
  cannot cancel ends the job dead (or, with `resubmit_on_timeout`, pays again, counted), and a cancel that failed
  keeps the remote job.

Each test fails on the code before these changes (see the commit message for how that was checked).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_worker_faults as faults
import yaml
from support.servers import closed_port
from test_worker import BACKENDS
from test_worker_crash import OFFLOAD, READY_LINE, SimProcess, base_env, spawn, stop
from test_worker_faults import (
    ALL,
    KINDS,
    POLL,
    POLLED,
    configure,
    enqueue,
    fault_count,
    stats,
    until_state,
    worker,
)

from offload.config import Settings
from offload.models import Job
from offload.queue import keyspace
from offload.queue.store import QueueStore

# the fixtures this module shares with test_worker_faults (module-scoped servers, a clean simulator per test)
BUCKET, sim, no_outputs, bucket, store = faults.BUCKET, faults.sim, faults.no_outputs, faults.bucket, faults.store
_quick_backoff, _clean_sim = faults._quick_backoff, faults._clean_sim
MiB = 2**20


def settings(
    valkey_url: str, storage: dict[str, Any], base: str, kind: str, backend: dict[str, Any] | None = None, **queue: Any
) -> Settings:
    """Queue `q` on backend `gpu` of `kind` at `base` (the simulator, or a port nothing listens on), with
    `backend` settings on top of the kind's."""
    url = f"{base}/v1" if kind == "openai" else base
    return Settings.model_validate(
        {
            "redis_url": valkey_url,
            "storage": storage,
            "backends": {"gpu": {**BACKENDS[kind], "base_url": url, "api_key": "sim-key", **(backend or {})}},
            "queues": {"q": {"backend": "gpu", "poll_interval": POLL, "poll_timeout": 30, **queue}},
        }
    )


async def intent_open(store: QueueStore, job_id: str) -> bool:
    return await store.redis.hget(keyspace.job("q", job_id), "sub_open") == "1"


# -- a gateway's 5xx after the provider accepted the submit --------------------------------------------------


GATEWAY_CASES = [
    ("http-job", 502),
    ("http-job", 504),
    ("http-job", 524),
    ("runpod", 504),
    ("replicate", 502),
    ("fal", 524),
    ("openai", 504),
]


@pytest.mark.parametrize(("kind", "status"), GATEWAY_CASES)
async def test_a_gateway_error_after_the_provider_accepted_is_resent_under_its_key_and_counted(
    kind: str, status: int, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """Every submit is created at the provider, then a gateway answers its HTML error page instead of the answer
    (nginx's 502/504, Cloudflare's 524). The worker cannot tell whether it was accepted: the intent stays open
    and the next attempt sends the same submission again, under the same Idempotency-Key, counted as a possible
    duplicate. The simulator honours the key (the resend gets the first answer): one remote job, paid once.
    (Before: the 5xx closed the intent, and the resend went out uncounted.)"""
    await configure(sim, gateway_error_rate=1.0, gateway_statuses=[status])
    [(job_id, input_id)] = await enqueue(store, f"gateway-{kind}-{status}")
    async with worker(settings(valkey_url, no_outputs, sim, kind)) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task)
    seen = await stats(sim)
    assert seen["faults"][f"{KINDS[kind].submit} gateway_{status}"] == 1
    assert seen["submissions_by_input_id"] == {input_id: 1}, "paid twice"
    assert seen["idempotent_replays"] == {KINDS[kind].family: 1}
    assert job.attempts == 2
    assert job.possible_duplicates == 1, "the resend of an unknown outcome went uncounted"


@pytest.mark.parametrize("kind", ["http-job", "runpod"])
async def test_gateway_errors_from_a_provider_that_ignores_the_key_are_all_counted(
    kind: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The same against a provider that ignores Idempotency-Key: each attempt creates a remote job the worker
    never learns of, so the job is paid once per attempt and ends dead. What it cost is never silent: every
    resend is counted on the job, and the error names the gateway's status."""
    await configure(sim, gateway_error_rate=1.0, gateway_statuses=[504], honour_idempotency_key=False)
    [(job_id, input_id)] = await enqueue(store, f"gateway-ignored-{kind}", max_attempts=3)
    async with worker(settings(valkey_url, no_outputs, sim, kind)) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task)
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 3}
    assert job.possible_duplicates == 2, "a resend after a gateway 504 was not counted"
    assert "HTTP 504" in (job.error or "") and "Gateway Time-out" in (job.error or ""), job.error


async def test_a_gateway_error_is_adopted_by_its_tag_where_the_provider_can_be_asked(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """Replicate with `tag_input_key`, a provider ignoring the key, and a gateway 502 on every submit: the first
    submission exists; the intent stays open, so the next claim finds it by its tag and polls it. One remote job,
    no resend, nothing counted. (Before: the 502 closed the intent, nothing was looked up, and each attempt paid
    again.)"""
    await configure(sim, gateway_error_rate=1.0, gateway_statuses=[502], honour_idempotency_key=False)
    [(job_id, input_id)] = await enqueue(store, "gateway-adopted")
    config = settings(valkey_url, no_outputs, sim, "replicate", {"tag_input_key": "offload_job"})
    async with worker(config) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task)
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {input_id: 1}
    assert seen["requests"].get("replicate.list") == 1, "the orphan was not looked up by its tag"
    assert job.possible_duplicates == 0


# -- timeouts after sending, connections never made ------------------------------------------------------------


async def test_a_submit_that_times_out_after_sending_is_resent_under_its_key_and_counted(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The provider creates the job but answers after the backend's timeout: the worker gives the attempt up not
    knowing, keeps the intent open, and sends the same submission again under its key (answered 409 while the
    first request is still being served, then replayed): paid once, counted once."""
    await configure(sim, submit_latency=2.0)
    [(job_id, input_id)] = await enqueue(store, "timeout-after-send")
    async with worker(settings(valkey_url, no_outputs, sim, "http-job", {"timeout": 0.5})) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task, timeout=40)
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {input_id: 1}
    assert job.possible_duplicates == 1


async def test_a_connection_refused_before_sending_closes_the_intent_and_counts_nothing(
    valkey_url: str, no_outputs: dict[str, Any], store: QueueStore
) -> None:
    """Nothing listens at the provider's address: every submit fails before a byte is sent, so the provider
    cannot have taken it. Each attempt closes its intent and the next one is the same run under the same key,
    not a possible duplicate. (Before: a connection error kept the intent open and every retry was counted.)"""
    [(job_id, _)] = await enqueue(store, "refused", max_attempts=3)
    nowhere = f"http://127.0.0.1:{closed_port()}"
    async with worker(settings(valkey_url, no_outputs, nowhere, "http-job")) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task)
    assert job.attempts == 3
    assert "ConnectError" in (job.error or ""), job.error
    assert job.possible_duplicates == 0, "a submit that never left was counted as a possible duplicate"
    assert not await intent_open(store, job_id)


# -- a status read that lags the submit ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", POLLED)
async def test_a_status_that_lags_the_submit_is_not_expiry(
    kind: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The provider's status read answers 404 for 1 s after each submit (the remote jobs are done at 0.2 s): the
    worker polls on, and every job succeeds with one submission and one attempt. (Before: each 404 was read as
    an expired result, so each job was paid three times and ended dead as "remote result expired".)"""
    await configure(sim, status_lag=1.0)
    jobs = await enqueue(store, f"lag-{kind}", 2, max_attempts=3)
    async with worker(settings(valkey_url, no_outputs, sim, kind)) as (task, _):
        done = await until_state(store, [j for j, _ in jobs], "succeeded", task)
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {i: 1 for _, i in jobs}
    assert all(job.attempts == 1 for job in done), [(j.attempts, j.error) for j in done]
    assert await fault_count(sim, KINDS[kind].status or "", "status_lag") >= 2, "the status never lagged"


async def test_a_lagging_status_is_waited_out_by_the_worker_that_resumes_the_job(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """A worker submits, then is stopped while the status still answers 404 (an 8 s lag); it hands the job back
    with its remote id. The next worker, which has never seen that remote job, takes the 404 for the lag as long
    as the store's submit time is within the grace, and polls until the status appears: one submission. (Before:
    the resuming worker read the 404 as expiry and paid again.)"""
    await configure(sim, status_lag=8.0)
    [(job_id, input_id)] = await enqueue(store, "lag-resumed")
    config = settings(valkey_url, no_outputs, sim, "http-job")
    async with worker(config, grace_s=0.5) as (task, _):
        await until_state(store, [job_id], "submitted", task)
    handed_back = await fault_count(sim, "jobs.status", "status_lag")
    record = await store.get(job_id)
    assert record.state == "queued" and record.remote_id is not None, record  # handed back, keeping its remote id
    async with worker(config) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task, timeout=30)
    assert await fault_count(sim, "jobs.status", "status_lag") > handed_back, "the resumed job never met the lag"
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}
    assert job.remote_id == record.remote_id


async def test_a_step_of_the_stores_clock_does_not_cut_a_resumed_jobs_grace(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The store's clock steps forward between the submit and the resume (a chaos run: Valkey's clock stepped back
    22 min, the submit was stamped then, and the clock came back): by the store's clock the submit is an hour old.
    The resuming worker still waits a whole grace of its own before it takes a 404 for expiry, so the lagging
    status is waited out and the job is paid once. (Before: the grace was measured from the stamp, the 404 read
    as expiry and the job sent again.)"""
    await configure(sim, status_lag=8.0)
    [(job_id, input_id)] = await enqueue(store, "lag-clock-step")
    config = settings(valkey_url, no_outputs, sim, "http-job")
    async with worker(config, grace_s=0.5) as (task, _):
        await until_state(store, [job_id], "submitted", task)
    record = await store.get(job_id)
    assert record.state == "queued" and record.remote_id is not None, record
    key, redis = keyspace.job("q", job_id), store.redis
    stamps = await redis.hmget(key, ["submitted_at", "intent_at"])
    fields = ["submitted_at", "intent_at"]
    await redis.hset(key, mapping={f: str(int(float(s)) - 3_600_000) for f, s in zip(fields, stamps, strict=True) if s})
    async with worker(config) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task, timeout=30)
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}
    assert job.remote_id == record.remote_id


async def test_a_remote_job_never_found_is_given_up_after_the_grace(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The grace is bounded: a remote job whose status never appears (404 for good) is taken for gone once
    `not_found_grace_s` (here 1 s) has passed since its submit, and the job fails as today's expiry does, after
    polling on through the grace."""
    await configure(sim, status_lag=3600.0)
    [(job_id, input_id)] = await enqueue(store, "never-found", max_attempts=1)
    config = settings(valkey_url, no_outputs, sim, "http-job", {"not_found_grace_s": 1.0})
    async with worker(config) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task)
    assert "remote result expired" in (job.error or "") and "404" in (job.error or ""), job.error
    assert await fault_count(sim, "jobs.status", "status_lag") >= 3, "not polled on through the grace"
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}


# -- answers over max_response_bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL)
async def test_an_answer_over_max_response_bytes_ends_the_job_with_the_reason(
    kind: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """Each output carries 2 MiB of padding against a 1 MiB `max_response_bytes`: the job is dead at once with a
    reason naming the limit and the setting, the remote job was submitted once, and the worker goes on."""
    await configure(sim, output_bytes=2 * MiB)
    [(job_id, input_id)] = await enqueue(store, f"huge-{kind}")
    config = settings(valkey_url, no_outputs, sim, kind, {"max_response_bytes": MiB})
    async with worker(config) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task)
        assert not task.done()
    error = job.error or ""
    assert job.attempts == 1
    assert "larger than max_response_bytes (1048576 bytes, backends.gpu.max_response_bytes)" in error, error
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}


@pytest.fixture(scope="module")
def sim_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    """The simulator as its own process: a huge answer must not be built inside the process under test."""
    server = SimProcess(tmp_path_factory.mktemp("sim")).start()
    try:
        yield server
    finally:
        server.close()


def _memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for process {pid}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads peak memory from /proc (Linux)")
async def test_a_150_mb_answer_leaves_the_worker_process_its_size(
    valkey_url: str, sim_process: SimProcess, store: QueueStore, tmp_path: Path
) -> None:
    """`offload worker` as a process with the default limit (8 MiB), a job whose remote output is 150 MB: the job
    is dead with the reason, the worker's peak resident memory stays within 100 MiB of what it used before, and
    it goes on to run the next job. (Before: it read and stored all of it, its peak ~450 MB higher.)"""
    config = tmp_path / "offload.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "redis_url": valkey_url,
                "storage": {"kind": "local", "path": str(tmp_path / "results")},
                "backends": {"gpu": {"kind": "http-job", "base_url": sim_process.url, "api_key": "sim-key"}},
                "queues": {"q": {"backend": "gpu", "poll_interval": 0.2, "poll_timeout": 60}},
            }
        )
    )
    sim_process.configure(latency=0.5)
    log = tmp_path / "worker.log"
    proc = spawn(
        [OFFLOAD, "worker", "--queue", "q", "--config", str(config), "--grace", "2"], base_env(), tmp_path, log
    )
    try:
        deadline = time.monotonic() + 60
        while READY_LINE not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            await asyncio.sleep(0.05)
        [(warm, _)] = await enqueue(store, "warm-up")  # every code path of a job loaded before the baseline
        await _until_state(store, warm, "succeeded", proc, log)
        before = _memory_kib(proc.pid, "VmRSS")
        sim_process.configure(latency=0.5, output_bytes=150_000_000)
        [(huge, _)] = await enqueue(store, "huge")
        [job] = [await _until_state(store, huge, "dead", proc, log)]
        peak = _memory_kib(proc.pid, "VmHWM")
        print(f"\nworker RSS before the 150 MB answer {before / 1024:.0f} MiB, peak after {peak / 1024:.0f} MiB")
        assert "max_response_bytes" in (job.error or ""), job.error
        assert peak - before < 100 * 1024, f"peak {peak} KiB against {before} KiB before"
        sim_process.configure(latency=0.5)
        [(after, _)] = await enqueue(store, "after")
        await _until_state(store, after, "succeeded", proc, log)
        assert proc.poll() is None
    finally:
        stop(proc, signal.SIGTERM)


async def _until_state(store: QueueStore, job_id: str, state: str, proc: Any, log: Path) -> Job:
    """The job once in `state`, failing at once if it ends in another or the worker process exits."""
    deadline = time.monotonic() + 60
    while True:
        job = await store.get(job_id)
        if job.state == state:
            return job
        assert not job.state.terminal, f"job {job_id} ended {job.state}, not {state}: {job.error}"
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]  # noqa: ASYNC240 - a small local file, on the way to failing
            raise AssertionError(f"the worker exited: {tail}")
        assert time.monotonic() < deadline, f"timed out waiting for {job_id} to be {state}"
        await asyncio.sleep(0.1)


# -- poll_timeout on a backend that cannot cancel --------------------------------------------------------------


@pytest.mark.parametrize("why", ["cancel-disabled", "no-cancel-route"])
async def test_a_remote_job_past_poll_timeout_that_cannot_be_cancelled_is_not_submitted_again(
    why: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """A 30 s remote job, a 0.4 s poll_timeout, an `http-job` API without cancel (`cancel: false`, or the route
    answering 405): the job ends dead at the first timeout with the reason, its remote job paid once and kept on
    the record. (Before: it was submitted again, and both runs went on to be paid.)"""
    if why == "no-cancel-route":
        await configure(sim, latency=30, cancel_error=405)
    else:
        await configure(sim, latency=30)
    [(job_id, input_id)] = await enqueue(store, f"no-cancel-{why}", max_attempts=2)
    backend = {"cancel": False} if why == "cancel-disabled" else {}
    async with worker(settings(valkey_url, no_outputs, sim, "http-job", backend, poll_timeout=0.4)) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task)
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {input_id: 1}, "paid again while the first run still runs"
    assert seen["cancels"] == {}
    error = job.error or ""
    assert "this backend cannot cancel it, so it is not submitted again" in error, error
    assert job.attempts == 1 and job.remote_id is not None


async def test_resubmit_on_timeout_pays_for_a_second_run_and_counts_it(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The documented opt-in: with `resubmit_on_timeout: true` a job whose remote job cannot be cancelled is
    submitted again at poll_timeout, and that second paid run is counted as a possible duplicate."""
    await configure(sim, latency=30)
    [(job_id, input_id)] = await enqueue(store, "resubmit-on-timeout", max_attempts=2)
    backend = {"cancel": False, "resubmit_on_timeout": True}
    async with worker(settings(valkey_url, no_outputs, sim, "http-job", backend, poll_timeout=0.4)) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task)
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 2}
    assert job.possible_duplicates == 1
    assert (await store.possible_duplicates("q")) == {"gpu": 1}


@pytest.mark.parametrize("kind", POLLED)
async def test_a_cancel_that_fails_at_poll_timeout_keeps_the_remote_job(
    kind: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """A backend that can cancel, but the cancel fails (500): no second run is started while the first may still
    run. The retry polls the same remote job again; when the attempts are used up the job is dead with the reason,
    its remote job paid once. (Before: the failed cancel was ignored and the job submitted again.)"""
    await configure(sim, latency=30, cancel_error=500)
    [(job_id, input_id)] = await enqueue(store, f"cancel-fails-{kind}", max_attempts=2)
    async with worker(settings(valkey_url, no_outputs, sim, kind, poll_timeout=0.4)) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task)
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {input_id: 1}, "paid again while the first run may still run"
    assert seen["faults"][f"{KINDS[kind].family}.cancel cancel_500"] == 2
    error = job.error or ""
    assert "its cancel failed" in error and "not submitted again" in error, error
    assert job.attempts == 2
