"""The HTTP API's application factory: wiring, lifespan (connections, maintenance) and health routes.

Public routes are `/healthz`, `/readyz`, the API description (`/openapi.json`, `/docs`) and the dashboard's
static files (`/ui/`, see `dashboard.py`), which carry no data, and provider webhooks (`/v1/hooks/...`, proven by a
per-submission secret and the provider's signature, see `routes_hooks.py`); everything else needs an API key
(see `auth.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from offload import __version__
from offload.access.api_keys import KeyStore
from offload.autoscale.alert_settings import alert_settings
from offload.autoscale.alerts import Alerter
from offload.connection import at_start, connect, is_oom
from offload.eventloop import within
from offload.heap import freeze_startup
from offload.http_client import make_client
from offload.queue.memory import read_memory, warn_unreported
from offload.queue.store import QueueStore
from offload.queue.store_clock import StoreClock, warn_host_skew
from offload.server import (
    dashboard,
    errors,
    events,
    limits,
    metrics,
    routes_autoscale,
    routes_callbacks,
    routes_files,
    routes_history,
    routes_hooks,
    routes_jobs,
    routes_keys,
    routes_queues,
    routes_search,
    routes_workers,
)
from offload.server.callbacks import CallbackSender
from offload.server.file_sweep import FileSweep
from offload.server.history_sampler import HistorySampler
from offload.server.registry import WorkerRegistry
from offload.server.state import ServerOptions, ServerState
from offload.server.store_watch import StoreWatch
from offload.storage import create_storage
from offload.tracing import configure as configure_tracing

log = logging.getLogger("offload.server")


async def _maintain(state: ServerState, stop: asyncio.Event) -> None:
    """Promote due delayed/retry jobs, return the jobs of silent workers, trim expired records, release held
    jobs of past cap windows, and sample totals for rates. Queues served only by GPU workers rely on this
    (dispatch workers do it themselves when they claim). Safe to run in every server process at once: each step
    is one atomic script.

    It ends on `stop` rather than by cancellation alone: redis-py can turn a cancel that lands during its own
    timeout handling into a TimeoutError, which a retry loop would swallow and keep going."""
    alerter = Alerter(alert_settings(state.options.settings.alerts), state.redis)
    sweep = FileSweep(
        state.storage,
        state.store,
        state.options.settings.storage.upload_grace_s,
        alert=lambda subject, message: alerter.alert("file_sweep", subject, message),
    )
    try:
        await _maintenance_loop(state, stop, sweep)
    finally:
        await alerter.aclose()


async def _maintenance_loop(state: ServerState, stop: asyncio.Event, sweep: FileSweep) -> None:
    next_sweep = time.monotonic()
    sampler = HistorySampler()  # the history's gauges, once a minute of the store's clock
    while not stop.is_set():
        if time.monotonic() >= next_sweep:  # files whose job record is gone (file_sweep.py)
            next_sweep = time.monotonic() + state.options.settings.storage.sweep_interval_s
            try:
                await sweep.run_once()
            except Exception as exc:  # storage or Redis away: the next sweep tries again (a Redis error's text
                log.warning("file sweep: %s", type(exc).__name__)  # may carry a URL with a password: type only
        try:
            await state.registry.clock.sync(state.redis)
            await state.registry.prune()  # registrations whose record expired leave the index
            for queue in await state.store.queues():
                await state.store.reap(queue)
                # held jobs of an earlier cap window (the store's UTC day): a few chunks a round, so queues served
                # only by GPU workers, or by workers all stopped at midnight, get theirs back too
                await state.store.release_held(queue, max_chunks=4)
                state.rates.observe(queue, (await state.store.stats(queue)).totals)
            await sampler.maybe_sample(state, state.registry.clock())
        except Exception as exc:  # Redis away: /readyz says so; try again next round
            if stop.is_set():
                break
            if is_oom(exc):  # (reap.lua trims first and runs at the limit: this was a later step)
                state.store_watch.oom_seen()
            log.warning("maintenance: %s", type(exc).__name__)
        with contextlib.suppress(TimeoutError):
            await within(stop.wait(), state.options.maintenance_interval_s)


async def _warm_routes(app: FastAPI) -> None:
    """Send two requests through the app, in process, before the server listens: one that no route matches,
    and one webhook for a backend that does not exist (a 404 decided before any store call). FastAPI builds
    each included router's route state on the first request that reaches it, and an endpoint's context (its
    source file and line, read with `inspect`) on the first call of that endpoint: tens of ms with the event
    loop blocked, so without this the first requests after a start (a burst of webhooks, say) queue behind it."""
    transport = httpx.ASGITransport(app=app)
    async with make_client("in_process", transport=transport, base_url="http://warm-up.invalid") as client:
        await client.get("/_warm-up")
        await client.post("/v1/hooks/-warm-up-/-/1/-", content=b"{}")


async def _open(options: ServerOptions) -> ServerState:
    """Connect and check the store (its eviction policy, its replicas), then build the server's state."""
    configure_tracing(options.settings.tracing.enabled, options.settings.tracing.exporter)
    redis = await connect(options.redis_url or options.settings.redis_url)
    try:
        memory = await at_start(lambda: read_memory(redis))
        warn_unreported(memory)
        warn_host_skew(await at_start(lambda: StoreClock().sync(redis)), time.time())
        store = QueueStore(redis, lease_ms=options.worker_lease_ms, durability=options.settings.durability)
        await at_start(lambda: store.check_durability(list(options.settings.queues)))
        durability = options.settings.durability
        keys = (
            KeyStore(redis, options.admin_key, durability)
            if options.admin_key
            else KeyStore.from_env(redis, durability)
        )
        # a store that may evict: the server starts paused (one error line; enqueues, GPU-worker claims and
        # rentals wait, everything else serves), as a worker does, rather than crash-looping through a deploy
        watch = StoreWatch(redis, options.settings)
        watch.policy.apply(memory)
        return ServerState(
            options=options,
            redis=redis,
            store=store,
            keys=keys,
            storage=create_storage(options.settings.storage),
            hub=events.EventHub(store),
            registry=WorkerRegistry(store, ttl_ms=max(3 * options.worker_lease_ms, 10_000)),
            rates=metrics.RateTracker(),
            store_watch=watch,
        )
    except BaseException:
        await redis.aclose()
        raise


