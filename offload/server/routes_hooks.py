"""`POST /v1/hooks/{backend}/{job_id}/{submission}/{secret}`: where providers report a remote job (started or
finished).

No API key (a provider has none of ours); instead, in this order, before anything else is believed:
1. the path names a backend with webhooks on and a job id offload issued;
2. the per-submission secret (`secrets.token_urlsafe`, sent only to the provider inside this URL) hashes, with
   the path's backend, to one the submission's intent recorded (begin.lua, `keyspace.hook_digest`), compared in
   constant time; an unknown job, submission or secret all get the same 404, so the route tells a prober
   nothing. A secret issued for another backend's submission is a 403, logged and counted: under a backend whose
   provider signs nothing (RunPod) it would otherwise skip the signature its own backend's provider makes;
3. only then is the body read (bounded to `HOOK_BODY` by `GuardedRoute`), and the provider's own signature
   checked where it has one (`webhooks.Verifier`).
A verified delivery goes to hook.lua, which fences it by submission number and makes duplicates, late and
reordered deliveries no-ops; the answer is 200 for every verified delivery (the verdict says what it changed)
so the provider does not retry one that had nothing left to do.

Deliveries of the usual shape are answered by `FastPath`, in front of FastAPI and all of its middleware
(app.OffloadAPI), with the same `deliver` as the documented route (which answers the rest): FastAPI's layers
would cost a burst of deliveries more than the deliveries do (docs/explanation/performance.md, *Webhook
deliveries*).
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi import APIRouter, HTTPException, Request
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from offload.backends import create_backend
from offload.backends.base import WebhookBackend
from offload.errors import InvalidJob, MissingExtra, RequestError
from offload.http_client import make_client
from offload.queue.batching import Batcher
from offload.queue.hook_store import HookItem
from offload.queue.keyspace import hook_digest, queue_of
from offload.server.auth import GuardedRoute, bound_body, guard
from offload.server.errors import BodyTooLarge, error_body
from offload.server.state import ServerState, get_state
from offload.server.webhooks import Forged, Verifier

log = logging.getLogger("offload.server")
router = APIRouter(tags=["webhooks"], route_class=GuardedRoute)
HOOK_BODY = 1 << 20  # a prediction object with inline output and logs; far below the server's --max-body
MAX_SECRET = 128
_STATE_KEY = "webhooks"


@dataclass
class _Hooks:
    client: httpx.AsyncClient
    verifier: Verifier
    # The two store calls of every delivery, coalesced across the deliveries in flight (a burst of a few
    # thousand jobs ending together): one pipelined round trip per batch instead of one pool checkout each.
    digests: Batcher[tuple[str, int], list[str]]
    verdicts: Batcher[HookItem, str]
    backends: dict[str, WebhookBackend] = field(default_factory=dict)
    # deliveries refused after their URL's secret matched: (backend in the path, "backend" or "signature") -> count
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)


def _hooks(state: ServerState) -> _Hooks:
    hooks: _Hooks | None = state.extra.get(_STATE_KEY)
    if hooks is None:
        client = make_client("webhook_keys")
        hooks = _Hooks(client, Verifier(client), Batcher(state.store.hook_digests_many), Batcher(state.store.hook_many))
        state.extra[_STATE_KEY] = hooks
    return hooks


def prepare(state: ServerState) -> None:
    """Build the webhook machinery at startup, for every backend whose provider calls back, rather than on the
    first delivery: that builds an HTTP client and imports the backends (aiohttp and all) with the event loop
    blocked, and the first deliveries of a burst would all queue behind it (see docs/explanation/performance.md,
    *Webhook deliveries*).
    A backend that cannot be built here is left to the first delivery, which reports why."""
    settings = state.options.settings
    for name in [n for n in settings.backends if settings.hook_base(n) is not None]:
        try:
            _backend(state, _hooks(state), name)
        except MissingExtra as exc:
            log.warning("webhooks for backend %s: %s", name, exc)


async def aclose(state: ServerState) -> None:
    hooks: _Hooks | None = state.extra.pop(_STATE_KEY, None)
    if hooks is not None:
        await hooks.client.aclose()


def _backend(state: ServerState, hooks: _Hooks, name: str) -> WebhookBackend | None:
    if name not in hooks.backends:
        settings = state.options.settings.backends[name]
        made = create_backend(name, settings, client=hooks.client)
        if not isinstance(made, WebhookBackend):
            return None
        hooks.backends[name] = made
    return hooks.backends[name]


NOT_FOUND = "no such webhook (unknown backend, job, submission or secret)"


def refusals(state: ServerState) -> dict[tuple[str, str], int]:
    """The deliveries refused after their URL's secret matched, by (backend, reason), for /metrics."""
    hooks: _Hooks | None = state.extra.get(_STATE_KEY)
    return dict(hooks.refused) if hooks is not None else {}


def _matches(digests: Iterable[str], given: str) -> bool:
    """Whether `given` is one of `digests`, comparing every one in constant time."""
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(digest, given)
    return matched


