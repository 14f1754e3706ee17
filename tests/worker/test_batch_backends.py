"""Issue 39 item 5 through the dispatch worker: queues on `openai-batch` and `anthropic-batch` backends against
the simulator's Batch API and Message Batches (real HTTP), real Valkey.

- a pack of jobs goes out as one provider batch, and each job completes with its own line's output, at the
  backend's (discounted) price;
- an errored line fails only its job; a batch that expires returns its unfinished jobs, which complete in a
  later batch, the returns not counted as attempts (a job outlives more expiries than max_attempts);
- every way a packed job ends removes its pack record (a refused create, an expiry, a completion);
- a lost answer to the batch create (the simulator creates the batch, then resets the connection) is adopted
  from the provider's listing: exactly one batch per pack, never a second;
- a pack closes at `max_pack`, at `max_wait_s`, and before the earliest deadline of its jobs;
- the operator's cancel of a job in a batch is honoured when the batch ends;
- bad config fails at start naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import test_worker_faults as faults
import yaml
from support.servers import ValkeyServer
from test_worker import BACKENDS
from test_worker_crash import OFFLOAD, READY_LINE, base_env, spawn, stop
from test_worker_faults import LATENCY, sim_call, until_state, worker

from bench import web
from offload.config import Settings
from offload.connection import connect
from offload.errors import ConfigError
from offload.models import Job
from offload.queue import keyspace
from offload.queue.keyspace import packs
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.schema import parse
from offload.worker.dispatch import Worker

BUCKET, sim, no_outputs, store = faults.BUCKET, faults.sim, faults.no_outputs, faults.store
_quick_backoff, _clean_sim = faults._quick_backoff, faults._clean_sim
PROVIDERS = ["openai", "anthropic"]
PRICE = 0.0025  # the batch price per job (half the interactive 0.005)


def settings(valkey_url: str, storage: dict[str, Any], sim: str, provider: str, **backend: Any) -> Settings:
    return Settings.model_validate(settings_data(valkey_url, storage, sim, provider, **backend))


def settings_data(
    valkey_url: str,
    storage: dict[str, Any],
    sim: str,
    provider: str,
    queue: dict[str, Any] | None = None,
    **backend: Any,
) -> dict[str, Any]:
    base = f"{sim}/v1" if provider == "openai" else sim
    return {
        "redis_url": valkey_url,
        "storage": storage,
        "backends": {
            "cheap": {
                "kind": f"{provider}-batch",
                "base_url": base,
                "api_key": "sim-key",
                "model": "sim-model",
                "price_per_job": PRICE,
                "max_wait_s": 0.5,
                "batch_poll_interval_s": 0.2,
                **backend,
            }
        },
        "queues": {"q": {"backend": "cheap", "poll_timeout": 30, "max_attempts": 3, **(queue or {})}},
    }


async def batch_sim(sim: str, **batches: Any) -> None:
    config: dict[str, Any] = {"default": {"latency": LATENCY}, "batches": {"seconds": 0.4, **batches}}
    await sim_call(sim, "POST", "/_sim/config", config)


async def batches(sim: str, provider: str) -> list[dict[str, Any]]:
    """Every batch the simulator holds for `provider`, through its own listing."""
    path = "/v1/batches?limit=100" if provider == "openai" else "/v1/messages/batches?limit=1000"
    headers = {"Authorization": "Bearer sim-key", "x-api-key": "sim-key", "anthropic-version": "2023-06-01"}
    async with web.async_client(base_url=sim, timeout=10) as client:
        response = await client.get(path, headers=headers)
        response.raise_for_status()
    listed: list[dict[str, Any]] = response.json()["data"]
    return listed


async def enqueue(store: QueueStore, prefix: str, n: int, **spec: Any) -> list[str]:
    specs = [
        JobSpec(input={"max_tokens": 16, "messages": [{"role": "user", "content": f"{prefix}-{i}"}]}, **spec)
        for i in range(n)
    ]
    return await store.enqueue_many("q", specs)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_pack_is_one_batch_and_each_job_completes_on_its_own(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    await batch_sim(sim)
    ids = await enqueue(store, f"pack-{provider}", 6)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, w):
        (lane,) = w.ctx.router.lanes
        assert lane.turnaround_s == pytest.approx(0.5 + 3600)  # max_wait_s + expected_duration_s, until measured
        jobs = await until_state(store, ids, "succeeded", task)
        assert w.in_flight == 0  # no job took one of the `concurrency` slots
        assert lane.turnaround_s is not None and 0.5 < lane.turnaround_s < 60  # the batch's run time, measured
    listed = await batches(sim, provider)
    assert len(listed) == 1, listed
    batch_id = listed[0]["id"]
    assert sorted(j.remote_id or "" for j in jobs) == sorted(f"{batch_id}#{i}" for i in range(6))
    assert all(j.cost == pytest.approx(PRICE) for j in jobs)
    assert len({j.result for j in jobs if j.result}) == 6  # one stored output per job


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_an_errored_line_fails_only_its_job(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    await batch_sim(sim)
    good = await enqueue(store, f"partial-{provider}", 3)
    # a line the endpoint refuses (no messages): a 400 in the batch, fatal for that job only
    (bad,) = await store.enqueue_many("q", [JobSpec(input={"max_tokens": 16}, max_attempts=3)])
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):
        await until_state(store, good, "succeeded", task)
        (dead,) = await until_state(store, [bad], "dead", task)
    assert dead.error is not None and "batch line errored" in dead.error
    assert dead.attempts == 1  # a 400 is not retried
    assert len(await batches(sim, provider)) == 1


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_an_expired_batch_returns_its_jobs_which_complete_in_a_later_one(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    await batch_sim(sim, seconds=30, expire_after=0.5)  # the first batch expires long before its lines finish
    ids = await enqueue(store, f"expire-{provider}", 3)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):

        async def first_ended() -> bool:
            listed = await batches(sim, provider)
            return bool(listed) and all(
                b.get("status", b.get("processing_status")) in ("expired", "ended") for b in listed
            )

        await faults.until(first_ended, "the first batch to expire", task)
        await batch_sim(sim)  # the next batch runs normally
        jobs = await until_state(store, ids, "succeeded", task, timeout=40)
    assert len(await batches(sim, provider)) >= 2
    assert all(j.cost == pytest.approx(PRICE) for j in jobs)  # the expired run was not paid for


async def expired_batches(sim: str, provider: str) -> int:
    listed = await batches(sim, provider)
    return sum(b.get("status") == "expired" or b.get("request_counts", {}).get("expired", 0) > 0 for b in listed)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_returns_from_expired_batches_do_not_use_up_attempts(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """A job whose batches expire more times than its max_attempts is still retried, and completes in the first
    batch that runs: a return is not a try, so its record counts only the claim that ran it."""
    await batch_sim(sim, seconds=30, expire_after=0.3)  # every batch expires long before its lines finish
    ids = await enqueue(store, f"expiries-{provider}", 2)
    cfg = settings(valkey_url, no_outputs, sim, provider, queue={"max_attempts": 2})
    async with worker(cfg) as (task, _):

        async def expired_often() -> bool:
            return await expired_batches(sim, provider) >= 4  # twice max_attempts

        await faults.until(expired_often, "four batches to expire", task, timeout=60)
        states = [(await store.get(i)).state for i in ids]
        assert "dead" not in states, states  # (before: dead after its second expiry)
        await batch_sim(sim)  # the next batch runs normally
        jobs = await until_state(store, ids, "succeeded", task, timeout=60)
    assert all(j.attempts == 1 for j in jobs), [j.attempts for j in jobs]
    assert all(j.cost == pytest.approx(PRICE) for j in jobs)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_pack_records_are_removed_however_a_packed_job_ends(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """A refused create (the job dies), an expiry (the job goes back) and a completion each remove the job's pack
    record: once every job has ended the queue's packs hash is empty."""
    await sim_call(sim, "POST", "/_sim/config", {"api_key": "another-key", "batches": {"seconds": 0.4}})
    refused = await enqueue(store, f"records-refused-{provider}", 2)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):
        await until_state(store, refused, "dead", task)
        await batch_sim(sim, seconds=30, expire_after=0.3)
        ids = await enqueue(store, f"records-expired-{provider}", 2)
        await faults.until(lambda: _expired_once(sim, provider), "a batch to expire", task, timeout=60)
        await batch_sim(sim)
        await until_state(store, ids, "succeeded", task, timeout=60)
        assert await store.redis.hgetall(packs("q")) == {}
    assert await store.redis.exists(packs("q")) == 0


