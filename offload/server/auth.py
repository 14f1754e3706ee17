"""Who is calling and what they may do, decided before a request body is read.

Every route except the health checks, the API description and the dashboard's files needs a key, read from
`Authorization: Bearer` or `X-API-Key` (never from the query string: URLs end up in access logs and browser
history). The checks below are the whole permission model, so each route states its rule in one call:

| scope    | may                                                                                 |
|----------|-------------------------------------------------------------------------------------|
| admin    | everything, on every queue                                                          |
| producer | enqueue, read and cancel jobs, read queue stats and events, on its queues           |
| worker   | register, claim, heartbeat, complete and fail jobs, on its queues only               |
| viewer   | read everything on its queues (all queues unless restricted); change nothing        |

FastAPI reads and parses a JSON body before it solves any dependency, so a key check written as a dependency
would come after 16 MiB of JSON had become Python objects. `GuardedRoute` therefore authenticates, applies the
route's `guard` rule (the checks that need only the path: `@guard(produce_path_queue)`), and bounds the body
(64 KiB unless the route is marked `big_body`) before FastAPI's handler starts: a request from a wrong key
costs its headers, nothing more. Rules that need the body (a claim's queue) still run in the route.

Failed authentication is counted in Redis (so it holds across servers) per client address (clientaddr.py: the
socket peer, or what a trusted proxy forwarded) and per key id a wrong secret was presented for: past
`auth_fail_limit` within `auth_fail_window_s`, bad keys from that address or for that key id get 429 with
Retry-After until the window ends. A valid key is always served, whatever its address or id did: every
presented key is checked, and only a failure is counted, so a good key costs no extra Redis call and nobody can
lock a key or an address (a reverse proxy's included) out by failing on purpose.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, HTTPException, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.responses import Response
from starlette.types import Message

from offload.access.api_keys import ApiKey
from offload.queue.keyspace import auth_failures, auth_key_failures, validate_queue
from offload.queue.scripts import SCRIPTS
from offload.server.errors import BodyTooLarge
from offload.server.limits import hold_key
from offload.server.schemas import BATCH_LIMIT
from offload.server.state import ServerState, get_state

F = TypeVar("F", bound=Callable[..., Any])
SMALL_BODY = 64 << 10  # what every route but enqueue, batch, complete and heartbeat needs
MAX_JSON_VALUES = 1_000_000  # per body: what json.loads may turn into Python objects (~70 MB at worst)
GUARD_ATTR = "__offload_guard__"
_STATE_KEY = "offload_key"
_bearer = HTTPBearer(auto_error=False, description="An offload API key: `Authorization: Bearer ofk_...`")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="An offload API key (alternative header).")


@dataclass(frozen=True)
class Guard:
    rule: Callable[[ApiKey, Mapping[str, Any]], None] | None = None
    big_body: bool = False
    body_limit: int | None = None
    stream: bool = False


def guard(
    rule: Callable[[ApiKey, Mapping[str, Any]], None] | None = None,
    *,
    big_body: bool = False,
    body_limit: int | None = None,
    stream: bool = False,
) -> Callable[[F], F]:
    """Mark a route: `rule(key, path_params)` runs before the body is read; `big_body` allows the server's
    `--max-body` instead of 64 KiB; `body_limit` sets the route's own bound (still at most `--max-body`);
    `stream`: an event stream or long-poll, counted against its key's stream cap (limits.py)."""

    def mark(fn: F) -> F:
        setattr(fn, GUARD_ATTR, Guard(rule, big_body, body_limit, stream))
        return fn

    return mark


def _presented(request: Request) -> str | None:
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return request.headers.get("x-api-key") or None


