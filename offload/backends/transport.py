"""An httpx transport on aiohttp's connection pool, for processes with thousands of requests in flight.

httpcore's pool re-scans every queued request and every connection whenever one changes state
(encode/httpcore#1035), so its cost per request grows with concurrency (the figures: docs/explanation/
performance.md, *HTTP transport*). The backends keep speaking
httpx (requests, responses, exceptions: one error mapping for every provider); only the wire moves to aiohttp.
`send` is a shorter path for the backends' hot loop (submit and poll): it skips building an httpx.Request.
Both roads read a backend's answer through `read_bounded` and `bounded_response`, so an answer is never read, nor
decompressed, past the backend's `max_response_bytes`: one huge answer must not grow (or kill) the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import zlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import httpx
import yarl

from offload.backends.base import TooLarge
from offload.egress import POLICY, AddressRefused, FilePolicy, Reach, socket_factory

CHUNK = 64 * 1024
# What a backend's request accepts: no compression (a JSON answer is small, and decoding costs the loop CPU); an
# answer compressed all the same is decoded by `bounded_response` if it can bound it.
ACCEPT_ENCODING = "identity"
_INFLATE = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


_REDIRECTS = frozenset((301, 302, 303, 307, 308))
# Sent as is (encoded=True): every character already legal in a URL, so httpx would send the same bytes.
_PLAIN_URL = re.compile(r"https?://[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+", re.IGNORECASE)


class PlainBody:
    """A response of `AiohttpTransport.get_plain`: status, headers, and the body's chunks (aiohttp's failures
    raised as the httpx exceptions every caller already maps)."""

    def __init__(self, response: aiohttp.ClientResponse, url: str) -> None:
        self._response, self._url = response, url
        self.status = response.status
        self.headers = response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_chunked(CHUNK):
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _httpx_error(exc, httpx.Request("GET", self._url)) from exc


class _Body(httpx.AsyncByteStream):
    """A streamed aiohttp body that hands the connection back when httpx closes the response."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_chunked(CHUNK):
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _httpx_error(exc, self._request) from exc

    async def aclose(self) -> None:
        self._response.release()


async def read_bounded(chunks: AsyncIterator[bytes], limit: int, *, ok: bool, status: int) -> bytes:
    """A body read up to `limit` bytes. A success answer (`ok`) over it raises TooLarge, with the rest unread
    (the caller's context closes the connection); an error answer is cut at the limit, since only an excerpt of it
    is ever read."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            if ok:
                raise TooLarge(f"answer over {limit} bytes", status=status, maybe_accepted=True)
            del body[limit:]
            break
    return bytes(body)


def bounded_response(
    status: int, headers: httpx.Headers | list[tuple[bytes, bytes]], raw: bytes, limit: int | None
) -> httpx.Response:
    """The response to hand a backend: `raw` as the body, or decoded when it came compressed (gzip or deflate),
    then to at most `limit` bytes too (zlib's `max_length`: a small compressed answer can inflate a thousandfold,
    and httpx's own decoding has no bound). Another encoding is a decoding error (Transient, as a garbled
    answer): a backend's request asks for none."""
    if limit is None or not _encoded(headers):
        return httpx.Response(status, headers=headers, content=raw)
    parsed = httpx.Headers(headers)
    encoding = parsed.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return httpx.Response(status, headers=parsed, content=raw)
    wbits = _INFLATE.get(encoding)
    if wbits is None:
        raise httpx.DecodingError(f"answer in Content-Encoding {encoding!r}, which was not asked for")
    try:
        body = _inflate(raw, wbits, limit)
    except zlib.error:
        if encoding != "deflate":
            raise httpx.DecodingError(f"answer in Content-Encoding {encoding!r} does not decode") from None
        try:
            body = _inflate(raw, -zlib.MAX_WBITS, limit)  # raw deflate, without zlib's header, as some servers send
        except zlib.error:
            raise httpx.DecodingError("answer in Content-Encoding 'deflate' does not decode") from None
    if len(body) > limit:
        if 200 <= status < 300:
            raise TooLarge(f"answer over {limit} bytes once decompressed", status=status, maybe_accepted=True)
        body = body[:limit]
    kept = [(k, v) for k, v in parsed.multi_items() if k.lower() not in ("content-encoding", "content-length")]
    return httpx.Response(status, headers=kept, content=body)


def _encoded(headers: httpx.Headers | list[tuple[bytes, bytes]]) -> bool:
    if isinstance(headers, httpx.Headers):
        return "content-encoding" in headers
    return any(k.lower() == b"content-encoding" for k, _ in headers)


def _inflate(raw: bytes, wbits: int, limit: int) -> bytes:
    """At most `limit` + 1 bytes of `raw` decompressed: one past the limit says it is over."""
    return zlib.decompressobj(wbits).decompress(raw, limit + 1)


def _timeout(value: Mapping[str, float | None] | float | None) -> aiohttp.ClientTimeout:
    """httpx's per-phase timeouts in aiohttp's terms (no overall deadline: a slow but moving body is fine)."""
    if value is None or isinstance(value, int | float):
        return aiohttp.ClientTimeout(total=None, sock_connect=value, sock_read=value)
    pool, connect = value.get("pool"), value.get("connect")
    wait = None if pool is None and connect is None else (pool or 0.0) + (connect or 0.0)
    return aiohttp.ClientTimeout(total=None, connect=wait, sock_connect=connect, sock_read=value.get("read"))


def _refused(exc: BaseException) -> AddressRefused | None:
    """The egress rule's refusal behind a failed connect (raised as itself, not as a network error: a refusal
    is not worth retrying)."""
    cause = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else None
    return cause if isinstance(cause, AddressRefused) else None


