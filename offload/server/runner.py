"""Run the server: `serve` in the foreground (`offload server`), `running_server` in a thread (tests, embedding).

Both are real uvicorn servers on a real socket. SSE streams and long polls would hold a graceful shutdown
open for their whole timeout, so the shutdown grace is short: clients of both reconnect by design.

Connection hygiene for a server on the internet: uvicorn's own settings bound concurrent connections and
requests (`limit_concurrency`: 503 past `max_connections`) and idle keep-alive connections
(`timeout_keep_alive`), but uvicorn has no deadline for a request's headers, so a client that opens a
connection and trickles (or never sends) its headers holds a socket forever; `_HeaderDeadline` closes such a
connection after `header_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from offload.redact import hook_paths
from offload.server.app import create_app
from offload.server.state import ServerOptions, ServerState

START_TIMEOUT = 20.0
GRACEFUL_SHUTDOWN = 3


def _header_deadline(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11) with a deadline for each request's headers:
    armed when the connection opens and after every response, met when a new request's headers are parsed
    (the protocol then starts a new request cycle)."""

    class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _waiting_from: object = None

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._waiting_from = self.cycle
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            if self.cycle is self._waiting_from and not self.transport.is_closing():
                self.transport.close()  # no request headers since the deadline was armed

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

    return HeaderDeadline


class _HookPathFilter(logging.Filter):
    """uvicorn's access log prints each request's path; a webhook path ends in its submission's secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(hook_paths(a) if isinstance(a, str) else a for a in record.args)
        return True


class _StartupFailure(logging.Filter):
    """Drops uvicorn's report of a failed start-up (the whole traceback, then "Application startup failed") when
    the app recorded why it failed: `serve` raises that instead, which the command prints as one line."""

    def __init__(self, app: object) -> None:
        super().__init__()
        self.app = app

    def failure(self) -> BaseException | None:
        found: BaseException | None = getattr(getattr(self.app, "state", None), "startup_error", None)
        return found

    def filter(self, record: logging.LogRecord) -> bool:
        return self.failure() is None


# The worker protocol's routine calls: every GPU worker heartbeats every few seconds and long-polls its claims,
# producers long-poll /wait. One INFO line each buried everything else; a failed one (4xx/5xx) is still logged.
_ROUTINE = re.compile(r"^/v1/(workers/[^/?]+/(heartbeat|claim)|jobs/[^/?]+/wait)(\?|$)")


class _RoutineFilter(logging.Filter):
    """Leaves heartbeats, claims and long-polls that succeeded out of uvicorn's access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5:
            return True
        path, status = args[2], args[4]
        return not (isinstance(path, str) and _ROUTINE.match(path) and isinstance(status, int) and status < 400)


class _Server(uvicorn.Server):
    """uvicorn's server, ending the long polls and event streams as its shutdown begins: uvicorn waits for the
    requests in flight (GRACEFUL_SHUTDOWN) and then cancels them, and a cancelled claim logged a traceback on
    every deploy and could fall between taking jobs and answering with them."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state: ServerState | None = getattr(getattr(self.config.app, "state", None), "offload", None)
        if state is not None:
            state.hub.stop_waits()
        await super().shutdown(sockets)


def _server(options: ServerOptions, host: str, port: int, log_level: str, access_log: bool) -> _Server:
    access = logging.getLogger("uvicorn.access")
    for kind in (_HookPathFilter, _RoutineFilter):
        if not any(isinstance(f, kind) for f in access.filters):
            access.addFilter(kind())
    config = uvicorn.Config(
        create_app(options),
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        http=_header_deadline(options.header_timeout_s),
        limit_concurrency=options.max_connections,
        timeout_keep_alive=30,
        backlog=4096,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
        lifespan="on",
        proxy_headers=False,
    )
    return _Server(config)


def serve(
    options: ServerOptions,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    log_level: str = "info",
    access_log: bool = True,
) -> None:
    """Serve until SIGTERM/SIGINT. Access logs hold method, path and status only (keys travel in headers). A
    start-up that fails (the store unreachable, its replicas missing) raises why, for one error line."""
    server = _server(options, host, port, log_level, access_log)
    quiet = _StartupFailure(server.config.app)
    errors = logging.getLogger("uvicorn.error")
    errors.addFilter(quiet)
    try:
        server.run()  # a failed start-up ends in SystemExit(3) from uvicorn
    except SystemExit:
        if quiet.failure() is None:
            raise
    finally:
        errors.removeFilter(quiet)
    if (failure := quiet.failure()) is not None:
        raise failure


@contextlib.contextmanager
def running_server(
    options: ServerOptions, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> Iterator[str]:
    """Start on a free port (port 0: the kernel picks, read back from the socket); yield the base URL."""
    server = _server(options, host, port, log_level, access_log=False)
    thread = threading.Thread(target=server.run, name="offload-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("server failed to start (see the log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("server did not start in time")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    thread.name = f"offload-server {host}:{bound[1]}"  # which one, where a process runs several
    try:
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(GRACEFUL_SHUTDOWN + 5)
        if thread.is_alive():
            server.force_exit = True
            thread.join(5)
