"""The dispatch worker's remote slots: `concurrency` bounds the jobs at the provider, a few more are
claimed ahead so a freed slot is filled without waiting for a claim, the claimed-ahead jobs go back at once on a
drain, and a heartbeat that races an acknowledgement does not take the finished job for a lost lease.

Real Valkey, the real simulator over HTTP (fixtures and helpers from test_worker_faults).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
import test_worker_faults as faults
from test_worker_faults import (
    configure,
    enqueue,
    fault_count,
    make_settings,
    remote_jobs,
    stats,
    until,
    until_state,
    worker,
)

from bench import web
from offload.eventloop import within
from offload.queue import keyspace
from offload.queue.replies import Begun, Checkpointed, Verdict
from offload.queue.store import QueueStore
from offload.worker.dispatch import Worker

BUCKET, sim, no_outputs, bucket, store = faults.BUCKET, faults.sim, faults.no_outputs, faults.bucket, faults.store
_quick_backoff, _clean_sim = faults._quick_backoff, faults._clean_sim


async def counts(store: QueueStore) -> dict[str, int]:
    return (await store.stats("q")).counts


async def test_concurrency_bounds_the_provider_and_a_few_jobs_wait_claimed_ahead(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """2 slots, 2 claimed ahead, 8 jobs of 1 s: never more than 2 jobs at the provider (the simulator's own
    record of when each remote job ran), while 4 or more are leased: the 2 ahead start the moment a slot frees,
    and jobs past their remote work (the ack) do not hold back a claim. Every job runs once."""
    await configure(sim, latency=1.0)
    jobs = await enqueue(store, "slots", 8)
    peak_leased = 0
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job", concurrency=2), prefetch=2) as (task, w):

        async def all_done() -> bool:
            nonlocal peak_leased
            c = await counts(store)
            peak_leased = max(peak_leased, c["active"] + c["submitted"])
            # 2 slots + 2 ahead, plus up to 2 past their remote work (output, ack)
            assert c["active"] + c["submitted"] <= 6, c
            return c["succeeded"] == len(jobs)

        await until(all_done, "every job to succeed", task, timeout=30)
        assert w.peak_in_flight == 2
    assert peak_leased >= 4, "no job was claimed ahead of a free slot"
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {input_id: 1 for _, input_id in jobs}
    spans = [r for _, input_id in jobs for r in await remote_jobs(sim, input_id)]
    assert len(spans) == len(jobs)
    assert _most_at_once([(r["created"], r["created"] + 1.0) for r in spans]) <= 2, spans


def _most_at_once(spans: Sequence[tuple[float, float]]) -> int:
    """The most intervals that overlap at one instant (an end before a start at the same instant)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


