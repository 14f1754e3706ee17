"""Issue 39, item 4 in the route: a job's deadline and max_cost choose among a routed queue's backends (worker/
job_limits.py), end to end through the dispatch worker, the simulator over HTTP and real Valkey. `a` is the
tutorial's job API, fast and dear; `b` is RunPod, cheap and (by its `expected_run_s`, or its simulated queue
delay) slow.

- a deadline with time to spare goes to the cheap slow `b`; a tight one to the dear fast `a`; none in time: the
  one expected to finish first, and the record says so (`late` in the metrics);
- max_cost skips a backend whose price model may cost more (the route's first), and fails the job unsent only
  when no backend fits, naming each one's price;
- the queue delay RunPod reports (`delayTime`) is measured into `b`'s health and moves the next tight job to `a`;
- a worker whose wall clock is an hour ahead routes as one on the true clock (the store's clock, not its own).

Before this change the deadline and max_cost did not take part in the route: every job below went to `a` (the
fallback's first) or, with max_cost, failed at once although `b` fitted.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_worker_faults as faults
import yaml
from support.eventually import eventually
from test_routing import _healthy, by_family, families, routed, routed_data, routed_events, worker_process
from test_worker_crash import base_env, stop
from test_worker_faults import job_input, stats, until_state, worker

from bench.chaos.faketime import ClockFile
from offload.models import Job
from offload.queue import keyspace
from offload.queue.backend_limits import route_counters
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

BUCKET, sim, no_outputs, store = faults.BUCKET, faults.sim, faults.no_outputs, faults.store
_quick_backoff, _clean_sim = faults._quick_backoff, faults._clean_sim
__all__ = ["_healthy"]  # (the autouse fixture, shared with test_routing)

FAST_DEAR = {"price_per_job": 0.05, "expected_run_s": 0.5}
SLOW_CHEAP = {"price_per_job": 0.01, "expected_run_s": 30.0}


async def enqueue(store: QueueStore, name: str, **limits: Any) -> str:
    [job_id] = await store.enqueue_many("q", [JobSpec(input=job_input(name), max_attempts=3, **limits)])
    return job_id


async def test_a_deadline_with_time_to_spare_goes_to_the_cheaper_slower_backend(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    settings = routed(valkey_url, no_outputs, sim, a=FAST_DEAR, b=SLOW_CHEAP)
    job_id = await enqueue(store, "deadline-spare", deadline_in=600)
    async with worker(settings) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task)
    assert (job.backend, job.cost) == ("b", 0.01)
    assert job.routed == "deadline: b ~30s in time, cheapest", job.routed
    assert await by_family(sim) == {"a": 0, "b": 1}
    assert (await route_counters(store.redis, "b")).get("deadline") == 1
    [event] = await routed_events(store)
    assert (event["backend"], event["why"]) == ("b", "deadline: b ~30s in time, cheapest")


async def test_a_tight_deadline_goes_to_the_fast_dear_backend_and_no_deadline_to_the_first(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """`b` is expected to take 30 s: a job that must be done in 10 goes to `a`, the only one in time, although
    `b` is cheaper. The route is fallback with `b` first: a job without a deadline still goes to `b`."""
    settings = routed(valkey_url, no_outputs, sim, a=FAST_DEAR, b=SLOW_CHEAP)
    settings.queues["q"].backends = ["b", "a"]
    tight = await enqueue(store, "deadline-tight", deadline_in=10)
    async with worker(settings) as (task, _):
        [tight_job] = await until_state(store, [tight], "succeeded", task)
        free = await enqueue(store, "deadline-none")  # (after: `b`'s run, once measured, would be in time too)
        [free_job] = await until_state(store, [free], "succeeded", task)
    assert (tight_job.backend, tight_job.cost) == ("a", 0.05)
    assert tight_job.routed == "deadline: a ~0.5s in time, cheapest", tight_job.routed
    assert (free_job.backend, free_job.routed) == ("b", "fallback: sent to b")


async def test_with_none_in_time_the_job_goes_to_the_soonest_and_says_so(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """Both are expected to take longer than the 5 s left: the job goes to `a` (expected 20 s, sooner than `b`'s
    60 s, though dearer); it still starts before its deadline, so it runs, and its record, events and metrics say
    that no backend was expected in time."""
    a = {"price_per_job": 0.05, "expected_run_s": 20.0}
    b = {"price_per_job": 0.01, "expected_run_s": 60.0}
    settings = routed(valkey_url, no_outputs, sim, a=a, b=b, route="cheapest")
    job_id = await enqueue(store, "deadline-late", deadline_in=5)
    async with worker(settings) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task)
    assert job.backend == "a" and job.error is None
    assert job.routed is not None and job.routed.startswith("deadline: none expected in time (~"), job.routed
    assert job.routed.endswith("left), a ~20s, the soonest"), job.routed
    assert (await route_counters(store.redis, "a")).get("late") == 1
    assert [e["why"] for e in await routed_events(store)] == [job.routed]


async def test_max_cost_skips_a_backend_that_may_cost_more(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """`a`, the fallback's first, may cost $0.05: a job allowing $0.02 goes to `b` ($0.01), where it runs (before:
    it failed `over max_cost` at once); a job allowing more goes to `a` as usual."""
    settings = routed(valkey_url, no_outputs, sim, a={"price_per_job": 0.05}, b={"price_per_job": 0.01})
    bounded = await enqueue(store, "budget-bounded", max_cost=0.02)
    ample = await enqueue(store, "budget-ample", max_cost=0.05)
    async with worker(settings) as (task, _):
        bounded_job, ample_job = await until_state(store, [bounded, ample], "succeeded", task)
    assert (bounded_job.backend, bounded_job.cost) == ("b", 0.01)
    assert bounded_job.routed == "fallback: sent to b; max_cost $0.02: a may cost more", bounded_job.routed
    assert (ample_job.backend, ample_job.routed) == ("a", "fallback: sent to a")
    assert (await route_counters(store.redis, "b")).get("max_cost") == 1


async def test_a_job_no_backend_fits_fails_unsent_naming_each_price(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """`b` priced per second may cost its price over the whole poll_timeout (30 s): $0.03."""
    settings = routed(valkey_url, no_outputs, sim, a={"price_per_job": 0.05}, b={"price_per_second": 0.001})
    job_id = await enqueue(store, "budget-none", max_cost=0.02)
    async with worker(settings) as (task, _):
        [job] = await until_state(store, [job_id], "dead", task)
    assert job.error == (
        "over max_cost: every backend may cost more than the job's max_cost $0.02 (a $0.05, b $0.03)"
    ), job.error
    assert job.attempts == 1 and job.remote_id is None and job.cost is None
    assert await by_family(sim) == {"a": 0, "b": 0}
    assert (await store.stats("q")).totals["over_max_cost"] == 1


async def test_the_measured_queue_delay_moves_a_tight_deadline_to_the_faster_backend(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The simulator queues `b`'s jobs 6 s (RunPod reports it as `delayTime`). Before any measurement `b` is
    expected to take its `expected_run_s` (0.5 s): a job due in 4 s goes there, cheapest in time, and takes 6 s.
    Its queue delay is measured into `b`'s health, so the next job due in 4 s goes to `a`."""
    await families(sim, b={"queue_delay": 6.0, "latency": 0.2})
    prior = {"expected_run_s": 0.5}
    settings = routed(
        valkey_url, no_outputs, sim, a={"price_per_job": 0.05, **prior}, b={"price_per_job": 0.01, **prior}
    )
    first = await enqueue(store, "delay-first", deadline_in=4)
    async with worker(settings) as (task, _):
        [job] = await until_state(store, [first], "succeeded", task, timeout=40)
        assert (job.backend, job.routed) == ("b", "deadline: b ~0.5s in time, cheapest")
        queued_ms = int(await store.redis.hget(keyspace.backend_health("b"), "queue_ms") or 0)
        assert 5_500 <= queued_ms <= 7_000, queued_ms
        second = await enqueue(store, "delay-second", deadline_in=4)
        [job] = await until_state(store, [second], "succeeded", task)
    assert job.backend == "a", job.routed
    assert job.routed == "deadline: a ~0.5s in time, cheapest", job.routed
    assert await by_family(sim) == {"a": 1, "b": 1}


