"""The ways a provider misbehaves, as reusable pieces: outages, 429 hints, garbage bodies, dropped connections,
a gateway's error page.

Each family renders these in its own dialect (see `engine.Dialect`); this module holds what is common: whether
an outage window is open, how Retry-After is spelled, how a good body is turned into a bad one, and how to drop
a TCP connection with a reset so the client sees a transport error rather than any HTTP response.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, Literal

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from offload.testing.sim.config import Behaviour, OutageWindow

RAW_SEND_KEY = "offload.testing.sim.raw_send"  # set by the app's outermost layer: uvicorn's own `send`


@dataclass(slots=True)
class RuntimeOutage:
    """An outage toggled through `POST /_sim/outage`; absolute clock times."""

    family: str | None  # None: every family
    mode: Literal["503", "reset", "429"]
    start: float
    end: float | None


def outage_mode(
    behaviour: Behaviour, family: str, now: float, applied_at: float, runtime: list[RuntimeOutage]
) -> Literal["503", "reset", "429"] | None:
    """The mode of the first open window (config windows are relative to when the config was applied)."""
    elapsed = now - applied_at
    for window in behaviour.outages:
        if _open(window, elapsed):
            return window.mode
    for outage in runtime:
        if outage.family in (None, family) and outage.start <= now and (outage.end is None or now < outage.end):
            return outage.mode
    return None


def _open(window: OutageWindow, elapsed: float) -> bool:
    return window.start <= elapsed and (window.end is None or elapsed < window.end)


def retry_after_value(behaviour: Behaviour, now: float) -> str:
    """Delay-seconds are integers in HTTP; round up so a client never retries early."""
    seconds = behaviour.retry_after_seconds
    if behaviour.retry_after_format == "http-date":
        return formatdate(now + seconds, usegmt=True)
    whole = int(seconds) if seconds == int(seconds) else int(seconds) + 1
    return str(whole)


def garble(body: Any, behaviour: Behaviour, rng: random.Random, required: tuple[str, ...]) -> bytes:
    """A 200 body a client must survive: truncated JSON, or valid JSON without the fields it needs."""
    kind = behaviour.malformed_kind
    if kind == "mixed":
        kind = "invalid_json" if rng.random() < 0.5 else "missing_fields"
    if kind == "missing_fields" and isinstance(body, dict):
        stripped = {k: v for k, v in body.items() if k not in required}
        if len(stripped) == len(body) and body:
            stripped.pop(next(iter(body)))
        return orjson.dumps(stripped)
    blob = orjson.dumps(body)
    return blob[: max(1, len(blob) // 2)] + b'",<'


_GATEWAY_TITLES = {502: "Bad Gateway", 503: "Service Temporarily Unavailable", 504: "Gateway Time-out"}


def gateway_page(status: int) -> Response:
    """What a gateway in front of the API answers when the provider was slow or dropped the connection: nginx's
    HTML page for 50x, Cloudflare's for 52x (524: the origin took longer than 100 s). Never the provider's JSON."""
    if 520 <= status <= 527:
        body = (
            f"<!DOCTYPE html>\n<html><head><title>api.example.com | {status}: A timeout occurred</title></head>"
            f'<body><div id="cf-error-details"><h1>A timeout occurred</h1><span>Error code {status}</span>'
            "<p>The origin web server timed out responding to this request.</p>"
            "<span>Cloudflare Ray ID: 8f1e2d3c4b5a6978</span></div></body></html>\n"
        )
        headers = {"server": "cloudflare", "cf-ray": "8f1e2d3c4b5a6978-AMS"}
    else:
        title = f"{status} {_GATEWAY_TITLES.get(status, 'Server Error')}"
        body = (
            f"<html>\r\n<head><title>{title}</title></head>\r\n<body>\r\n<center><h1>{title}</h1></center>\r\n"
            "<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
        )
        headers = {"server": "nginx"}
    return Response(body, status_code=status, headers=headers, media_type="text/html")


class ConnectionReset(Response):
    """Drop the connection with a TCP reset and no HTTP response (an outage in `reset` mode, or a submit
    whose answer is lost after the job was created).

    ASGI hides the socket, so this finds uvicorn's transport through the `send` the outermost layer saved
    (a bound method of uvicorn's request cycle). Without it, it falls back to starting a response and
    abandoning it mid-body, which clients also see as a broken connection.
    """

    def __init__(self) -> None:
        super().__init__(status_code=599)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get(RAW_SEND_KEY)
        transport = getattr(getattr(raw, "__self__", None), "transport", None)
        if transport is not None and hasattr(transport, "abort"):
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            # Let the server notice the disconnect before the app returns, so it does not log a 500.
            for _ in range(3):
                await asyncio.sleep(0)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1000")]})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        raise ConnectionAbortedError("simulated connection reset")