async def test_the_stop_itself_hands_back_the_jobs_ahead_without_the_grace_period(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The real drain: `stop` set with 2 jobs at the provider (3 s) and 2 ahead, grace 20 s. The jobs at the
    provider finish inside the grace and succeed; the 2 ahead were handed back at the stop: unsubmitted."""
    await configure(sim, latency=3.0)
    jobs = await enqueue(store, "stop", 4)
    settings = make_settings(valkey_url, no_outputs, sim, "http-job", concurrency=2)
    async with worker(settings, grace_s=20.0, prefetch=2) as (task, _):

        async def two_and_two() -> bool:
            c = await counts(store)
            return c["submitted"] == 2 and c["active"] == 2

        await until(two_and_two, "2 jobs submitted and 2 claimed ahead", task)
        ahead = [j for j, _ in jobs if (await store.get(j)).state == "active"]
        assert await _open_intents(store, jobs) == 0, "an asynchronous API's job began before its slot"
    states = {j: (await store.get(j)).state for j, _ in jobs}
    assert sorted(states.values()) == ["queued", "queued", "succeeded", "succeeded"], states
    assert all(states[j] == "queued" for j in ahead), states
    assert sum([len(await remote_jobs(sim, i)) for _, i in jobs]) == 2


async def test_a_drain_closes_the_intents_of_synchronous_jobs_begun_ahead_of_a_slot(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """A synchronous API (the submit is the whole job): a job claimed ahead begins before it waits for a slot.
    `stop` with 2 answers 3 s out and 2 begun behind them: the 2 at the provider succeed inside the grace, the 2
    ahead go back unsent with their intents closed, so the next owner sends them as the same run, uncounted."""
    await configure(sim, latency=3.0)
    jobs = await enqueue(store, "stop-sync", 4)
    settings = make_settings(valkey_url, no_outputs, sim, "openai", concurrency=2)
    async with worker(settings, grace_s=20.0, prefetch=2) as (task, w):

        async def two_out_two_begun() -> bool:
            return w.in_flight == 2 and await _open_intents(store, jobs) == 4

        await until(two_out_two_begun, "2 jobs at the provider and 2 begun, waiting for a slot", task)
        ahead = [j for j in w.tasks if j not in _submitting(w)]
        assert len(ahead) == 2, (list(w.tasks), _submitting(w))
    states = {j: (await store.get(j)).state for j, _ in jobs}
    assert sorted(states.values()) == ["queued", "queued", "succeeded", "succeeded"], states
    assert all(states[j] == "queued" for j in ahead), states
    assert sum([len(await remote_jobs(sim, i)) for _, i in jobs]) == 2
    redelivered = await store.claim("q", "next-owner", 2)
    assert sorted(j.id for j in redelivered) == sorted(ahead)
    assert [j.intent_open for j in redelivered] == [False, False], "a drained, unsent intent was left open"
    verdicts = await store.begin_many("q", [(j.id, j.token, 0.0) for j in redelivered])
    assert verdicts == ["OK:1", "OK:1"], "the same run again, not a possible duplicate"


def _submitting(w: Worker) -> set[str]:
    """The jobs whose submit call is out."""
    return {run.job.id for run in w.ctx.runs.all() if run.calling()}


async def _open_intents(store: QueueStore, jobs: Sequence[tuple[str, str]]) -> int:
    return sum([await store.redis.hget(keyspace.job("q", j), "sub_open") == "1" for j, _ in jobs])


async def test_a_cancel_heard_while_a_begun_job_waits_for_its_slot_is_not_submitted(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """A synchronous API, 1 slot, 1 ahead: the job ahead has begun (its intent is open) and waits for the slot
    held by a 3 s call. It is cancelled meanwhile; the worker hears it from a heartbeat and, once the job has its
    slot, checks it right before the call: the job ends cancelled and the provider never sees it. Under a daily
    job cap, its place in the day is given back (it was counted at its begin)."""
    await configure(sim, latency=3.0)
    jobs = await enqueue(store, "cancel-ahead", 2)
    inputs = dict(jobs)
    settings = make_settings(valkey_url, no_outputs, sim, "openai", concurrency=1, daily_job_cap=10)
    async with worker(settings, prefetch=1, lease_ms=1500) as (task, w):

        async def one_out_one_begun() -> bool:
            return len(_submitting(w)) == 1 and await _open_intents(store, jobs) == 2

        await until(one_out_one_begun, "one job at the provider and one begun behind it", task)
        [first] = _submitting(w)
        [second] = [j for j in inputs if j != first]
        assert await store.cancel(second) == "requested"
        await until_state(store, [second], "cancelled", task)
        await until_state(store, [first], "succeeded", task)
    assert await remote_jobs(sim, inputs[second]) == [], "a cancelled job was submitted"
    assert len(await remote_jobs(sim, inputs[first])) == 1
    assert (await store.usage("q"))[1] == 1, "the job cancelled before its call kept its place in the day"


async def test_a_worker_idle_for_more_than_a_thousand_empty_claims_goes_on(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim loop backs off over its empty claims, counted without end: at the 1,025th (8.5 idle minutes at
    the default 0.5 s cap) the backoff overflowed a float and the worker died of an OverflowError. With a 1 ms
    cap the rounds come fast: past 1,100 of them the worker still serves, and runs the job enqueued then."""
    claims = 0
    real = Worker._claim

    async def counted(self: Worker, batch: int) -> Any:
        nonlocal claims
        claims += 1
        return await real(self, batch)

    monkeypatch.setattr(Worker, "_claim", counted)
    await configure(sim, latency=0.05)
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job"), idle_poll_max=0.001) as (task, _):

        async def many_rounds() -> bool:
            return claims > 1100

        await until(many_rounds, "1,100 empty claims", task, timeout=60)
        assert not task.done()
        jobs = await enqueue(store, "idle", 1)
        await until_state(store, [j for j, _ in jobs], "succeeded", task)


async def test_a_heartbeat_racing_an_ack_is_no_lost_lease(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A heartbeat that runs after an ack went through, but before the job's task has heard the reply, no longer
    finds the lease. That is the ack's doing, not another worker's: no "lease lost" warning, the task is not
    cancelled, the job succeeds once. (Before: a warning per job, and a cancel, at every such race.)"""
    caplog.set_level(logging.INFO, logger="offload")
    await configure(sim, latency=0.1)
    [(job_id, input_id)] = await enqueue(store, "race")
    holder: list[Worker] = []
    raced: list[bool] = []
    real = QueueStore.complete_many

    async def complete_then_beat(self: QueueStore, queue: str, items: Any) -> list[Verdict]:
        codes = await real(self, queue, items)
        if holder and not raced:
            await holder[0].leases.beat()  # the heartbeat lands exactly in the window
            raced.append(True)
        return codes

    monkeypatch.setattr(QueueStore, "complete_many", complete_then_beat)
    async with worker(make_settings(valkey_url, no_outputs, sim, "http-job")) as (task, w):
        holder.append(w)
        [job] = await until_state(store, [job_id], "succeeded", task)
        await until(lambda: _no_tasks(w), "the task to end", task)
    assert raced, "the heartbeat never ran inside the window"
    assert "lost" not in caplog.text, caplog.text
    assert "unexpected error" not in caplog.text
    assert job.attempts == 1
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}


async def _no_tasks(w: Worker) -> bool:
    return not w.tasks


# -- a synchronous API's answer: recorded by the ack -----------------------------------------------------------


async def test_a_synchronous_answer_is_recorded_by_its_ack_alone(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chat completions answer the submit with the result: the worker writes the job twice (the submit intent,
    then the ack that also records the run), not three times; the record still names the remote run."""
    checkpoints: list[int] = []
    real = QueueStore.checkpoint_many

    async def counted(self: QueueStore, queue: str, items: Any) -> list[Checkpointed]:
        checkpoints.append(len(items))
        return await real(self, queue, items)

    monkeypatch.setattr(QueueStore, "checkpoint_many", counted)
    jobs = await enqueue(store, "sync", 5)
    async with worker(make_settings(valkey_url, no_outputs, sim, "openai")) as (task, _):
        done = await until_state(store, [j for j, _ in jobs], "succeeded", task)
    assert checkpoints == [], "a synchronous answer was checkpointed before its ack"
    for job in done:
        assert job.backend == "gpu" and job.remote_id, job
        assert job.submission == 1 and job.possible_duplicates == 0 and job.attempts == 1, job
    assert (await stats(sim))["submissions_by_input_id"] == {i: 1 for _, i in jobs}


async def test_a_synchronous_answer_lost_to_a_worker_error_closes_its_intent(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer is in, then storing it fails with a bug (not a storage error). The attempt fails with the
    provider's answer known and the intent closed: the next attempt is the same run under the same
    Idempotency-Key, which the provider answers from its replay cache (paid once), is not counted a possible
    duplicate, and no attempt is wasted polling a synchronous call that cannot be polled. (Before: the run was
    checkpointed, the next attempt polled it (NotFound), a third submitted under a new key and paid again.)"""
    import offload.worker.run as run_module
    from offload.storage import store_output as real

    calls = [0]

    async def broken_once(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a bug in the output path (injected)")
        return await real(*args, **kwargs)

    monkeypatch.setattr(run_module, "store_output", broken_once)
    [(job_id, input_id)] = await enqueue(store, "sync-bug")
    async with worker(make_settings(valkey_url, no_outputs, sim, "openai")) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task)
    assert calls[0] == 2
    assert job.attempts == 2 and job.submission == 1 and job.possible_duplicates == 0, job
    seen = await stats(sim)
    assert seen["submissions_by_input_id"] == {input_id: 1}, "the answer already paid for was paid again"
    assert seen["idempotent_replays"] == {"openai": 1}, seen


async def test_an_asynchronous_api_under_429s_with_more_jobs_ahead_than_the_submit_gate_does_not_stall(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """An asynchronous API takes the slot before the submit gate and its begin: jobs holding slots wait for the
    gate again after each 429, so a job holding the gate must never wait for a slot (with the begin before the
    slot, the 2 jobs ahead took the one gate permit and waited for a slot, while the 2 slot holders waited for
    the gate: nothing moved again). 2 slots, 2 ahead, a gate of 1, every submit answered 429 for a while: once the
    429s stop, every job is submitted once and succeeds."""
    await configure(sim, faults_on=["submit"], rate_429=1.0, retry_after_header=True, retry_after_seconds=0.2)
    jobs = await enqueue(store, "gate", 4)
    settings = make_settings(valkey_url, no_outputs, sim, "http-job", concurrency=2, submit_concurrency=1)
    async with worker(settings, prefetch=2) as (task, w):
        assert w.submitter.gate is not None and w.submitter.gate._value == 1

        async def throttled_and_ahead() -> bool:
            c = await counts(store)
            return await fault_count(sim, "jobs.submit", "429") >= 4 and c["active"] == 4

        await until(throttled_and_ahead, "4 jobs leased and their submits answered 429", task)
        await configure(sim)
        await until_state(store, [j for j, _ in jobs], "succeeded", task, timeout=30)
        assert w.peak_in_flight == 2
    assert (await stats(sim))["submissions_by_input_id"] == {i: 1 for _, i in jobs}


@pytest.mark.parametrize("rate_limit", [None, "500/s"])
async def test_a_synchronous_worker_begins_fresh_jobs_in_their_claim_unless_a_rate_limit_comes_first(
    valkey_url: str,
    no_outputs: dict[str, Any],
    sim: str,
    store: QueueStore,
    monkeypatch: pytest.MonkeyPatch,
    rate_limit: str | None,
) -> None:
    """A synchronous API (no webhooks) without a rate limit or caps begins each job the moment it has it, so
    the claim opens the intents (claim.lua's `begin`) and the worker sends no begin script for a first try: a
    round trip less per job. With a rate limit the intent must wait for the limit, so each job is begun by the
    begin script, after it. Either way every job is sent once, as submission 1, and nothing is counted."""
    begun: list[str] = []
    real = QueueStore.begin_many

    async def counting(self: QueueStore, queue: str, items: Any, **kw: Any) -> list[Begun]:
        begun.extend(item[0] for item in items)
        return await real(self, queue, items, **kw)

    monkeypatch.setattr(QueueStore, "begin_many", counting)
    await configure(sim, latency=0.05)
    jobs = await enqueue(store, "sync-begin", 12)
    settings = make_settings(valkey_url, no_outputs, sim, "openai", concurrency=3)
    if rate_limit is not None:
        backend = settings.backends["gpu"].model_copy(update={"rate_limit": rate_limit})
        settings = settings.model_copy(update={"backends": {"gpu": backend}})
    async with worker(settings, prefetch=3) as (task, _):

        async def all_done() -> bool:
            return (await counts(store))["succeeded"] == len(jobs)

        await until(all_done, "every job succeeded", task)
    ids = [j for j, _ in jobs]
    assert sorted(begun) == (sorted(ids) if rate_limit else []), begun
    records = [await store.get(j) for j in ids]
    assert {(r.submission, r.possible_duplicates) for r in records} == {(1, 0)}
    assert [len(await remote_jobs(sim, i)) for _, i in jobs] == [1] * len(jobs)
    assert await store.possible_duplicates("q") == {}


async def test_the_slot_pool_serves_in_order_and_never_loses_a_slot_to_a_cancelled_waiter() -> None:
    """SlotPool: first come first served; a waiter cancelled while waiting takes nothing, and one cancelled
    after a slot was handed to it (before it resumed) passes that slot on; the count of free slots ends where it
    began once every holder gave its slot back."""
    import asyncio

    from offload.worker.slots import SlotPool

    pool = SlotPool(1)
    assert pool.try_take() and not pool.try_take()
    order: list[str] = []

    async def wait_for(name: str) -> None:
        await pool.acquire()
        order.append(name)

    a, b, c, d = (asyncio.create_task(wait_for(n)) for n in "abcd")
    await asyncio.sleep(0)  # all four queued behind the taken slot
    b.cancel()  # cancelled while waiting
    await asyncio.gather(b, return_exceptions=True)
    pool.release()  # handed to a
    await asyncio.sleep(0)
    assert order == ["a"]
    pool.release()  # a gives it back: b was cancelled, so c gets it
    c.cancel()  # ... and c is cancelled before it resumes: the slot goes on to d
    await within(asyncio.gather(a, c, d, return_exceptions=True), 5)  # a lost slot: d never runs
    assert order == ["a", "d"] and c.cancelled()
    pool.release()  # d gives it back: nobody waits, the slot is free again
    assert pool.try_take() and not pool.try_take()


async def test_a_resend_answered_409_in_progress_waits_for_the_first_call_without_spending_attempts(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """A synchronous call (3 s) is still being served when the job's next owner resends it under the same
    Idempotency-Key, as after a SIGKILL inside the call (here the first call is sent by the test, under the key
    the worker will use). A provider that honours the key answers 409 "being processed" until the first call
    ends, then replays its answer. The worker must wait for that inside its attempt: before, each 409 failed the
    attempt (Transient) and a job with max_attempts=2 went dead on the second 409 while its paid run was still
    finishing (in the --quick --backend openai chaos run, one kill cost a job 3 attempts this way)."""
    await configure(sim, latency=3.0)
    [(job_id, input_id)] = await enqueue(store, "busy", 1, max_attempts=2)
    body = {**faults.job_input(input_id), "model": faults.BACKENDS["openai"]["model"]}
    headers = {"Authorization": "Bearer sim-key", "Idempotency-Key": f"{job_id}.1"}
    headers["Content-Type"] = "application/json"
    async with web.async_client(base_url=sim, timeout=30) as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", content=orjson.dumps(body), headers=headers))
        await until(lambda: _served(sim), "the first call to be held")
        async with worker(make_settings(valkey_url, no_outputs, sim, "openai")) as (task, _):
            [job] = await until_state(store, [job_id], "succeeded", task, timeout=30)
        answer = (await first).json()
    assert job.attempts == 1 and job.remote_id == answer["id"], job
    assert await fault_count(sim, "openai.chat", "idempotency_conflict") >= 1, "the resend never met the busy key"
    assert (await stats(sim))["submissions_by_input_id"] == {input_id: 1}, "paid twice"


async def _served(sim: str) -> bool:
    """The simulator has created the remote job of the test's first call (it holds the request meanwhile)."""
    return bool(await remote_jobs(sim, "busy-0"))
