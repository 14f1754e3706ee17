"""The simulator's webhook client: HTTP/1.1 POSTs over a small keep-alive pool of plain asyncio streams.

The simulator stands in for a provider on another machine, yet in the benchmarks it shares the cores with the
offload server and worker it serves, and through aiohttp's client a delivery cost more of its CPU than the job's
create (docs/explanation/performance.md, *The simulator*). A webhook is one small POST with a known body whose
answer only matters by its status, so this sends the bytes itself and reads the answer (`Content-Length`,
chunked, or until the connection closes).

Connections are kept per (scheme, host, port) for `idle_s`, at most `limit` requests at once. A request on a
reused connection that fails before any byte of an answer (the receiver closed it while it sat idle) is sent
once more on a new connection; any other failure raises `SendError` (a timeout, `TimeoutError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from offload.errors import OffloadError

MAX_HEAD = 64 << 10
MAX_BODY = 1 << 20  # a receiver's answer is read to reuse the connection; nothing this large is expected


class SendError(OffloadError):
    """The request got no usable answer (refused, reset, malformed); the message says which."""


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class LeanPost:
    """`await post(url, body, headers)` -> the answer's status code."""

    def __init__(self, *, limit: int, timeout_s: float, idle_s: float = 60.0, agent: str = "offload-sim") -> None:
        self._gate = asyncio.Semaphore(limit)
        self._timeout_s, self._idle_s, self._agent = timeout_s, idle_s, agent
        self._idle: dict[tuple[str, str, int], list[tuple[_Conn, float]]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> int:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SendError(f"not an http(s) URL: {url[:100]}")
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]
        head = [f"POST {target} HTTP/1.1", f"Host: {host}", f"User-Agent: {self._agent}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        head.append(f"Content-Length: {len(body)}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        async with self._gate, asyncio.timeout(self._timeout_s):
            for reused in (True, False):
                conn = self._take(key) if reused else None
                if reused and conn is None:
                    continue
                conn = conn or await self._open(key)
                try:
                    conn[1].write(request)
                    status, keep = await _answer(conn[0])
                except (OSError, asyncio.IncompleteReadError, SendError) as exc:
                    _close(conn)
                    if reused and isinstance(exc, asyncio.IncompleteReadError) and not exc.partial:
                        continue  # closed by the receiver while idle: nothing was answered, send it again
                    raise SendError(f"{type(exc).__name__}: {exc}") from None
                except BaseException:  # cancelled or timed out mid-answer: the connection is in an unknown state
                    _close(conn)
                    raise
                if keep:
                    self._idle.setdefault(key, []).append((conn, time.monotonic()))
                else:
                    _close(conn)
                return status
        raise AssertionError("unreachable")

    def _take(self, key: tuple[str, str, int]) -> _Conn | None:
        pool = self._idle.get(key)
        now = time.monotonic()
        while pool:
            conn, since = pool.pop()
            if now - since < self._idle_s and not conn[0].at_eof() and not conn[1].is_closing():
                return conn
            _close(conn)
        return None

    async def _open(self, key: tuple[str, str, int]) -> _Conn:
        scheme, host, port = key
        context = None
        if scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            context = self._ssl
        try:
            return await asyncio.open_connection(host, port, ssl=context, limit=MAX_HEAD)
        except OSError as exc:
            raise SendError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None

    async def aclose(self) -> None:
        for pool in self._idle.values():
            for conn, _ in pool:
                _close(conn)
        self._idle.clear()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Read one answer: (status, whether the connection may carry another request)."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise SendError("answer headers too large") from None
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise SendError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip().lower()
    keep = version == "HTTP/1.1" and "close" not in fields.get("connection", "")
    if "chunked" in fields.get("transfer-encoding", ""):
        await _chunks(reader)
    elif (length := fields.get("content-length")) is not None:
        if not length.isdigit() or int(length) > MAX_BODY:
            raise SendError(f"unusable Content-Length: {length[:20]!r}")
        await reader.readexactly(int(length))
    elif int(code) not in (204, 304) and not 100 <= int(code) < 200:
        await reader.read(MAX_BODY)  # no length: the body runs until the receiver closes
        keep = False
    return int(code), keep


async def _chunks(reader: asyncio.StreamReader) -> None:
    total = 0
    while True:
        size_line = (await reader.readuntil(b"\r\n")).split(b";")[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise SendError("malformed chunked answer") from None
        total += size
        if total > MAX_BODY:
            raise SendError("answer too large")
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                pass
            return
        await reader.readexactly(size + 2)


def _close(conn: _Conn) -> None:
    with contextlib.suppress(Exception):
        conn[1].close()
