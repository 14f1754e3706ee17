"""Shared HTTP plumbing for every backend: one pooled client, one mapping from responses and transport errors to
the error classes the worker acts on, and secret-free excerpts.

The mapping lives in one place because the worker's whole reaction (cool down, retry later, dead-letter now,
resubmit) hangs on the error class: the same HTTP situation must mean the same thing for every provider.
Rules: 429 -> Throttled (Retry-After seconds or HTTP-date, `retry-after-ms`, or Replicate's "Expected available
in N second" hint); 408/409, 5xx, timeouts, connection errors and unreadable 2xx bodies -> Transient; 404 on a
remote job we know -> NotFound (it expired), any other 404 -> Fatal; other 3xx/4xx -> Fatal; a 2xx answer longer
than the backend's `max_response_bytes` -> TooLarge (reading stops at the limit).
And whether the provider may have accepted the request (`maybe_accepted`, which decides whether a failed submit's
intent stays open and a resend is counted): yes for 502/503/504 and 520-527 (a gateway such as nginx, an ALB or
Cloudflare answers these when the provider was slow or dropped the connection, often after it took the request),
for a timeout or a broken connection once the request was on its way, and for an unreadable 2xx; no for a
connection that was never made (refused, DNS, connect or pool timeout: nothing was sent) and for any other
answer, which is the provider's own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar

import httpx
import orjson

from offload.backends.base import BackendError, Fatal, NotFound, Throttled, TooLarge, Transient
from offload.backends.settings import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_TIMEOUT
from offload.backends.transport import ACCEPT_ENCODING, AiohttpTransport, bounded_response, fast_path, read_bounded
from offload.http_client import make_client, tls_context
from offload.redact import bare_url, excerpt  # the one redaction path (offload/redact.py)

log = logging.getLogger("offload.backends")

NO_KEY = "none"

_AVAILABLE_IN = re.compile(r"(?i)expected available in (\d+(?:\.\d+)?) second")
# Statuses a gateway in front of the provider answers when the provider was slow or cut the connection: the
# request may have been taken (see the module docstring).
UNKNOWN_OUTCOME = frozenset({502, 503, 504, *range(520, 528)})
# Transport errors raised before any byte of the request left: the provider cannot have taken it.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_warned: set[tuple[str, str]] = set()


def user_agent(worker_id: str | None = None) -> str:
    """`offload/<version>`, and ` worker/<id>` for a worker's requests: a provider's log (and the simulator's)
    then names the process that made each submission."""
    from offload import __version__  # at call time: the package imports this module's users

    return f"offload/{__version__}" + (f" worker/{worker_id}" if worker_id else "")


def new_client(
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    timeout: float = DEFAULT_TIMEOUT,
    agent: str | None = None,
    per_host: int = 0,
    egress: bool = False,
) -> httpx.AsyncClient:
    """A client sized for thousands of concurrent polls, on aiohttp's pool (see `transport`): every connection
    may be kept alive, so a poll burst reuses sockets instead of paying a TLS handshake each; requests beyond the
    limit wait for a free connection (up to `timeout`, then Transient). No default auth header: one client may be
    shared by several backends. `agent`: the User-Agent of every request (default `user_agent()`). `per_host`:
    at most this many connections to any one host as well (0: only the total). `egress`: for URLs a provider or
    an input named, every connection obeys offload.egress (the request's FilePolicy)."""
    transport = AiohttpTransport(
        max_connections=max_connections, ssl_context=tls_context(), per_host=per_host, egress=egress
    )
    return make_client(
        "backend",
        timeout=timeout,
        transport=transport,
        follow_redirects=False,
        headers={"User-Agent": agent or user_agent()},
    )


def retry_after(response: httpx.Response, now: datetime | None = None) -> float | None:
    """Seconds the provider asked us to wait, or None when it did not say."""
    headers = response.headers
    if (ms := headers.get("retry-after-ms")) is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    if (value := headers.get("retry-after")) is not None:
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            when = None
        if when is not None:
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)
            return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    if m := _AVAILABLE_IN.search(response.text):
        return float(m[1])
    return None


def error_for_response(
    response: httpx.Response, *, what: str, known: bool = False, secrets: Iterable[str | None] = ()
) -> BackendError:
    """The error class for a non-2xx response. `known`: the URL names a remote job we submitted, so a 404 means
    it expired at the provider (NotFound: submit again) rather than a wrong URL or id (Fatal)."""
    status = response.status_code
    body = excerpt(response.text, secrets)
    message = f"{what}: HTTP {status}" + (f": {body}" if body else "")
    if status == 429:
        return Throttled(message, retry_after=retry_after(response), status=status, excerpt=body)
    if status in (408, 409) or status >= 500:
        return Transient(message, status=status, excerpt=body, maybe_accepted=status in UNKNOWN_OUTCOME)
    if status == 404 and known:
        return NotFound(message, status=status, excerpt=body)
    if 300 <= status < 400:
        where = bare_url(response.headers["location"]) if response.headers.get("location") else "?"
        return Fatal(f"{message} (redirect to {where}: check base_url)", status=status, excerpt=body)
    return Fatal(message, status=status, excerpt=body)


def error_for_exception(exc: Exception, *, what: str, secrets: Iterable[str | None] = ()) -> BackendError:
    """Transport problems are Transient, except a URL httpx cannot even try (a typo in base_url), which no retry
    can fix. The provider may have taken the request unless the connection was never made."""
    detail = excerpt(f"{type(exc).__name__}: {exc}", secrets)
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return Fatal(f"{what}: {detail} (check base_url)")
    sent = not isinstance(exc, _NOT_SENT)
    if isinstance(exc, httpx.TimeoutException):
        return Transient(f"{what}: timed out ({detail})", maybe_accepted=sent)
    return Transient(f"{what}: {detail}", maybe_accepted=sent)


def decode(response: httpx.Response, *, what: str, secrets: Iterable[str | None] = ()) -> Any:
    """The JSON body of a 2xx answer; garbage is Transient (a proxy or a provider hiccup, worth another try)."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        body = excerpt(response.text, secrets)
        raise Transient(
            f"{what}: response is not valid JSON: {body}",
            status=response.status_code,
            excerpt=body,
            maybe_accepted=response.is_success,  # a 2xx the provider sent, garbled on its way: it took the request
        ) from None


def require(
    body: Any, name: str, kind: type | tuple[type, ...], *, what: str, secrets: Iterable[str | None] = ()
) -> Any:
    """`body[name]`, checked to be of `kind`; a missing or mistyped field is a malformed answer (Transient)."""
    if not isinstance(body, dict):  # (a 2xx: the provider took the request, see the module docstring)
        raise Transient(
            f"{what}: expected a JSON object, got {type(body).__name__}",
            excerpt=excerpt(repr(body), secrets),
            maybe_accepted=True,
        )
    value = body.get(name)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if name not in body or not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        try:
            body_text = excerpt(orjson.dumps(body, default=str).decode(), secrets)
        except orjson.JSONEncodeError:
            body_text = excerpt(repr(body), secrets)
        raise Transient(f"{what}: response lacks a valid {name!r}: {body_text}", excerpt=body_text, maybe_accepted=True)
    return value


def warn_unknown_status(kind: str, status: str) -> None:
    """Providers add statuses (Replicate's `aborted`); an unknown one is treated as still running, and said once
    per process so a fleet of polls does not flood the log."""
    if (kind, status) not in _warned:
        _warned.add((kind, status))
        log.warning("%s: unknown remote status %r, treated as not finished", kind, status)


def same_origin(url: str, base: str) -> bool:
    a, b = httpx.URL(url), httpx.URL(base)
    return (a.scheme, a.host, a.port) == (b.scheme, b.host, b.port)


def tagged_url(base: str, tag: str, param: str = "offload_tag") -> str:
    """A webhook URL carrying offload's job id, so a receiver (or a listing) can tie a submission to its job."""
    return str(httpx.URL(base).copy_merge_params({param: tag}))


class HttpBackend:
    """What every backend shares: the (possibly shared) client, per-request auth and timeout, and error mapping.
    A client passed in belongs to the caller and is not closed by `aclose`."""

    kind: ClassVar[str] = "http"
    auth_scheme: ClassVar[str] = "Bearer"
    synchronous: bool = False  # see Backend

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        client: httpx.AsyncClient | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._timeout = timeout
        self._max_bytes = max_response_bytes
        self._owns_client = client is None
        self._client = client or new_client(max_connections=max_connections, timeout=timeout)
        self._fast = fast_path(self._client)
        self._agent = self._client.headers.get("User-Agent") or user_agent()

    def __repr__(self) -> str:  # never the key
        return f"{type(self).__name__}(name={self.name!r}, base_url={self.base_url!r})"

    def _what(self, method: str, url: str) -> str:
        return f"{self.kind} backend {self.name!r}: {method} {httpx.URL(url).copy_with(query=None)}"

    async def _send(
        self, method: str, url: str, *, json: Any = None, has_body: bool = False, idempotency_key: str | None = None
    ) -> httpx.Response:
        """One request; transport failures become BackendErrors, HTTP statuses are left to the caller."""
        # Without a key, a placeholder credential still goes out: the simulator and keyless local servers accept
        # any, and a real provider answers 401 (Fatal) just as it would to no header at all.
        headers = {"Authorization": f"{self.auth_scheme} {self._api_key or NO_KEY}"}
        if idempotency_key is not None:  # the IETF httpapi draft's header: a repeat returns the first answer
            headers["Idempotency-Key"] = idempotency_key
        try:
            content = orjson.dumps(json) if has_body else None
        except orjson.JSONEncodeError as exc:  # e.g. an integer beyond 64 bits: bad input, not a crash
            raise Fatal(f"{self._what(method, url)}: the request body is not serialisable as JSON: {exc}") from None
        if content is not None:
            headers["Content-Type"] = "application/json"
        headers["Accept-Encoding"] = ACCEPT_ENCODING  # see transport.bounded_response
        try:
            if self._fast is not None:  # the hot path: no httpx.Request built, no httpx pool walked
                headers["User-Agent"] = self._agent
                return await self._fast.send(
                    method, url, headers=headers, content=content, timeout=self._timeout, limit=self._max_bytes
                )
            return await self._bounded(method, url, content=content, headers=headers)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise error_for_exception(exc, what=self._what(method, url), secrets=[self._api_key]) from None
        except TooLarge as exc:
            raise TooLarge(
                f"{self._what(method, url)}: the answer is larger than max_response_bytes ({self._max_bytes} bytes, "
                f"backends.{self.name}.max_response_bytes); reading stopped there. A large output belongs in "
                "files (a URL the output names is copied to storage)",
                status=exc.status,
                maybe_accepted=True,
            ) from None

    async def _bounded(
        self, method: str, url: str, *, content: bytes | None, headers: dict[str, str]
    ) -> httpx.Response:
        """`_send` through httpx's own API (a client not made by `new_client`): streamed, so that an answer over
        `max_response_bytes` is not read past the limit either."""
        async with self._client.stream(
            method, url, content=content, headers=headers, timeout=self._timeout
        ) as response:
            raw = await read_bounded(
                response.aiter_raw(), self._max_bytes, ok=response.is_success, status=response.status_code
            )
        return bounded_response(response.status_code, response.headers, raw, self._max_bytes)

    async def _call(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        has_body: bool = False,
        known: bool = False,
        idempotency_key: str | None = None,
    ) -> Any:
        """A request whose 2xx answer is JSON; everything else raises the mapped error."""
        response = await self._send(method, url, json=json, has_body=has_body, idempotency_key=idempotency_key)
        if not 200 <= response.status_code < 300:
            raise error_for_response(response, what=self._what(method, url), known=known, secrets=[self._api_key])
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError:  # rare: only now pay for naming the request
            return decode(response, what=self._what(method, url), secrets=[self._api_key])

    def _fail(self, response: httpx.Response, method: str, url: str, *, known: bool) -> BackendError:
        return error_for_response(response, what=self._what(method, url), known=known, secrets=[self._api_key])

    def _require(self, body: Any, name: str, kind: type | tuple[type, ...], what: str) -> Any:
        return require(body, name, kind, what=f"{self.kind} backend {self.name!r}: {what}", secrets=[self._api_key])

    def _redact(self, text: str) -> str:
        return excerpt(text, [self._api_key], limit=1000)

    async def find(self, tag: str) -> str | None:
        """Unsupported unless a subclass can list its submissions by tag."""
        return None

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
