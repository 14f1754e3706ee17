"""Builds a dispatch worker from the configuration and runs it until SIGTERM/SIGINT, then drains."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from offload.backends import Backend, create_backend, new_client
from offload.backends.batched import BatchBackend
from offload.backends.http import user_agent
from offload.backends.settings import AnyBackendSettings
from offload.backends.transport import fast_path
from offload.config import QueueSettings, Settings, parse_rate
from offload.connection import at_start, connect
from offload.egress import FilePolicy
from offload.env import env_int
from offload.errors import ConfigError
from offload.queue.backend_limits import BackendLimits
from offload.queue.memory import read_memory, warn_unreported
from offload.queue.store import QueueStore
from offload.queue.store_clock import StoreClock, warn_host_skew
from offload.redis_client import RedisClient
from offload.storage import S3StorageSettings, Storage, create_storage, store_output
from offload.tracing import configure as configure_tracing
from offload.worker.context import Fence, StoreOutput
from offload.worker.dispatch import Worker, default_worker_id
from offload.worker.file_inputs import with_file_inputs
from offload.worker.options import DRAIN_GRACE_S, WorkerOptions
from offload.worker.routing import Router, build_router
from offload.worker.storage_gate import StorageGate

log = logging.getLogger("offload.worker")
# Output files are copied over a pool of their own, at most this many connections per file host, each kept alive
# and reused: without a per-host bound a burst of job ends opens a connection for most of its files (see
# docs/explanation/performance.md).
FILE_CONNECTIONS_PER_HOST = 64


async def run_worker(
    settings: Settings,
    queue: str,
    *,
    concurrency: int | None = None,
    worker_id: str | None = None,
    stop: asyncio.Event | None = None,
    cut: asyncio.Event | None = None,
    grace_s: float = DRAIN_GRACE_S,
    install_signals: bool = True,
    on_ready: Callable[[Worker], None] | None = None,
) -> Worker:
    """Serve `queue` until `stop` is set (or a signal arrives); returns the drained worker. `cut` set during the
    drain ends it at once, as a second signal does."""
    (worker,) = await run_workers(
        settings,
        [queue],
        concurrency=concurrency,
        worker_id=worker_id,
        stop=stop,
        cut=cut,
        grace_s=grace_s,
        install_signals=install_signals,
        on_ready=on_ready,
    )
    return worker


async def run_workers(
    settings: Settings,
    queues: Sequence[str],
    *,
    concurrency: int | None = None,
    worker_id: str | None = None,
    stop: asyncio.Event | None = None,
    cut: asyncio.Event | None = None,
    grace_s: float = DRAIN_GRACE_S,
    install_signals: bool = True,
    on_ready: Callable[[Worker], None] | None = None,
) -> list[Worker]:
    """Serve every queue of `queues` from this process until `stop` is set (or a signal arrives); returns the
    drained workers.

    One `Worker` per queue on one event loop. They share the Redis pool, the HTTP client, the storage and one
    backend (with its limits) per backend name; each keeps a control connection of its own, so one queue's
    claims never delay another queue's heartbeats. `concurrency` applies per queue. If one worker fails, the
    others drain as on SIGTERM and the failure is raised: a process serving only some of its queues would look
    healthy to systemd while a queue starves. `cut`, set during the drain, ends it at once (a second signal sets
    it): the submit calls still out keep their intents open, for the next worker to adopt or resend (counted).
    """
    plans = [(name, settings.queue(name), *settings.backend_for(name)) for name in dict.fromkeys(queues)]
    if not plans:
        raise ConfigError("no queue to serve")
    lease_ms = env_int("OFFLOAD_LEASE_MS", None, minimum=1)
    configure_tracing(settings.tracing.enabled, settings.tracing.exporter)
    stop = stop or asyncio.Event()
    cut = cut or asyncio.Event()
    if install_signals:
        _install_signals(stop, cut)
    total = sum(concurrency or q.concurrency for _, q, _, _ in plans)
    worker_id = worker_id or default_worker_id()  # one id per process: it is in every request's User-Agent
    async with contextlib.AsyncExitStack() as resources:
        shared = await _Shared.open(settings, plans, total, worker_id, resources)
        lease = int(lease_ms) if lease_ms is not None else None
        workers = [
            await shared.worker(
                WorkerOptions.from_settings(settings, queue, concurrency=concurrency, grace_s=grace_s, lease_ms=lease),
                backend_name,
                bs,
                worker_id,
                resources,
            )
            for queue, _, backend_name, bs in plans
        ]
        if on_ready:
            for worker in workers:
                on_ready(worker)
        await _serve_all(workers, stop, cut)
    return workers


class _Shared:
    """What the workers of one process share: the HTTP clients, the storage and its clock gate, one backend (and
    its limits) per backend name, the Redis pool and the store."""

    def __init__(
        self,
        settings: Settings,
        files: httpx.AsyncClient,
        storage: Storage,
        backends: dict[str, Backend],
        redis: RedisClient,
        gate: StorageGate,
    ) -> None:
        self.settings, self.files, self.storage, self.backends = settings, files, storage, backends
        self.redis, self.gate = redis, gate
        self.store = QueueStore(redis, durability=settings.durability)
        self.plain = fast_path(files)  # output files copied on aiohttp directly where httpx adds nothing
        self.limits: dict[str, BackendLimits] = {}

    @classmethod
    async def open(
        cls,
        settings: Settings,
        plans: list[tuple[str, QueueSettings, str, AnyBackendSettings]],
        total: int,
        worker_id: str,
        resources: contextlib.AsyncExitStack,
    ) -> _Shared:
        pool = functools.partial(
            new_client,
            max_connections=min(max(total, 16), 1024),
            timeout=max(bs.timeout for *_, bs in plans),
            agent=user_agent(worker_id),
        )
        http = pool()
        resources.push_async_callback(http.aclose)
        # its own: the providers' APIs never queue behind copies; and under the egress rule (offload.egress)
        files = pool(per_host=FILE_CONNECTIONS_PER_HOST, egress=True)
        resources.push_async_callback(files.aclose)
        storage = create_storage(settings.storage)
        resources.push_async_callback(storage.aclose)
        # a key of the first queue's own namespace (storage/namespace.py: `_` names offload's objects): HEAD only
        gate = StorageGate(functools.partial(storage.head, f"results/{plans[0][0]}:_clock"))
        resources.push_async_callback(gate.aclose)
        backends: dict[str, Backend] = {}
        every = [named for queue, *_ in plans for named in settings.backends_for(queue)]
        for backend_name, bs in every:  # every backend's settings are checked before anything connects
            if backend_name not in backends:
                backend = create_backend(backend_name, bs, client=http)
                if not isinstance(backend, BatchBackend):  # a batch's lines carry their input as it is
                    backend = with_file_inputs(backend, storage, settings.storage.input_url_expires_s)
                backends[backend_name] = backend
                resources.push_async_callback(backends[backend_name].aclose)
        redis = await connect(settings.redis_url)
        resources.push_async_callback(redis.aclose)
        # what the store could not report is said once a process (each worker reads its policy as it starts)
        warn_unreported(await at_start(lambda: read_memory(redis)))
        warn_host_skew(await at_start(lambda: StoreClock().sync(redis)), time.time())
        await gate.check()  # a host whose clock the storage refuses pays for nothing from the start
        shared = cls(settings, files, storage, backends, redis, gate)
        await at_start(lambda: shared.store.check_durability([queue for queue, *_ in plans]))
        return shared

    def saver(self, queue: str) -> StoreOutput:
        settings = self.settings
        policy = file_policy(settings, *(bs for _, bs in settings.backends_for(queue)))

        async def save(key: str, output: Any, submission: str, fence: Fence) -> str:
            stored = await store_output(
                self.storage,
                key,
                output,
                self.files,
                copy_files=settings.storage.copy_files,
                policy=policy,
                run=submission,
                before_write=fence,
                plain=self.plain,
            )
            return stored.location

        return save

    async def worker(
        self,
        options: WorkerOptions,
        backend_name: str,
        bs: AnyBackendSettings,
        worker_id: str,
        resources: contextlib.AsyncExitStack,
    ) -> Worker:
        for name, each in self.settings.backends_for(options.queue):
            if name not in self.limits:
                rate = parse_rate(each.rate_limit) if each.rate_limit else None
                self.limits[name] = BackendLimits(self.redis, name, rate)
        # Liveness must never queue behind thousands of job tasks waiting for the shared pool: a late
        # heartbeat lets the reaper hand live jobs to another worker, which would then pay for them again.
        control = await connect(self.settings.redis_url, max_connections=2)
        resources.push_async_callback(control.aclose)
        worker = Worker(
            self.store,
            self.backends[backend_name],
            self.saver(options.queue),
            self.limits[backend_name],
            options,
            worker_id=worker_id,
            control=QueueStore(control, durability=self.settings.durability),
            router=build_router(self.settings, options.queue, self.backends, self.limits, self.redis),
            storage_gate=self.gate,
        )
        # a store that may evict loses leases and caps: paused from the start (one line naming the setting), as
        # running workers pause (PolicyWatch); read here, right before serving, as the start-up's own checks
        # (durability's WAIT, a store that answers late) may take seconds
        worker.policy.apply(await at_start(lambda: read_memory(self.redis)))
        log.info(
            "worker %s serving queue %s via %s, up to %d in flight",
            worker.id,
            options.queue,
            _via(worker.ctx.router, self.settings),
            options.concurrency,
        )
        return worker


def _via(router: Router, settings: Settings) -> str:
    """`sdxl (runpod)`, or for a routed queue `a (http-job), b (runpod); route fallback`."""
    named = ", ".join(f"{lane.name} ({settings.backends[lane.name].kind})" for lane in router.lanes)
    return f"{named}; route {router.kind}" if router.routed else named


def file_policy(settings: Settings, *named: AnyBackendSettings) -> FilePolicy:
    """Where a queue's backends' output files may be copied from (offload.egress). The backends' own origins and
    the result store's are the operator's, fetched even on a private address: a local stack's simulator serves its
    files itself, and an output that echoes its input names the store's presigned URLs (path- or
    virtual-host-style). A routed queue's backends pool their rules (any backend's output may be stored)."""
    own = [bs.base_url for bs in named]
    store = settings.storage
    if isinstance(store, S3StorageSettings) and store.endpoint_url:
        parts = urlsplit(store.endpoint_url)
        own += [store.endpoint_url, f"{parts.scheme}://{store.bucket}.{parts.netloc}"]
    hosts = None if any(bs.file_hosts is None for bs in named) else [h for bs in named for h in bs.file_hosts or ()]
    return FilePolicy.of(*own, allow_private=any(bs.allow_private_hosts for bs in named), hosts=hosts)


def _install_signals(stop: asyncio.Event, cut: asyncio.Event) -> None:
    loop, handle = asyncio.get_running_loop(), _on_signal(stop, cut)  # one count for both signals
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle)


def _on_signal(stop: asyncio.Event, cut: asyncio.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT: the first drains (`stop`), the next cuts the drain short (`cut`): submit calls still out are
    abandoned with their intents open, so the next worker adopts or resends them, counted as possible
    duplicates."""
    signals = 0

    def handle() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            stop.set()
        elif not cut.is_set():
            log.warning("second signal: cutting the drain short")
            cut.set()

    return handle


async def _serve_all(workers: list[Worker], stop: asyncio.Event, cut: asyncio.Event | None = None) -> None:
    """Run every worker until `stop`; the first failure stops (and drains) the rest, then is raised."""
    tasks = [asyncio.create_task(w.run(stop, cut), name=f"worker {w.options.queue}") for w in workers]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        stop.set()  # reached with every task done, or on cancellation: either way the rest drain
        results = await asyncio.gather(*tasks, return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        raise failure