async def authenticate(request: Request) -> ApiKey:
    """The request's key, or 401 (no key, unknown, revoked) / 429 (a bad key from an address, or for a key id,
    that failed too often)."""
    state = get_state(request)
    token = _presented(request)
    if not token:
        raise HTTPException(
            401,
            "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    key, named = await state.keys.lookup(token)
    if key is not None:
        return key
    await _count_failure(state, state.limits.address(request.scope), named)
    raise HTTPException(401, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"})


async def _count_failure(state: ServerState, address: str, key_id: str | None) -> None:
    """Count a bad key against its address and the key id it named (when that key exists); 429 once either is
    past the limit. A server remembers a block it learnt of until its window ends and counts no more against
    it, so a blocked guesser costs no Redis call beyond its key's lookup."""
    opts = state.options
    blocked: dict[str, float] = state.extra.setdefault("auth_blocked", {})
    counters = {auth_failures(address): "address"}
    if key_id is not None:
        counters[auth_key_failures(key_id)] = "key"
    now = time.monotonic()
    refuse: tuple[float, str] | None = None
    for counter, what in list(counters.items()):
        if (until := blocked.get(counter)) is not None:
            if until > now:
                refuse = max(refuse or (0.0, what), (until - now, what))
                del counters[counter]
            else:
                del blocked[counter]
    window = int(opts.auth_fail_window_s * 1000)
    counts = await asyncio.gather(*(SCRIPTS.auth_fail(state.redis, [c], [window]) for c in counters))
    for (counter, what), (failures, left_ms) in zip(counters.items(), counts, strict=True):
        if int(failures) < opts.auth_fail_limit:
            continue
        wait = max(0.001, int(left_ms) / 1000)
        if len(blocked) > 10_000:  # many addresses: forget the expired blocks
            for stale in [c for c, t in blocked.items() if t <= now]:
                del blocked[stale]
        blocked[counter] = now + wait
        if int(failures) > opts.auth_fail_limit:
            refuse = max(refuse or (0.0, what), (wait, what))
    if refuse is not None:
        raise _too_many(*refuse)


def _too_many(wait: float, what: str) -> HTTPException:
    seconds = max(1, math.ceil(wait))
    source = "from this address" if what == "address" else "for this key id"
    return HTTPException(
        429,
        f"too many requests with invalid API keys {source}; retry in {seconds}s (a valid key is not refused)",
        headers={"Retry-After": str(seconds)},
    )


def revoked() -> HTTPException:
    return HTTPException(401, "the API key was revoked", headers={"WWW-Authenticate": "Bearer"})


async def still_valid(state: ServerState, key: ApiKey) -> None:
    """401 once a key authenticated earlier has been revoked: streams and long-polls call it at every wake."""
    if not await state.keys.alive(key):
        raise revoked()


async def principal(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header: Annotated[str | None, Depends(_header)],
) -> ApiKey:
    """The key `GuardedRoute` authenticated (the security schemes above only document the headers)."""
    key: ApiKey | None = getattr(request.state, _STATE_KEY, None)
    return key if key is not None else await authenticate(request)


Principal = Annotated[ApiKey, Depends(principal)]


def _needs_key(dependant: Dependant) -> bool:
    return any(d.call is principal or _needs_key(d) for d in dependant.dependencies)


def bound_body(request: Request, limit: int) -> None:
    """413 once a body passes `limit` bytes: at once when Content-Length says so, else while it streams in."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    receive, seen = request.receive, 0

    async def bounded() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    request._receive = bounded


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _count_values(body: bytes) -> None:
    """413 for a body that would become more than MAX_JSON_VALUES Python objects: 8 MiB of `{},` is 2.8
    million dicts (~450 MB once parsed and validated). Every value but the first follows a `,` or opens a
    container, so counting those bounds it; braces and commas inside strings only count when the cheap
    upper bound is over the limit, and then exactly."""
    rough = body.count(b",") + body.count(b"{") + body.count(b"[")
    if rough <= MAX_JSON_VALUES:
        return
    bare = _STRING.sub(b'""', body)
    if bare.count(b",") + bare.count(b"{") + bare.count(b"[") > MAX_JSON_VALUES:
        raise HTTPException(413, f"request body holds more than {MAX_JSON_VALUES} JSON values: split it")


class GuardedRoute(APIRoute):
    """Authenticate, guard and bound the body before FastAPI reads it (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        marked: Guard = getattr(self.endpoint, GUARD_ATTR, Guard())
        needs_key = _needs_key(self.dependant)

        async def run(request: Request) -> Response:
            state = get_state(request)
            opts = state.options
            limit = marked.body_limit or (opts.max_body if marked.big_body else SMALL_BODY)
            bound_body(request, min(limit, opts.max_body))
            if needs_key:
                key = await authenticate(request)
                setattr(request.state, _STATE_KEY, key)
                if marked.rule is not None:
                    marked.rule(key, request.path_params)
                hold_key(request.scope, state.limits, key.id, marked.stream)
            if marked.big_body:
                _count_values(await request.body())  # cached: FastAPI's reader gets the same bytes
            BATCH_LIMIT.set(opts.max_batch)
            response: Response = await handler(request)
            return response

        return run


def _deny(key: ApiKey, action: str, queue: str | None = None) -> HTTPException:
    where = f" on queue {queue!r}" if queue else ""
    return HTTPException(403, f"a {key.scope} key may not {action}{where}")


def can_read(key: ApiKey, queue: str) -> bool:
    return key.scope == "admin" or (key.scope in ("viewer", "producer") and key.covers(queue))


def need_read(key: ApiKey, queue: str) -> None:
    if not can_read(key, queue):
        raise _deny(key, "read", queue)


def need_produce(key: ApiKey, queue: str, action: str = "enqueue") -> None:
    if not (key.scope == "admin" or (key.scope == "producer" and key.covers(queue))):
        raise _deny(key, action, queue)


def need_work(key: ApiKey, queue: str) -> None:
    if not (key.scope == "admin" or (key.scope == "worker" and key.covers(queue))):
        raise _deny(key, "work", queue)


def need_worker_scope(key: ApiKey) -> None:
    if key.scope not in ("admin", "worker"):
        raise _deny(key, "act as a worker")


def need_admin(key: ApiKey, action: str) -> None:
    if key.scope != "admin":
        raise _deny(key, action)


def need_global_read(key: ApiKey, what: str) -> None:
    """Views that span every queue (workers, metrics): admins and unrestricted viewers."""
    if not (key.scope == "admin" or (key.scope == "viewer" and key.queues is None)):
        raise _deny(key, f"read {what}")


# -- rules for `guard`: the ones a path alone decides --------------------------------------------------------


def produce_path_queue(key: ApiKey, params: Mapping[str, Any]) -> None:
    need_produce(key, validate_queue(params["queue"]))


def admin_only(action: str) -> Callable[[ApiKey, Mapping[str, Any]], None]:
    return lambda key, _params: need_admin(key, action)


def worker_only(key: ApiKey, _params: Mapping[str, Any]) -> None:
    need_worker_scope(key)
