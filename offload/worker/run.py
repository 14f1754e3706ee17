"""Builds a dispatch worker from the configuration and runs it until SIGTERM/SIGINT, then drains."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from offload.backends import create_backend, new_client
from offload.backends.http import user_agent
from offload.config import Settings, parse_rate
from offload.connection import connect
from offload.errors import ConfigError
from offload.queue.store import QueueStore
from offload.storage import create_storage, store_output
from offload.worker.dispatch import Worker, WorkerOptions, default_worker_id
from offload.worker.jobpath import Fence
from offload.worker.limits import BackendLimits

log = logging.getLogger("offload.worker")


def _env_number(name: str, kind: type[int] | type[float]) -> int | float | None:
    """An optional numeric env override (test and ops hooks); a bad value names the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {raw!r}") from None


def storage_settings(settings: Settings) -> dict[str, Any]:
    data = settings.storage.model_dump()
    secret = settings.storage.secret_access_key
    data["secret_access_key"] = secret.get_secret_value() if secret else None
    return data


async def run_worker(
    settings: Settings, queue: str, *, concurrency: int | None = None, worker_id: str | None = None,
    stop: asyncio.Event | None = None, grace_s: float = 30.0, clock: Callable[[], float] = time.time,
    install_signals: bool = True, on_ready: Callable[[Worker], None] | None = None,
) -> Worker:
    """Serve `queue` until `stop` is set (or a signal arrives); returns the drained worker."""
    q = settings.queue(queue)
    backend_name, bs = settings.backend_for(queue)
    lease_ms = _env_number("OFFLOAD_LEASE_MS", int)
    if lease_ms is not None and lease_ms <= 0:
        raise ConfigError(f"OFFLOAD_LEASE_MS: must be positive, got {lease_ms}")
    offset = _env_number("OFFLOAD_CLOCK_OFFSET_S", float)
    if offset and clock is time.time:  # shifts the cap window only; an injected clock wins

        def clock() -> float:
            return time.time() + offset

    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    redis = await connect(settings.redis_url)
    # Liveness must never queue behind thousands of job tasks waiting for the shared pool: a late heartbeat
    # lets the reaper hand live jobs to another worker, which would then pay for them again.
    control = await connect(settings.redis_url, max_connections=2)
    in_flight = concurrency or q.concurrency
    worker_id = worker_id or default_worker_id()
    http = new_client(max_connections=min(max(in_flight, 16), 1024), timeout=bs.timeout or 600.0,
                      agent=user_agent(worker_id))
    backend = create_backend(bs.kind, backend_name, bs.provider_settings(), client=http)
    storage = create_storage(storage_settings(settings))

    async def save(key: str, output: Any, run: str, fence: Fence) -> str:
        stored = await store_output(storage, key, output, http, copy_files=settings.storage.copy_files, run=run,
                                    before_write=fence)
        return stored.location

    options = WorkerOptions(
        queue=queue, backend_name=backend_name, concurrency=in_flight, poll_interval=q.poll_interval,
        poll_timeout=q.poll_timeout, grace_s=grace_s, daily_job_cap=q.daily_job_cap,
        daily_spend_cap=q.daily_spend_cap, price_per_job=bs.price_per_job, price_per_second=bs.price_per_second,
        max_job_cost=bs.max_job_cost, ingest_list=q.ingest_list, max_attempts=q.max_attempts,
        submit_concurrency=q.submit_concurrency,
        **({"lease_ms": int(lease_ms)} if lease_ms is not None else {}),
    )
    limits = BackendLimits(redis, backend_name, parse_rate(bs.rate_limit) if bs.rate_limit else None)
    worker = Worker(QueueStore(redis), backend, save, limits, options, worker_id=worker_id, clock=clock,
                    control=QueueStore(control))
    log.info("worker %s serving queue %s via %s (%s), up to %d in flight", worker.id, queue, backend_name,
             bs.kind, in_flight)
    if on_ready:
        on_ready(worker)
    try:
        await worker.run(stop)
    finally:
        await backend.aclose()
        await http.aclose()
        await storage.aclose()
        await redis.aclose()
        await control.aclose()
    return worker