class Refused(RequestError):
    """A delivery refused with `status` (404 unknown, 403 another backend's, 401 forged, 400 unreadable, 413 too
    large)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def deliver(
    state: ServerState,
    backend: str,
    job_id: str,
    submission: int,
    secret: str,
    headers: Mapping[str, str],
    read_body: Callable[[], Awaitable[bytes]],
) -> dict[str, Any]:
    """One delivery, checked in the module docstring's order (the body is read only once the URL's secret
    matched); the answer for a verified one, else `Refused`. Shared by the route and `FastPath`."""
    settings = state.options.settings
    if settings.hook_base(backend) is None or not 0 < submission < 1 << 31 or not 0 < len(secret) <= MAX_SECRET:
        raise Refused(404, NOT_FOUND)
    try:
        queue_of(job_id)
    except InvalidJob:
        raise Refused(404, NOT_FOUND) from None
    hooks = _hooks(state)
    digests = await hooks.digests((job_id, submission))
    if not _matches(digests, hook_digest(backend, secret)):
        others = [n for n in settings.backends if n != backend and settings.hook_base(n) is not None]
        if any(_matches(digests, hook_digest(other, secret)) for other in others):
            hooks.refused[(backend, "backend")] += 1
            log.warning("webhook for job %s refused: its URL was issued for another backend than %s", job_id, backend)
            raise Refused(403, "this webhook URL was issued for another backend's submission")
        raise Refused(404, NOT_FOUND)
    body = await read_body()
    b = settings.backends[backend]
    try:
        await hooks.verifier.verify(b, headers, body)
    except Forged as exc:
        hooks.refused[(backend, "signature")] += 1
        log.warning("webhook for job %s (backend %s) refused: %s", job_id, backend, exc)
        raise Refused(401, "the webhook's signature does not verify") from None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Refused(400, "the webhook body is not JSON") from None
    made = _backend(state, hooks, backend)
    event = made.hook_event(parsed) if made is not None else None
    if event is None:
        raise Refused(400, f"the webhook body is not a {b.kind} job report")
    verdict = await hooks.verdicts(HookItem(job_id, submission, event.remote_id, event.terminal, body))
    if verdict == "ADOPTED" or verdict == "MISMATCH":
        log.info("webhook for job %s submission %d: %s", job_id, submission, verdict.lower())
    return {"ok": True, "verdict": verdict.lower()}


@router.post(
    "/v1/hooks/{backend}/{job_id}/{submission}/{secret}",
    summary="A provider reports a remote job (webhook; authenticated by the URL's secret and its signature)",
)
@guard(body_limit=HOOK_BODY)
async def receive(backend: str, job_id: str, submission: int, secret: str, request: Request) -> dict[str, Any]:
    """The documented route; deliveries of the usual shape are answered by `FastPath` before they get here."""
    try:
        return await deliver(get_state(request), backend, job_id, submission, secret, request.headers, request.body)
    except Refused as exc:
        raise HTTPException(exc.status, exc.detail) from None


class FastPath:
    """ASGI middleware that answers `POST /v1/hooks/<backend>/<job>/<digits>/<secret>` itself, with `deliver`,
    instead of through FastAPI's routing, dependency solving and exception middleware: a burst of a few thousand
    jobs ending together is a few thousand deliveries, and those layers cost more than the delivery itself (see
    docs/explanation/performance.md, *Webhook deliveries*). Anything else, any other shape of hook path (FastAPI
    then answers 404/422 as before) and any delivery that fails unexpectedly (a Redis outage: replayed
    through FastAPI, whose handlers in errors.py map it) goes to the app. The body is bounded by GuardedRoute's
    own `bound_body`; error bodies are errors.py's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts: list[str] = scope["path"].split("/") if scope["type"] == "http" and scope["method"] == "POST" else []
        state: ServerState | None = getattr(scope["app"].state, "offload", None) if parts else None
        if len(parts) != 7 or parts[1:3] != ["v1", "hooks"] or not _number(parts[5]) or state is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        read: bytes | None = None  # the body, once read (a body is read whole or not at all)

        async def read_body() -> bytes:
            nonlocal read
            read = await request.body()
            return read

        try:
            bound_body(request, min(HOOK_BODY, state.options.max_body))  # GuardedRoute's bound, the same rule
            _, _, _, backend, job_id, submission, secret = parts
            answer = await deliver(state, backend, job_id, int(submission), secret, request.headers, read_body)
            status = 200
        except Refused as exc:
            status, answer = exc.status, error_body(exc.status, exc.detail)
        except BodyTooLarge as exc:
            status, answer = exc.status_code, error_body(exc.status_code, exc.detail)
        except ClientDisconnect:
            return  # the provider hung up mid-body: nobody to answer
        except Exception:
            await self.app(scope, _replay(read, receive), send)
            return
        raw = orjson.dumps(answer)
        start = {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON, (b"content-length", b"%d" % len(raw))],
        }
        await send(start)
        await send({"type": "http.response.body", "body": raw})


def _number(text: str) -> bool:
    """A submission number as the route's `int` would take it without a fuss: ASCII digits, a few of them."""
    return 0 < len(text) <= 10 and text.isascii() and text.isdigit()


_JSON = [(b"content-type", b"application/json")]


def _replay(read: bytes | None, receive: Receive) -> Receive:
    """`receive` as if nothing had been read: the body first, when it was read, then the connection's own
    messages."""
    if read is None:
        return receive
    pending: list[Message] = [{"type": "http.request", "body": read, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
