"""Assemble the simulator's ASGI app: every family's routes on one server, in an order that keeps fal's generic
paths from shadowing the others.

The outermost layer saves uvicorn's own `send` in the scope before Starlette wraps it, because that bound method
is the only way from inside ASGI to the TCP transport, which a simulated connection reset must abort.

It also answers every request that fully matches a route itself (`SimApp._route`): the route is found by its
literal prefix, then its own regex, in Starlette's order, and its endpoint runs with no middleware or router
around it, because the simulator shares the bench machine with the system under test
(docs/explanation/performance.md, *The simulator*). Anything else (an unknown path, a wrong method: Starlette's
404 and 405, through `_http_error`) goes through Starlette.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from offload.clock import Clock
from offload.testing.sim import (
    anthropic_api,
    control_api,
    fal_api,
    jobs_api,
    machines,
    openai_api,
    openai_batch_api,
    pods_api,
    replicate_api,
    runpod_api,
    vastai_api,
)
from offload.testing.sim.config import SimConfig
from offload.testing.sim.engine import Sim
from offload.testing.sim.faults import RAW_SEND_KEY


class SimApp:
    """The ASGI callable uvicorn runs; `sim` is exposed for in-process inspection."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        rented = machines.Machines(sim)  # one store behind both rental APIs
        routes = [
            *control_api.routes(sim),
            *jobs_api.routes(sim),
            *machines.control_routes(sim, rented),
            *pods_api.routes(sim, rented),  # before runpod's /v2/{endpoint_id}/... so /v2/pods/{id} is a pod
            *vastai_api.routes(sim, rented),
            *runpod_api.routes(sim),
            *openai_api.routes(sim),
            *openai_batch_api.routes(sim),
            *anthropic_api.routes(sim),
            *replicate_api.routes(sim),
            *fal_api.routes(sim),  # last: its submit route is a catch-all POST
        ]
        self.starlette = Starlette(
            routes=routes, exception_handlers={HTTPException: self._http_error}, lifespan=self._lifespan
        )
        self._routes = [  # (route, the literal start of its path); a sync endpoint is left to Starlette
            (route, route.path.split("{", 1)[0]) for route in routes if inspect.iscoroutinefunction(route.endpoint)
        ]

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Close the webhook sender's connection pool on shutdown (left open, aiohttp warns of an unclosed
        session at exit)."""
        yield
        await self.sim.hooks.aclose()

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Unknown paths and wrong methods get a JSON body and are counted, so a test can spot a client that
        calls a path no provider has."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        self.sim.stats.request("unmatched")
        self.sim.stats.status("unmatched", status)
        body = {
            "error": "not found" if status == 404 else "method not allowed" if status == 405 else "error",
            "path": request.url.path,
            "method": request.method,
        }
        return Response(orjson.dumps(body), status_code=status, media_type="application/json")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND_KEY] = send
            route = self._route(scope)
            if route is not None:
                scope["app"] = self.starlette
                request = Request(scope, receive, send)
                try:
                    response = await route.endpoint(request)
                except HTTPException as exc:
                    response = await self._http_error(request, exc)
                await response(scope, receive, send)
                return
        await self.starlette(scope, receive, send)

    def _route(self, scope: Scope) -> Route | None:
        """The route that fully matches the request (its path parameters put in `scope`), or None: no route, a
        wrong method, or a root path (left to Starlette's router, which answers those)."""
        if scope.get("root_path"):
            return None
        path = scope["path"]
        for route, literal in self._routes:
            if path.startswith(literal):
                match, child = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child)
                    return route
                if match is Match.PARTIAL:
                    return None
        return None


def create_app(config: SimConfig | None = None, *, clock: Clock | None = None) -> SimApp:
    """A fresh simulator (its own jobs and counters). `clock` is injectable for unit tests."""
    sim = Sim(config, clock) if clock is not None else Sim(config)
    return SimApp(sim)