async def _expired_once(sim: str, provider: str) -> bool:
    return await expired_batches(sim, provider) >= 1


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_lost_create_answer_is_adopted_not_created_again(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """The simulator creates the batch, then resets the connection: the jobs' intents stay open; the next
    claim finds the batch by the pack's record (OpenAI: its metadata tag; Anthropic: time, count, then the
    results' custom_ids) and adopts it."""
    await batch_sim(sim)
    family = "openai" if provider == "openai" else "anthropic"
    config = {
        "default": {"latency": LATENCY},
        "batches": {"seconds": 0.4},
        "families": {family: {"lost_response_rate": 1.0}},
    }
    await sim_call(sim, "POST", "/_sim/config", config)
    ids = await enqueue(store, f"lost-{provider}", 4)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):

        async def created() -> bool:
            return len(await batches(sim, provider)) == 1

        await faults.until(created, "the batch to be created", task)
        await batch_sim(sim)  # answers come through again
        jobs = await until_state(store, ids, "succeeded", task, timeout=40)
    await assert_one_batch(sim, provider, jobs)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_pack_closes_at_max_pack(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    await batch_sim(sim)
    ids = await enqueue(store, f"maxpack-{provider}", 5)
    # max_wait_s far away: only the count closes packs (2 + 2), and the last job's pack by its own wait
    cfg = settings(valkey_url, no_outputs, sim, provider, max_pack=2, max_wait_s=3)
    async with worker(cfg) as (task, _):
        await until_state(store, ids, "succeeded", task, timeout=40)
    sizes = sorted(_total(b) for b in await batches(sim, provider))
    assert sizes == [1, 2, 2]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_deadline_closes_the_pack_before_max_wait(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    await batch_sim(sim)
    # max_wait_s of an hour; the job's deadline (latest start) in 15 s: the pack goes out ~10 s before it
    ids = await enqueue(store, f"deadline-{provider}", 2, deadline_in=15)
    started = time.monotonic()
    async with worker(settings(valkey_url, no_outputs, sim, provider, max_wait_s=3600)) as (task, _):
        await until_state(store, ids, "succeeded", task, timeout=40)
    assert time.monotonic() - started < 30
    assert len(await batches(sim, provider)) == 1


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_an_operator_cancel_is_honoured_when_the_batch_ends(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    await batch_sim(sim, seconds=2)
    ids = await enqueue(store, f"cancel-{provider}", 3)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):
        await all_in_batch(store, ids, task)
        await store.cancel(ids[0])
        await until_state(store, ids[1:], "succeeded", task)
        await until_state(store, ids[:1], "cancelled", task)
    assert len(await batches(sim, provider)) == 1


async def assert_one_batch(sim: str, provider: str, jobs: list[Job]) -> None:
    """The simulator saw exactly one batch, and every job's remote id is a line of it."""
    listed = await batches(sim, provider)
    assert len(listed) == 1, f"a second batch was created: {listed}"
    assert all((j.remote_id or "").startswith(listed[0]["id"] + "#") for j in jobs)


async def all_in_batch(store: QueueStore, ids: list[str], task: asyncio.Task[Any]) -> None:
    async def recorded() -> bool:
        return all([(await store.get(j)).remote_id is not None for j in ids])

    await faults.until(recorded, "the jobs to be in a batch", task)


def _total(batch: dict[str, Any]) -> int:
    counts = batch["request_counts"]
    return int(counts["total"]) if "total" in counts else sum(int(v) for v in counts.values())


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"max_pack": 60_000}, "max_pack"),
        ({"max_wait_s": 0}, "max_wait_s"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"max_wiat_s": 5}, "max_wiat_s"),
    ],
)
def test_bad_batch_config_names_the_field(given: dict[str, Any], field: str) -> None:
    data = {
        "redis_url": "redis://localhost:1",
        "backends": {"cheap": {"kind": "openai-batch", **given}},
        "queues": {"q": {"backend": "cheap"}},
    }
    with pytest.raises(ConfigError, match=rf"^backends\.cheap\.{field}"):
        parse(Settings, data)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_batch_the_provider_cancels_returns_its_unfinished_jobs(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    await batch_sim(sim, seconds=20, cancel_after=0.5)  # the provider stops the first batch mid-way
    ids = await enqueue(store, f"provider-cancel-{provider}", 3)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):

        async def created() -> bool:
            return len(await batches(sim, provider)) >= 1

        await faults.until(created, "the first batch", task)
        await batch_sim(sim)
        jobs = await until_state(store, ids, "succeeded", task, timeout=40)
    assert len(await batches(sim, provider)) == 2
    assert all(j.cost == pytest.approx(PRICE) for j in jobs)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_the_spend_cap_counts_the_batch_price(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """A cap of 2.5 batch prices lets 2 jobs go (at the interactive price, 2 x 0.005 would be over it): the rest
    are held until the next cap window."""
    await batch_sim(sim)
    ids = await enqueue(store, f"cap-{provider}", 4)
    cfg = settings(valkey_url, no_outputs, sim, provider, queue={"daily_spend_cap": PRICE * 2.5})
    async with worker(cfg) as (task, _):

        async def settled() -> bool:
            states = [(await store.get(j)).state.value for j in ids]
            return sorted(states) == ["held", "held", "succeeded", "succeeded"]

        await faults.until(settled, "2 jobs done and 2 held", task, timeout=30)
    done = [j for j in [await store.get(i) for i in ids] if j.state.value == "succeeded"]
    assert sum(j.cost or 0 for j in done) == pytest.approx(2 * PRICE)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_pack_closes_before_the_size_limit(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    provider: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The provider's byte limit made small (the real ones are 200 and 256 MB): a pack closes before a job would
    take it past the limit, so 4 jobs of ~1 kB each go out in packs of at most 2."""
    from offload.backends import batch

    monkeypatch.setitem(batch.LIMITS, provider, batch.BatchLimits(max_requests=1000, max_bytes=3000))
    await batch_sim(sim)
    specs = [
        JobSpec(input={"max_tokens": 16, "messages": [{"role": "user", "content": f"{i}" + "x" * 900}]})
        for i in range(4)
    ]
    ids = await store.enqueue_many("q", specs)
    async with worker(settings(valkey_url, no_outputs, sim, provider, max_wait_s=2)) as (task, _):
        await until_state(store, ids, "succeeded", task, timeout=40)
    sizes = sorted(_total(b) for b in await batches(sim, provider))
    assert sum(sizes) == 4 and max(sizes) <= 2


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_routed_queue_sends_to_its_batch_lane(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """`backends: [cheap, fast]`, route fallback: the batch lane first; its jobs take the packer's path."""
    await batch_sim(sim)
    data = settings_data(valkey_url, no_outputs, sim, provider)
    data["backends"]["fast"] = {**BACKENDS["http-job"], "base_url": sim, "api_key": "sim-key"}
    data["queues"]["q"] = {"backends": ["cheap", "fast"], "poll_timeout": 30}
    ids = await enqueue(store, f"routed-{provider}", 3)
    async with worker(Settings.model_validate(data)) as (task, _):
        jobs = await until_state(store, ids, "succeeded", task)
    assert {j.backend for j in jobs} == {"cheap"}
    assert len(await batches(sim, provider)) == 1


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_drain_hands_batched_jobs_back_and_the_next_worker_polls_their_batch(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """SIGTERM's drain (in process: `stop`) with jobs in a running batch: the worker ends within its grace, the
    leases go back with their remote ids, and the next worker polls the same batch: no second batch."""
    await batch_sim(sim, seconds=4)
    ids = await enqueue(store, f"drain-{provider}", 3)
    cfg = settings(valkey_url, no_outputs, sim, provider)
    async with worker(cfg, grace_s=0.5) as (task, _):
        await all_in_batch(store, ids, task)
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 15  # the drain did not wait for the batch
    left = [await store.get(j) for j in ids]
    assert all(j.state.value != "succeeded" and j.remote_id for j in left)
    async with worker(cfg) as (task, _):
        jobs = await until_state(store, ids, "succeeded", task, timeout=40)
    assert len(await batches(sim, provider)) == 1
    assert [j.remote_id for j in jobs] == [j.remote_id for j in left]


@contextlib.asynccontextmanager
async def worker_process(tmp_path: Path, data: dict[str, Any]) -> AsyncIterator[subprocess.Popen[bytes]]:
    """`offload worker` as a process on `data` (leases of 1 s, so a kill's run out soon); killed at the end."""
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(data))
    log = tmp_path / "worker.log"
    env = {**base_env(), "OFFLOAD_LEASE_MS": "1000"}
    proc = spawn([OFFLOAD, "worker", "--queue", "q", "--config", str(path)], env, tmp_path, log)
    try:
        deadline = time.monotonic() + 60
        while READY_LINE not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            await asyncio.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGKILL)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_worker_killed_inside_the_batch_create_leaves_jobs_that_are_adopted(
    valkey_url: str, sim: str, store: QueueStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, provider: str
) -> None:
    """`offload worker` as a process, SIGKILLed while its batch create is out (the simulator has created the
    batch and holds the answer 5 s). The next worker finds the jobs' intents open, finds the batch in the
    provider's listing and adopts it: the simulator sees exactly one batch."""
    family = "openai" if provider == "openai" else "anthropic"
    config = {
        "default": {"latency": LATENCY},
        "batches": {"seconds": 0.4},
        "families": {family: {"submit_latency": 5.0}},
    }
    await sim_call(sim, "POST", "/_sim/config", config)
    data = settings_data(valkey_url, {"kind": "local", "path": str(tmp_path / "results")}, sim, provider)
    async with worker_process(tmp_path, data) as proc:
        ids = await enqueue(store, f"killed-{provider}", 3)

        async def created() -> bool:
            return len(await batches(sim, provider)) == 1

        await faults.until(created, "the batch to be created (its answer held)")
        stop(proc, signal.SIGKILL)
    assert all([(await store.get(j)).remote_id is None for j in ids])  # killed before any line was recorded
    await batch_sim(sim)
    monkeypatch.setenv("OFFLOAD_LEASE_MS", "1000")
    async with worker(Settings.model_validate(data)) as (task, _):
        jobs = await until_state(store, ids, "succeeded", task, timeout=40)
    await assert_one_batch(sim, provider, jobs)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_worker_killed_while_its_batch_runs_leaves_jobs_polled_there(
    valkey_url: str, sim: str, store: QueueStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, provider: str
) -> None:
    """SIGKILL once every job's line is recorded (the batch runs 4 s): the next worker, once the leases ran out,
    polls the same batch by the jobs' remote ids (`<batch id>#<line>`), and creates none."""
    await batch_sim(sim, seconds=4)
    data = settings_data(valkey_url, {"kind": "local", "path": str(tmp_path / "results")}, sim, provider)
    async with worker_process(tmp_path, data) as proc:
        ids = await enqueue(store, f"killed-running-{provider}", 3)

        async def recorded() -> bool:
            return all([(await store.get(j)).remote_id is not None for j in ids])

        await faults.until(recorded, "the jobs' lines to be recorded")
        stop(proc, signal.SIGKILL)
    before = [(await store.get(j)).remote_id for j in ids]
    monkeypatch.setenv("OFFLOAD_LEASE_MS", "1000")
    async with worker(Settings.model_validate(data)) as (task, _):
        jobs = await until_state(store, ids, "succeeded", task, timeout=40)
    assert [j.remote_id for j in jobs] == before
    await assert_one_batch(sim, provider, jobs)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_batch_whose_every_job_is_cancelled_is_cancelled(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    provider: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every job of a running batch cancelled by the operator: the batch is cancelled at the provider (its lines
    come back canceled), and the jobs end cancelled long before the batch's 60 s would have run out."""
    monkeypatch.setenv("OFFLOAD_LEASE_MS", "3000")  # a heartbeat (which brings the cancels) every second
    await batch_sim(sim, seconds=60)
    ids = await enqueue(store, f"cancel-all-{provider}", 3)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):
        await all_in_batch(store, ids, task)
        for job_id in ids:
            await store.cancel(job_id)
        await until_state(store, ids, "cancelled", task, timeout=30)
    [listed] = await batches(sim, provider)
    assert listed.get("status", listed.get("processing_status")) in ("cancelled", "cancelling", "ended", "canceling")
    assert listed.get("cancelling_at") or listed.get("cancel_initiated_at")


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_job_the_provider_would_refuse_alone_fails_without_sinking_its_pack(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    provider: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hostile input: a request over the batch size limit by itself, or an input that is no request body (one
    such line fails a whole OpenAI batch), is dead with the reason; the jobs beside it go out in their batch."""
    from offload.backends import batch

    monkeypatch.setitem(batch.LIMITS, provider, batch.BatchLimits(max_requests=1000, max_bytes=3000))
    await batch_sim(sim)
    good = await enqueue(store, f"hostile-{provider}", 2)
    huge = {"max_tokens": 16, "messages": [{"role": "user", "content": "x" * 5000}]}
    bad, not_a_body = await store.enqueue_many("q", [JobSpec(input=huge), JobSpec(input=["a", "list"])])
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):
        await until_state(store, good, "succeeded", task)
        dead, other = await until_state(store, [bad, not_a_body], "dead", task)
    assert dead.error is not None and "batch size limit" in dead.error
    assert other.error is not None and "must be a JSON object" in other.error
    assert [_total(b) for b in await batches(sim, provider)] == [2]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_batched_jobs_do_not_hold_the_concurrency_slots(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """500 jobs on a queue of `concurrency: 2` go out in one batch: the claims are not held back by the slots, and
    no batched job ever takes one. (The pack closes at its 500th job: a wait of seconds would close it early on a
    loaded machine, whose claims of 500 jobs can take longer.)"""
    await batch_sim(sim, seconds=1)
    ids = await enqueue(store, f"many-{provider}", 500)
    cfg = settings(valkey_url, no_outputs, sim, provider, max_wait_s=120, max_pack=500, queue={"concurrency": 2})
    async with worker(cfg) as (task, w):
        await until_state(store, ids, "succeeded", task, timeout=120)
        assert w.peak_in_flight == 0
    assert [_total(b) for b in await batches(sim, provider)] == [500]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_max_in_flight_bounds_the_jobs_in_batches(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """`max_in_flight: 4`: at most 4 jobs of the worker are in packs and batches at once, so 10 jobs go out in
    batches of at most 4 (the rest wait for a place, leased ahead like any job)."""
    await batch_sim(sim, seconds=0.5)
    ids = await enqueue(store, f"bounded-{provider}", 10)
    cfg = settings(valkey_url, no_outputs, sim, provider, max_wait_s=0.5, max_in_flight=4)
    async with worker(cfg) as (task, _):
        await until_state(store, ids, "succeeded", task, timeout=60)
    sizes = [_total(b) for b in await batches(sim, provider)]
    assert sum(sizes) == 10 and max(sizes) <= 4, sizes


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_drain_hands_an_open_packs_jobs_back_unsent(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """SIGTERM (in process: `stop`) while jobs wait in an open pack (`max_wait_s: 60`): no batch is created, the
    jobs go back with their intents closed, and the next worker sends them as their first submission, not as a
    possible duplicate."""
    await batch_sim(sim)
    ids = await enqueue(store, f"open-pack-{provider}", 3)
    async with worker(settings(valkey_url, no_outputs, sim, provider, max_wait_s=60), grace_s=0.5) as (task, w):

        async def packed() -> bool:
            return sum(p.held for p in w.packers.values()) == 3

        await faults.until(packed, "the jobs to wait in a pack", task)
    assert await batches(sim, provider) == []
    back = [await store.get(j) for j in ids]
    assert all(j.state.value == "queued" and j.remote_id is None for j in back), back
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):
        jobs = await until_state(store, ids, "succeeded", task)
    assert all(j.possible_duplicates == 0 for j in jobs)
    await assert_one_batch(sim, provider, jobs)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_job_cancelled_in_an_open_pack_is_left_out_and_gives_its_cap_place_back(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    provider: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capped job begun into an open pack and cancelled before the pack closes: the batch goes out without it,
    it ends cancelled, and its place in the day is given back (it was counted at its begin, and never sent)."""
    monkeypatch.setenv("OFFLOAD_LEASE_MS", "3000")  # a heartbeat (which brings the cancels) every second
    await batch_sim(sim, seconds=0.5)
    ids = await enqueue(store, f"cancel-open-{provider}", 3)
    cfg = settings(valkey_url, no_outputs, sim, provider, max_wait_s=120, max_pack=4, queue={"daily_job_cap": 10})
    async with worker(cfg) as (task, w):

        async def packed() -> bool:
            return sum(p.held for p in w.packers.values()) == 3

        await faults.until(packed, "the jobs to wait in a pack", task)
        assert (await store.usage("q"))[1] == 3
        assert await store.cancel(ids[0]) == "requested"

        async def heard() -> bool:
            run = w.ctx.runs.get(ids[0])
            return run is not None and run.cancel

        await faults.until(heard, "the worker to hear the cancel", task)
        ids += await enqueue(store, f"cancel-open-{provider}-last", 1)  # the 4th member closes the pack
        await until_state(store, ids[:1], "cancelled", task)
        jobs = await until_state(store, ids[1:], "succeeded", task)
    await assert_one_batch(sim, provider, jobs)
    assert [_total(b) for b in await batches(sim, provider)] == [3]
    assert (await store.usage("q"))[1] == 3, "the job left out of its pack kept its place in the day"


@pytest.mark.parametrize(("provider", "then"), [("openai", "fixed"), ("anthropic", "fixed"), ("openai", "drained")])
async def test_a_pack_closed_while_the_store_may_evict_is_created_only_once_it_is_fixed(
    own_valkey: ValkeyServer,
    no_outputs: dict[str, Any],
    sim: str,
    provider: str,
    then: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jobs begun into an open pack, then the store switched to allkeys-lru before the pack closes: the pack's
    batch (the payment) is not created while the store may evict its intents. Fixed (noeviction again), the batch
    goes out, once, with every member; drained instead, the jobs are handed back unsent and nothing is paid."""
    monkeypatch.setenv("OFFLOAD_STORE_CHECK_S", "0.2")
    await batch_sim(sim, seconds=0.5)
    redis = await connect(own_valkey.url)
    store = QueueStore(redis)
    ids = await enqueue(store, f"evict-pack-{provider}-{then}", 3)
    cfg = settings(own_valkey.url, no_outputs, sim, provider, max_wait_s=4, max_pack=10)
    try:
        async with worker(cfg) as (task, w):
            await _a_closed_pack_waiting_on_the_policy(own_valkey, w, task, sim, provider)
            if then == "fixed":
                with own_valkey.client() as c:
                    c.config_set("maxmemory-policy", "noeviction")
                jobs = await until_state(store, ids, "succeeded", task)
        # (a drain: the block's end stops the worker, which must not wait on the policy to do so)
        if then == "drained":
            back = [await store.get(j) for j in ids]
            assert all(j.state.value == "queued" and j.attempts == 0 for j in back), back
            assert await batches(sim, provider) == []
            return
        await assert_one_batch(sim, provider, jobs)
        assert [_total(b) for b in await batches(sim, provider)] == [3]
    finally:
        await redis.aclose()


async def _a_closed_pack_waiting_on_the_policy(
    valkey: ValkeyServer, w: Worker, task: asyncio.Task[Any], sim: str, provider: str
) -> None:
    async def packed() -> bool:
        return sum(p.held for p in w.packers.values()) == 3

    await faults.until(packed, "the jobs to wait in a pack", task)
    with valkey.client() as c:
        c.config_set("maxmemory-policy", "allkeys-lru")

    async def paused() -> bool:
        return not w.policy.safe

    await faults.until(paused, "the worker to read the evicting policy", task)
    assert all(p.open is not None for p in w.packers.values()), "the pack closed before the policy was read"

    async def closed() -> bool:
        return all(p.open is None for p in w.packers.values())

    await faults.until(closed, "the pack to close at its max_wait_s", task)
    watched = time.monotonic() + 2.0  # 10 policy reads with the pack closed and waiting
    while time.monotonic() < watched:
        assert await batches(sim, provider) == [], "a batch created while the store may evict"
        await asyncio.sleep(0.2)


async def test_a_job_whose_place_frees_while_the_store_may_evict_opens_no_intent_until_it_is_fixed(
    own_valkey: ValkeyServer, no_outputs: dict[str, Any], sim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pack's own begin check: with room for 2 jobs (`max_in_flight`), 4 claimed; 2 go out in a batch while the
    other 2 wait for a place. The store turns to allkeys-lru while the batch runs: its 2 jobs finish (paid for
    already), and the 2 that get their places then open no submit intent (a write of new paid work on a store that
    may evict) and join no batch until the policy is noeviction again; then they go out, once each."""
    monkeypatch.setenv("OFFLOAD_STORE_CHECK_S", "0.2")
    await batch_sim(sim, seconds=3)
    redis = await connect(own_valkey.url)
    store = QueueStore(redis)
    first, later = await enqueue(store, "evict-place", 4), []
    cfg = settings(own_valkey.url, no_outputs, sim, "openai", max_wait_s=0.2, max_pack=2, max_in_flight=2)
    try:
        async with worker(cfg) as (task, w):

            async def one_batch_out() -> bool:
                return len(await batches(sim, "openai")) == 1

            await faults.until(one_batch_out, "the first batch", task)
            (batch,) = await batches(sim, "openai")
            out = [j for j in first if (await store.get(j)).remote_id is not None]
            later = [j for j in first if j not in out]
            assert len(out) == 2 and batch["status"] != "completed", batch  # the other 2 wait for a place
            with own_valkey.client() as c:
                c.config_set("maxmemory-policy", "allkeys-lru")

            async def paused() -> bool:
                return not w.policy.safe

            await faults.until(paused, "the worker to read the evicting policy", task)
            await until_state(store, out, "succeeded", task)  # their places free now
            watched = time.monotonic() + 2.0  # 10 policy reads with the 2 jobs at their places
            while time.monotonic() < watched:
                opened = [await redis.hget(keyspace.job("q", j), "sub_open") for j in later]
                assert opened == [None, None], f"an intent opened while the store may evict: {opened}"
                assert len(await batches(sim, "openai")) == 1, "a batch created while the store may evict"
                await asyncio.sleep(0.2)
            with own_valkey.client() as c:
                c.config_set("maxmemory-policy", "noeviction")
            jobs = await until_state(store, later, "succeeded", task)
        listed = await batches(sim, "openai")
        assert len(listed) == 2 and sorted(_total(b) for b in listed) == [2, 2], listed
        assert all(j.attempts == 1 for j in jobs)
    finally:
        await redis.aclose()


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_line_the_provider_failed_is_retried_in_a_later_batch(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """A line errored with a 5xx (OpenAI) or `api_error` (Anthropic) is the provider's failure, not the input's:
    its job is retried (an attempt) and completes in the next batch."""
    await batch_sim(sim, fail_rate=1.0)
    ids = await enqueue(store, f"line-5xx-{provider}", 2, max_attempts=5)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):

        async def retried() -> bool:
            return all([(await store.get(j)).attempts >= 1 and (await store.get(j)).error is not None for j in ids])

        await faults.until(retried, "the first batch's lines to fail", task)
        await batch_sim(sim)
        jobs = await until_state(store, ids, "succeeded", task, timeout=40)
    assert all(j.attempts >= 2 for j in jobs), [(j.attempts, j.error) for j in jobs]
    assert len(await batches(sim, provider)) >= 2


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_refused_create_fails_its_jobs_with_their_intents_closed(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """The provider refuses the create (a wrong key: 401): no batch exists, so the jobs are dead with the reason,
    their intents closed (not possible duplicates) and nothing spent."""
    await sim_call(sim, "POST", "/_sim/config", {"api_key": "another-key", "batches": {"seconds": 0.4}})
    ids = await enqueue(store, f"refused-{provider}", 2)
    cfg = settings(valkey_url, no_outputs, sim, provider, queue={"daily_spend_cap": 1.0})
    async with worker(cfg) as (task, _):
        jobs = await until_state(store, ids, "dead", task)
    assert all(j.error and "batch create" in j.error and j.attempts == 1 for j in jobs), [j.error for j in jobs]
    assert all(j.possible_duplicates == 0 and not j.cost for j in jobs)
    assert not any("sim-key" in (j.error or "") for j in jobs)  # the credential never reaches a record
    await batch_sim(sim)
    assert await batches(sim, provider) == []


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_throttled_create_is_sent_again_not_adopted(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """A 429 to the create says no batch was made: the jobs are retried as a new pack (no listing needed), and
    complete in the one batch the provider made."""
    await batch_sim(sim)
    family = "openai" if provider == "openai" else "anthropic"
    await sim_call(sim, "POST", "/_sim/outage", {"family": family, "mode": "429"})
    ids = await enqueue(store, f"throttled-{provider}", 2, max_attempts=5)
    async with worker(settings(valkey_url, no_outputs, sim, provider)) as (task, _):

        async def refused() -> bool:
            return all([(await store.get(j)).error is not None for j in ids])

        await faults.until(refused, "the create to be answered 429", task)
        await sim_call(sim, "POST", "/_sim/outage", {"family": family, "mode": None})
        jobs = await until_state(store, ids, "succeeded", task, timeout=40)
    assert all(j.possible_duplicates == 0 for j in jobs)
    await assert_one_batch(sim, provider, jobs)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_the_router_sends_a_job_to_the_batch_lane_only_when_its_deadline_allows(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, provider: str
) -> None:
    """`route: cheapest` over [cheap (a batch lane, half price), fast (per job)]: a job due in 2 h goes to the
    batch (its turnaround, max_wait_s + expected_duration_s = 1 h, meets the deadline), a job due in 60 s to the
    per-job backend (the batch would be late)."""
    await batch_sim(sim)
    data = settings_data(valkey_url, no_outputs, sim, provider)
    data["backends"]["fast"] = {
        **BACKENDS["http-job"],
        "base_url": sim,
        "api_key": "sim-key",
        "price_per_job": 2 * PRICE,
        "expected_run_s": 1,
    }
    data["queues"]["q"] = {"backends": ["fast", "cheap"], "route": "cheapest", "poll_timeout": 30}
    (late,) = await enqueue(store, f"due-later-{provider}", 1, deadline_in=7200)
    (soon,) = await enqueue(store, f"due-soon-{provider}", 1, deadline_in=60)
    async with worker(Settings.model_validate(data)) as (task, _):
        jobs = await until_state(store, [late, soon], "succeeded", task)
    assert [j.backend for j in jobs] == ["cheap", "fast"]
    assert [j.cost for j in jobs] == [pytest.approx(PRICE), pytest.approx(2 * PRICE)]