def _httpx_error(exc: BaseException, request: httpx.Request) -> httpx.HTTPError:
    """aiohttp's failures as the httpx exceptions the error mapping already understands."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(text, request=request)
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(text, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(text, request=request)
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(text, request=request)
    return httpx.NetworkError(text, request=request)


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Every connection of the process in one aiohttp pool. The session is made lazily, inside the event
    loop that uses it. Redirects, cookies and decompression stay httpx's business."""

    def __init__(
        self, *, max_connections: int, ssl_context: ssl.SSLContext, per_host: int = 0, egress: bool = False
    ) -> None:
        self._limit = max_connections
        self._per_host = per_host  # 0: no limit per host, only the total
        self._ssl = ssl_context
        # egress: every connection obeys offload.egress (the request's FilePolicy, else public addresses only),
        # one pool per reach, so a connection opened for a backend's own host never serves another's request
        self.enforces_egress = egress
        self._sessions: dict[Reach | None, aiohttp.ClientSession] = {}

    def _pool(self, reach: Reach | None = None) -> aiohttp.ClientSession:
        key = (reach or Reach.PUBLIC) if self.enforces_egress else None
        session = self._sessions.get(key)
        if session is None:
            connector = aiohttp.TCPConnector(
                limit=self._limit,
                limit_per_host=self._per_host,
                ssl=self._ssl,
                ttl_dns_cache=60,
                socket_factory=None if key is None else socket_factory(key),
            )
            session = self._sessions[key] = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        return session

    def _reach(self, url: yarl.URL, policy: Any) -> Reach | None:
        """The pool a request of an egress transport takes (None for any other): its FilePolicy's verdict on the
        URL exactly as aiohttp will connect to it, or AddressRefused for a host the policy does not list."""
        if not self.enforces_egress:
            return None
        rule = policy if isinstance(policy, FilePolicy) else FilePolicy()
        return rule.check(url.scheme, url.host or "", url.port)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {request.url.scheme!r}", request=request)
        body = await request.aread()
        url = yarl.URL(str(request.url), encoded=True)  # httpx's bytes, as httpx would send them
        pool = self._pool(self._reach(url, request.extensions.get(POLICY)))
        try:
            response = await pool.request(
                request.method,
                url,
                headers=request.headers.multi_items(),
                data=body or None,
                allow_redirects=False,
                timeout=_timeout(request.extensions.get("timeout")),
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _refused(exc) or _httpx_error(exc, request) from exc
        return httpx.Response(
            response.status, headers=list(response.raw_headers), stream=_Body(response, request), request=request
        )

    async def send(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str],
        content: bytes | None,
        timeout: float,
        limit: int | None = None,
    ) -> httpx.Response:
        """One buffered request without building an httpx.Request first; raises httpx exceptions, and TooLarge
        for a success answer over `limit` bytes (see `read_bounded`)."""
        try:
            async with self._pool().request(
                method, url, headers=headers, data=content, allow_redirects=False, timeout=_timeout(timeout)
            ) as response:
                status, size = response.status, response.content_length
                if limit is None or (size is not None and size <= limit):
                    raw = await response.read()  # the common case: a declared length within the limit
                else:
                    try:
                        ok = 200 <= status < 300
                        raw = await read_bounded(response.content.iter_chunked(CHUNK), limit, ok=ok, status=status)
                    finally:
                        if not response.content.at_eof():
                            response.close()  # the rest unread: this connection cannot serve another request
                raw_headers = list(response.raw_headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _httpx_error(exc, httpx.Request(method, url)) from exc
        except ValueError as exc:  # yarl's verdict on a URL it cannot parse
            raise httpx.InvalidURL(str(exc)) from exc
        return bounded_response(status, raw_headers, raw, limit)

    @contextlib.asynccontextmanager
    async def get_plain(
        self, url: str, *, headers: Mapping[str, str], timeout: httpx.Timeout, policy: FilePolicy | None = None
    ) -> AsyncIterator[PlainBody | None]:
        """A streamed GET of `url` straight on aiohttp, for copying a provider's file: the body as it came, or
        None when httpx must take the request instead (the URL needs httpx's encoding, or the answer is a
        redirect, whose header policy is httpx's, or an encoded body, which httpx decodes). Per file this skips
        httpx's request building, URL parsing, auth and redirect layers and cookie jar, a large share of a burst
        of copies (docs/explanation/performance.md, *HTTP transport*). On an egress
        transport `policy` decides where it may connect (offload.egress), as for a request through httpx."""
        if not _PLAIN_URL.fullmatch(url):
            yield None
            return
        target = yarl.URL(url, encoded=True)
        pool = self._pool(self._reach(target, policy))
        try:
            response = await pool.get(
                target,
                headers={**headers, "Accept-Encoding": "identity"},
                allow_redirects=False,
                timeout=_timeout(timeout.as_dict()),
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _refused(exc) or _httpx_error(exc, httpx.Request("GET", url)) from exc
        try:
            encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
            if response.status in _REDIRECTS or encoding not in ("", "identity"):
                yield None
            else:
                yield PlainBody(response, url)
        finally:
            response.release()

    async def aclose(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
        if sessions:
            await asyncio.sleep(0)  # let aiohttp finish closing its sockets before the loop goes away


def fast_path(client: httpx.AsyncClient) -> AiohttpTransport | None:
    """The aiohttp transport behind `client`, when it has one (clients made by `new_client`)."""
    transport: Any = getattr(client, "_transport", None)
    return transport if isinstance(transport, AiohttpTransport) else None
