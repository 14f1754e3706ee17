"""What one client may hold of a server process: a deadline for each request body, and caps on the requests
and streams open at once per key, and per address for requests that present no key.

Headers have their own deadline (runner.py); a body gets `body_timeout_s`, plus one second per `body_min_rate`
bytes it has delivered, from the moment the route starts reading it: a client trickling its body byte by byte
is answered 408 and its connection closed, while a large body at a reasonable rate always gets the time it needs.

A request that presents a key counts against that key once `GuardedRoute` has authenticated it (a bad key is
refused before its body is read, so it holds nothing); event streams and long-polls (SSE, wait, claim) count
against the key's stream cap too. A request without a key, and every provider webhook, counts against its
client address (clientaddr.py). Past a cap: 429 with Retry-After and a JSON body. Counts are per server
process: a slot is held for the whole request, a stream's included, and given back however it ends.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from offload.errors import RequestError
from offload.eventloop import within
from offload.schema import Network, parse_networks
from offload.server.clientaddr import client_address

if TYPE_CHECKING:
    from offload.server.state import ServerOptions, ServerState

HELD = "offload.held"  # the scope entry: what a request holds, given back when it ends
RETRY_AFTER_S = 1
_CREDENTIALS = (b"authorization", b"x-api-key")
_HOOKS = "/v1/hooks/"


class BodyTimeout(RequestError, StarletteHTTPException):
    """408, and the connection is closed: the body did not arrive in time. An HTTPException so FastAPI's body
    reader re-raises it as is (errors.BodyTooLarge does the same)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            408,
            f"the request body did not arrive in time ({seconds:.0f} s); send it faster or in smaller parts",
            headers={"Connection": "close"},
        )


class Tally:
    """How many requests each owner (a key id, a stream's key id, an address) has open in this process."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def take(self, owner: str, cap: int) -> Callable[[], None] | None:
        """A release function, or None when `owner` already holds `cap`."""
        held = self.open.get(owner, 0)
        if held >= cap:
            return None
        self.open[owner] = held + 1
        return functools.partial(self._give, owner)

    def _give(self, owner: str) -> None:
        held = self.open.get(owner, 0) - 1
        if held > 0:
            self.open[owner] = held
        else:
            self.open.pop(owner, None)


class Limits:
    """A server process's tallies and its trusted proxies (parsed once)."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.trusted: tuple[Network, ...] = parse_networks(options.settings.server.trusted_proxies)
        self.requests, self.streams, self.addresses = Tally(), Tally(), Tally()

    def address(self, scope: Scope) -> str:
        client = scope.get("client")
        return client_address(client[0] if client else None, scope.get("headers", ()), self.trusted)


def _too_many(detail: str) -> StarletteHTTPException:
    return StarletteHTTPException(429, detail, headers={"Retry-After": str(RETRY_AFTER_S)})


def hold_key(scope: Scope, limits: Limits, key_id: str, stream: bool) -> None:
    """Count an authenticated request against its key (and its stream cap); 429 past either. Given back when
    the request ends (see `admit`)."""
    held: list[Callable[[], None]] | None = scope.get(HELD)
    if held is None:  # not admitted through `admit` (an in-process call): nothing would give the slot back
        return
    opts = limits.options
    release = limits.requests.take(key_id, opts.max_requests_per_key)
    if release is None:
        raise _too_many(
            f"this key has {opts.max_requests_per_key} requests open on this server (max_requests_per_key); "
            "retry when one has ended"
        )
    held.append(release)
    if stream:
        release = limits.streams.take(key_id, opts.max_streams_per_key)
        if release is None:
            raise _too_many(
                f"this key has {opts.max_streams_per_key} event streams and long-polls open on this server "
                "(max_streams_per_key); close one or retry later"
            )
        held.append(release)


async def _refuse(send: Send, status: int, detail: str, headers: dict[str, str]) -> None:
    body = orjson.dumps({"error": "too_many_requests", "detail": detail})
    raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _keyless(scope: Scope) -> bool:
    """No key presented (or a provider webhook, which never has one): counted against the client address."""
    return scope["path"].startswith(_HOOKS) or not any(name in _CREDENTIALS for name, _ in scope["headers"])


async def admit(state: ServerState, scope: Scope, receive: Receive, send: Send, app: ASGIApp) -> None:
    """Run one HTTP request through `app` with its body deadline and its address slot; give back whatever it
    held when it ends, however it ends (a stream cut by its client included)."""
    limits, opts = state.limits, state.options
    held: list[Callable[[], None]] = []
    scope[HELD] = held
    try:
        if _keyless(scope):
            release = limits.addresses.take(limits.address(scope), opts.max_requests_per_address)
            if release is None:
                detail = (
                    f"this address has {opts.max_requests_per_address} requests without an API key open on this "
                    "server (max_requests_per_address); retry later"
                )
                await _refuse(send, 429, detail, {"Retry-After": str(RETRY_AFTER_S)})
                return
            held.append(release)
        await app(scope, BodyDeadline(receive, opts), send)
    finally:
        for release in held:
            release()


class BodyDeadline:
    """`receive` with the body deadline (see the module docstring). Once the body is complete, it is the
    connection's own `receive` again: a stream listens on it for the client leaving, for as long as it runs."""

    __slots__ = ("_deadline", "_done", "_expired", "_rate", "_receive", "_seconds")

    def __init__(self, receive: Receive, options: ServerOptions) -> None:
        self._receive = receive
        self._seconds, self._rate = options.body_timeout_s, float(options.body_min_rate)
        self._deadline: float | None = None
        self._done = self._expired = False

    async def __call__(self) -> Message:
        if self._done:
            return await self._receive()
        if self._expired:
            raise BodyTimeout(self._seconds)
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self._seconds
        try:
            message = await within(self._receive(), max(0.0, self._deadline - now))
        except TimeoutError:
            self._expired = True
            raise BodyTimeout(self._seconds) from None
        if message["type"] == "http.request":
            self._deadline += len(message.get("body", b"")) / self._rate
            self._done = not message.get("more_body", False)
        else:
            self._done = True
        return message