async def test_a_worker_whose_clock_is_an_hour_ahead_routes_by_the_stores_clock(
    valkey_url: str, sim: str, store: QueueStore, tmp_path: Path
) -> None:
    """`offload worker` as a process under libfaketime, its wall clock an hour ahead. Read by that clock, every
    deadline below is past: both jobs would go to the soonest backend, `late`. By the store's clock the first
    (due in 10 s) goes to `a`, the only one in time, the second (due in 10 minutes) to the cheaper `b`."""
    storage = {"kind": "local", "path": str(tmp_path / "results")}
    data = routed_data(valkey_url, storage, sim, a=FAST_DEAR, b=SLOW_CHEAP)
    config = tmp_path / "offload.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = await worker_process(config, ClockFile(tmp_path / "ahead-clock", 3600.0).env(base_env()), tmp_path)
    try:
        tight = await enqueue(store, "skew-tight", deadline_in=10)
        tight_job = await _done(store, tight, proc)
        spare = await enqueue(store, "skew-spare", deadline_in=600)
        spare_job = await _done(store, spare, proc)
    finally:
        stop(proc, signal.SIGTERM if proc.poll() is None else signal.SIGKILL)
    assert (tight_job.backend, tight_job.routed) == ("a", "deadline: a ~0.5s in time, cheapest")
    assert (spare_job.backend, spare_job.routed) == ("b", "deadline: b ~30s in time, cheapest")
    assert (await stats(sim))["submissions_by_family"] == {"jobs": 1, "runpod": 1}


async def _done(store: QueueStore, job_id: str, proc: subprocess.Popen[bytes]) -> Job:
    async def done() -> Job | None:
        assert proc.poll() is None, "the worker process ended"
        job = await store.get(job_id)
        return job if job.state.value == "succeeded" else None

    found: Job = await eventually(done, 40, f"job {job_id} to succeed")
    return found


@pytest.mark.parametrize("route", ["fallback", "weighted", "cheapest"])
async def test_every_route_kind_yields_to_the_deadline(
    route: str, valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """Whatever the route kind would pick (weighted: `a` always, by a share of 1000:1), a tight deadline only `a`
    meets goes to `a` and a spare one to the cheaper `b`."""
    weights = {"weights": {"a": 1000, "b": 1}} if route == "weighted" else {}
    settings = routed(valkey_url, no_outputs, sim, a=FAST_DEAR, b=SLOW_CHEAP, route=route, **weights)
    tight = await enqueue(store, f"kind-{route}-tight", deadline_in=10)
    async with worker(settings) as (task, _):
        [tight_job] = await until_state(store, [tight], "succeeded", task)
        spare = await enqueue(store, f"kind-{route}-spare", deadline_in=600)
        [spare_job] = await until_state(store, [spare], "succeeded", task)
    assert (tight_job.backend, spare_job.backend) == ("a", "b"), (tight_job.routed, spare_job.routed)