class OffloadAPI(FastAPI):
    """FastAPI with provider webhooks answered in front of all of it (routes_hooks.FastPath): outside the
    middleware FastAPI and Starlette wrap every request in (error, telemetry and body-limit layers), not only its
    routing (docs/explanation/performance.md, *Webhook deliveries*)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fast = routes_hooks.FastPath(functools.partial(FastAPI.__call__, self))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self  # as Starlette sets it: FastPath finds the server's state there
        state: ServerState | None = getattr(self.state, "offload", None)
        if scope["type"] == "http" and state is not None:  # body deadline, per-key and per-address caps
            await limits.admit(state, scope, receive, send, self._fast)
            return
        await self._fast(scope, receive, send)


def create_app(options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    app = OffloadAPI(
        title="offload",
        version=__version__,
        lifespan=_lifespan(options),
        description="Control plane for bursty GPU work: enqueue and follow jobs, operate queues, run GPU workers "
        "over HTTP. Authenticate with `Authorization: Bearer <key>` or `X-API-Key: <key>`.",
    )
    errors.install(app)  # bodies are bounded per route, before they are read (auth.GuardedRoute)
    _add_health(app)
    for module in (
        routes_jobs,
        routes_queues,
        routes_search,
        routes_history,
        routes_workers,
        routes_files,
        routes_keys,
        routes_hooks,
        routes_callbacks,
        events,
        metrics,
        routes_autoscale,
        dashboard,
    ):
        app.include_router(module.router)
    _describe_batch_limit(app, options)
    return app


def _lifespan(options: ServerOptions) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The server's life: open the store and its state, warm the routes, run maintenance, the store watch and the
    autoscaler; on the way out stop them and close every client."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            state = await _open(options)
        except Exception as exc:
            app.state.startup_error = exc  # runner.serve reports it in one line instead of uvicorn's traceback
            raise
        redis = state.redis
        app.state.offload = state
        with contextlib.suppress(Exception):  # the store's time for the GPU-worker registry (maintenance keeps it)
            await state.registry.clock.sync(redis)
        routes_hooks.prepare(state)
        await _warm_routes(app)
        if options.freeze_heap:
            freeze_startup()
        stop = asyncio.Event()
        task = asyncio.create_task(_maintain(state, stop), name="maintenance")
        watch = asyncio.create_task(state.store_watch.run(), name="store watch")
        sender = state.extra["callbacks"] = CallbackSender(state)
        # nothing can be delivered before the operator allows a host: owed webhooks wait in the outbox till then
        send = asyncio.create_task(sender.run(stop), name="callbacks") if options.settings.callbacks.hosts else None
        autoscaler = routes_autoscale.start(state)
        try:
            yield
        finally:
            await routes_autoscale.stop(state, autoscaler)
            stop.set()
            watch.cancel()
            # Bounded: a loop that does not end (a step stuck on the store, a cancel lost: offload/connection.py's
            # restore_lost_cancels) must not hold the exit; closing the clients below ends it.
            loops = {t for t in (task, send, watch) if t is not None}
            _, stuck = await asyncio.wait(loops, timeout=5.0)
            for t in stuck:
                t.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=2.0)
            await sender.aclose()
            await state.store_watch.aclose()
            await state.hub.aclose()
            await routes_hooks.aclose(state)
            await state.storage.aclose()
            await redis.aclose()

    return lifespan


def _add_health(app: FastAPI) -> None:
    @app.get("/healthz", tags=["health"], summary="The process is up (no dependencies checked)")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="The job store answers: ready to serve")
    async def readyz(request: Request) -> JSONResponse:
        state: ServerState | None = getattr(request.app.state, "offload", None)
        try:
            if state is not None and await within(state.redis.ping(), 2.0):
                return JSONResponse({"status": "ready"})
        except Exception as exc:
            log.warning("readiness check failed: %s", type(exc).__name__)
        return JSONResponse({"error": "unavailable", "detail": "the job store does not answer"}, status_code=503)


def _describe_batch_limit(app: FastAPI, options: ServerOptions) -> None:
    """The OpenAPI description states this server's batch limit (schemas.py checks it per request)."""
    describe = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = describe()
            schema["components"]["schemas"]["BatchEnqueueRequest"]["properties"]["jobs"]["maxItems"] = options.max_batch
        return app.openapi_schema or describe()

    app.openapi = openapi  # type: ignore[method-assign]
