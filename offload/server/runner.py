"""Run the server: `serve` in the foreground (`offload server`), `running_server` in a thread (tests, embedding).

Both are real uvicorn servers on a real socket. SSE streams and long polls would hold a graceful shutdown
open for their whole timeout, so the shutdown grace is short: clients of both reconnect by design.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from offload.server.app import create_app
from offload.server.state import ServerOptions

START_TIMEOUT = 20.0
GRACEFUL_SHUTDOWN = 3


def _server(options: ServerOptions, host: str, port: int, log_level: str, access_log: bool) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(options), host=host, port=port, log_level=log_level, access_log=access_log,
        timeout_keep_alive=30, backlog=4096, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
        lifespan="on", proxy_headers=False,
    )
    return uvicorn.Server(config)


def serve(options: ServerOptions, host: str = "127.0.0.1", port: int = 8080, *, log_level: str = "info",
          access_log: bool = True) -> None:
    """Serve until SIGTERM/SIGINT. Access logs hold method, path and status only (keys travel in headers)."""
    _server(options, host, port, log_level, access_log).run()


@contextlib.contextmanager
def running_server(options: ServerOptions, *, host: str = "127.0.0.1", port: int = 0,
                   log_level: str = "warning") -> Iterator[str]:
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
    try:
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(GRACEFUL_SHUTDOWN + 5)
        if thread.is_alive():
            server.force_exit = True
            thread.join(5)
