"""`/metrics` in the Prometheus text format, read from Redis on every scrape.

Nothing is counted in the server's memory: totals and latency histograms are kept by the queue's Lua scripts
and per-backend counters by the dispatch workers, all in Redis, so any number of server processes report the
same (correct) numbers and a restart resets nothing. Rates for the API are derived from the same totals,
sampled in-process over a sliding window.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from offload.autoscale.fleet_idle import with_fleet_idle
from offload.autoscale.status import autoscale_families
from offload.models import SPEND_KINDS, QueueStats
from offload.queue.backend_limits import backend_counters, route_counters
from offload.queue.memory import read_memory
from offload.queue.outbox import Outbox
from offload.queue.scripts import HIST_BUCKETS_S
from offload.server.auth import GuardedRoute, Principal, need_global_read
from offload.server.routes_hooks import refusals
from offload.server.state import ServerState, get_state

router = APIRouter(tags=["metrics"], route_class=GuardedRoute)
RATE_FIELDS = ("enqueued", "succeeded", "failed", "dead", "cancelled")
# dead jobs by a kind of their own (counted in `dead` too): not started by their deadline, refused over max_cost;
# and the GPU-worker runs whose machine had no price (not a rented instance: their cost is unknown, not $0)
TOTAL_FIELDS = (*RATE_FIELDS, "deadline_passed", "over_max_cost", "fleet_unpriced")


class RateTracker:
    """Per-queue samples of the Redis totals; a rate is the change over the oldest sample in the window."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, dict[str, int]]]] = {}

    def observe(self, queue: str, totals: dict[str, int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        samples = self._samples.setdefault(queue, deque())
        if samples and now - samples[-1][0] < 0.5:
            return  # one sample per half second is plenty
        samples.append((now, dict(totals)))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()

    def rates(self, queue: str) -> tuple[dict[str, float | None], float | None]:
        samples = self._samples.get(queue)
        if not samples or len(samples) < 2:
            return dict.fromkeys(RATE_FIELDS), None
        (t0, first), (t1, last) = samples[0], samples[-1]
        span = t1 - t0
        return {f: round((last.get(f, 0) - first.get(f, 0)) / span, 3) for f in RATE_FIELDS}, round(span, 3)


class _Snapshot:
    """prometheus_client collectors are synchronous: gather everything first, then hand over the families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def _histogram(name: str, doc: str, per_queue: dict[str, tuple[list[int], int, int]]) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=["queue"])
    for queue, (counts, total, sum_ms) in per_queue.items():
        cumulative, running = [], 0
        for bound, c in zip([*(str(float(b)) for b in HIST_BUCKETS_S), "+Inf"], counts, strict=True):
            running += c
            cumulative.append((bound, running))
        cumulative[-1] = ("+Inf", total)
        fam.add_metric([queue], cumulative, sum_ms / 1000)
    return fam


async def collect(state: ServerState) -> list[Metric]:
    store = state.store
    queues = sorted(set(await store.queues()) | set(state.options.settings.queues))
    stats = await asyncio.gather(*(_stats(state, q) for q in queues))
    hists = await asyncio.gather(*(store.histograms(q) for q in queues))
    per_queue = await _queue_families(state, queues, stats)
    remote = await _remote_families(state, queues)
    callbacks = await _callback_families(state, queues)
    backend = await _backend_families(state)
    wait = _histogram(
        "offload_job_wait_seconds",
        "From ready (enqueue, retry, release) to claimed.",
        {q: h["wait"] for q, h in zip(queues, hists, strict=True)},
    )
    run = _histogram(
        "offload_job_run_seconds",
        "From claimed to succeeded.",
        {q: h["run"] for q, h in zip(queues, hists, strict=True)},
    )
    return [
        *await _store_families(state),
        *per_queue,
        *remote,
        *callbacks,
        *backend,
        wait,
        run,
        *await autoscale_families(state.redis),
    ]


async def _stats(state: ServerState, queue: str) -> QueueStats:
    return await with_fleet_idle(state.redis, await state.store.stats(queue))


def _spend_family(queues: list[str], stats: list[QueueStats]) -> CounterMetricFamily:
    """USD per queue and kind of capacity since the queue began: serverless, fleet (its jobs' shares of their
    machines) and fleet_idle (the rental they did not use: may step back a little when jobs finish between two
    accruals of the rental)."""
    spend = CounterMetricFamily(
        "offload_spend_usd",
        "Spend since the queue began by kind of capacity: serverless (API runs), fleet (GPU-worker runs: run time "
        "x machine price), fleet_idle (rented machines' cost not used by jobs).",
        labels=["queue", "kind"],
    )
    for queue, s in zip(queues, stats, strict=True):
        for kind in SPEND_KINDS:
            if kind in s.spend_total or kind != "fleet_idle":
                spend.add_metric([queue, kind], s.spend_total.get(kind, 0.0))
    return spend


async def _queue_families(state: ServerState, queues: list[str], stats: list[QueueStats]) -> list[Metric]:
    """Each queue's depth, totals, oldest ready job, pause, workers and its day's budget against its caps."""
    depth = GaugeMetricFamily("offload_queue_jobs", "Jobs in each state now.", labels=["queue", "state"])
    totals = CounterMetricFamily(
        "offload_jobs", "Job transitions since the queue was created.", labels=["queue", "event"]
    )
    oldest = GaugeMetricFamily("offload_queue_oldest_ready_seconds", "Age of the oldest ready job.", labels=["queue"])
    paused = GaugeMetricFamily("offload_queue_paused", "1 when claims are paused.", labels=["queue"])
    workers = GaugeMetricFamily("offload_workers", "Live workers per queue (lease not expired).", labels=["queue"])
    budget = GaugeMetricFamily(
        "offload_budget_used", "Counted against the caps of the job store's UTC day.", labels=["queue", "kind"]
    )
    caps = GaugeMetricFamily("offload_budget_cap", "Daily caps from offload.yaml.", labels=["queue", "kind"])
    for queue, s in zip(queues, stats, strict=True):
        state.rates.observe(queue, s.totals)
        for name, n in s.counts.items():
            depth.add_metric([queue, name], n)
        for event in TOTAL_FIELDS:
            totals.add_metric([queue, event], s.totals.get(event, 0))
        oldest.add_metric([queue], (s.oldest_ready_age_ms or 0) / 1000)
        paused.add_metric([queue], int(s.paused))
        workers.add_metric([queue], s.workers)
        _, jobs_used, spend_used = await state.store.usage(queue)
        budget.add_metric([queue, "jobs"], jobs_used)
        budget.add_metric([queue, "spend"], spend_used)
        q = state.options.settings.queues.get(queue)
        if q is not None and q.daily_job_cap is not None:
            caps.add_metric([queue, "jobs"], q.daily_job_cap)
        if q is not None and q.daily_spend_cap is not None:
            caps.add_metric([queue, "spend"], q.daily_spend_cap)
    return [depth, totals, oldest, paused, workers, budget, caps, _spend_family(queues, stats)]


async def _remote_families(state: ServerState, queues: list[str]) -> list[Metric]:
    """Remote workers alive per queue served, and the possible duplicate submissions per queue and backend."""
    remote = GaugeMetricFamily(
        "offload_remote_workers", "Registered GPU workers alive, per queue served.", labels=["queue"]
    )
    per_queue: dict[str, int] = dict.fromkeys(queues, 0)
    for w in await state.registry.gpu_workers():
        for served in w.queues:
            per_queue[served] = per_queue.get(served, 0) + 1
    for served, n in sorted(per_queue.items()):
        remote.add_metric([served], n)
    dups = CounterMetricFamily(
        "offload_possible_duplicate_submissions",
        "Submissions sent again because a worker was lost inside the submit call (the provider may have run "
        "the job twice, unless it honours the Idempotency-Key).",
        labels=["queue", "backend"],
    )
    for queue, per_backend in zip(
        queues, await asyncio.gather(*(state.store.possible_duplicates(q) for q in queues)), strict=True
    ):
        for name, n in sorted(per_backend.items()):
            dups.add_metric([queue, name], n)
    return [remote, dups]


async def _callback_families(state: ServerState, queues: list[str]) -> list[Metric]:
    """Completion webhooks per queue (offload/queue/outbox.py): owed and dead-lettered now, and the totals of
    their tries, as the store counts them."""
    owed = GaugeMetricFamily(
        "offload_callbacks_owed", "Completion webhooks not yet delivered nor dead-lettered.", labels=["queue"]
    )
    failed = GaugeMetricFamily(
        "offload_callbacks_failed",
        "Completion webhooks dead-lettered now (GET /v1/queues/{queue}/callbacks/failed).",
        labels=["queue"],
    )
    totals = CounterMetricFamily(
        "offload_callbacks",
        "Completion-webhook events since the queue began: delivered, failed_try (every try that failed), "
        "dead_lettered, requeued (from the dead letter).",
        labels=["queue", "event"],
    )
    outbox = Outbox(state.redis)
    for queue, counts in zip(queues, await asyncio.gather(*(outbox.counts(q) for q in queues)), strict=True):
        owed.add_metric([queue], counts.owed)
        failed.add_metric([queue], counts.failed)
        for event, n in counts.totals.items():
            totals.add_metric([queue, event], n)
    return [owed, failed, totals]


async def _backend_families(state: ServerState) -> list[Metric]:
    """Dispatch-worker requests per backend by outcome, and the webhook deliveries this server refused."""
    backend = CounterMetricFamily(
        "offload_backend_requests", "Dispatch-worker requests to a backend by outcome.", labels=["backend", "outcome"]
    )
    for name in sorted(state.options.settings.backends):
        for outcome, n in (await backend_counters(state.redis, name)).items():
            backend.add_metric([name, outcome], n)
    refused = CounterMetricFamily(
        "offload_webhooks_refused",
        "Webhook deliveries whose URL secret matched but that were refused, by reason: `backend` (the URL was "
        "issued for another backend) or `signature` (the provider's signature does not verify). Since start.",
        labels=["backend", "reason"],
    )
    for (name, reason), n in sorted(refusals(state).items()):
        refused.add_metric([name, reason], n)
    return [backend, refused, *await _route_families(state)]


async def _route_families(state: ServerState) -> list[Metric]:
    """A routed queue's backends (worker/routing.py): submissions sent to each by reason, and its cool-downs."""
    routed = CounterMetricFamily(
        "offload_routed_submissions",
        "Submissions a routed queue sent to a backend, by reason: first (its first choice), fallback (an earlier "
        "one was cooling down), weighted, cheapest, probe (the half-open backend's probe), deadline (the cheapest "
        "expected to finish by the job's deadline), late (none expected in time: the soonest), max_cost (a dearer "
        "one skipped for the job's max_cost).",
        labels=["backend", "reason"],
    )
    opened = CounterMetricFamily(
        "offload_backend_cool_downs",
        "Times a routed backend's errors opened it (a cool-down began).",
        labels=["backend"],
    )
    routed_names = {
        n for q in state.options.settings.queues.values() if len(q.served_backends) > 1 for n in q.served_backends
    }
    for name in sorted(routed_names):
        counts = await route_counters(state.redis, name)
        opened.add_metric([name], counts.pop("opened", 0))
        for reason, n in sorted(counts.items()):
            routed.add_metric([name, reason], n)
    return [routed, opened]


async def _store_families(state: ServerState) -> list[Metric]:
    """The job store's memory and eviction policy, per primary (queue/memory.py): INFO memory at each scrape."""
    memory = await read_memory(state.redis)
    used = GaugeMetricFamily(
        "offload_store_memory_used_bytes",
        "Memory the job store holds against its maxmemory (used_memory less replication and AOF buffers).",
        labels=["node"],
    )
    limit = GaugeMetricFamily("offload_store_memory_max_bytes", "The job store's maxmemory (0: none).", labels=["node"])
    ratio = GaugeMetricFamily(
        "offload_store_memory_ratio",
        "Used over maxmemory (only where a maxmemory is set): past 1 writes that add data are refused.",
        labels=["node"],
    )
    policy = GaugeMetricFamily(
        "offload_store_maxmemory_policy", "1 for the maxmemory-policy in force.", labels=["node", "policy"]
    )
    safe = GaugeMetricFamily(
        "offload_store_eviction_safe",
        "1 when every primary's maxmemory-policy is noeviction; 0 stops new claims, submissions and enqueues.",
    )
    for n in memory.nodes:
        node = n.node or "primary"
        used.add_metric([node], n.counted)
        limit.add_metric([node], n.maxmemory)
        if n.ratio is not None:
            ratio.add_metric([node], round(n.ratio, 4))
        policy.add_metric([node, n.policy or "unknown"], 1)
    safe.add_metric([], int(memory.problem is None))
    return [used, limit, ratio, policy, safe]


@router.get("/metrics", summary="Prometheus metrics (text format)", response_class=Response)
async def metrics(request: Request, key: Principal) -> Response:
    need_global_read(key, "metrics")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(await collect(get_state(request))))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
