"""Run the simulator: `serve` in the foreground (the CLI), `running_sim` in a background thread (tests).

Both are real uvicorn servers on a real socket, so clients exercise their actual HTTP stack, timeouts and
connection handling. Access logs are off by default: at thousands of polls a second they would cost more than
the simulation itself.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import uvicorn

from offload.clock import Clock
from offload.heap import freeze_startup
from offload.testing.sim.app import SimApp, create_app
from offload.testing.sim.config import SimConfig

START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
GRACEFUL_SHUTDOWN = 3  # seconds: held requests (Prefer: wait, /runsync) must not block a stop for long


def _server(
    app: SimApp,
    host: str,
    port: int,
    *,
    log_level: str,
    access_log: bool,
    ssl_certfile: str | None,
    ssl_keyfile: str | None,
) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",  # the app's shutdown closes the webhook sender's pool
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        timeout_keep_alive=30,
        backlog=4096,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
    )
    return uvicorn.Server(config)


def serve(
    host: str = "127.0.0.1",
    port: int = 8089,
    config: SimConfig | None = None,
    *,
    log_level: str = "info",
    access_log: bool = False,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    also_ports: Sequence[int] = (),
) -> None:
    """Serve until interrupted (Ctrl+C / SIGTERM). `also_ports`: more ports for the same simulator; the
    submission log records the port each submit arrived on, so giving each client its own port tells them
    apart even when their User-Agent does not."""
    app = create_app(config)
    server = _server(
        app, host, port, log_level=log_level, access_log=access_log, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile
    )
    freeze_startup()  # the foreground simulator lives as long as its process (offload/heap.py)
    if not also_ports:
        server.run()
        return
    server.run(sockets=[_bind(host, p) for p in (port, *also_ports)])


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class RunningSim(str):
    """The base URL (a `str`, so it drops into any client), plus the app for in-process inspection."""

    app: SimApp

    def __new__(cls, url: str, app: SimApp) -> RunningSim:
        obj = super().__new__(cls, url)
        obj.app = app
        return obj


@contextlib.contextmanager
def running_sim(
    config: SimConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    clock: Clock | None = None,
) -> Iterator[RunningSim]:
    """Start a simulator on a free port in a background thread; yield its base URL; stop it on exit.

    Port 0 lets the kernel choose, and the real port is read back from the bound socket, so parallel tests
    never race for a port. `https://` when a certificate is given (the fal SDK only speaks https).
    """
    app = create_app(config, clock=clock)
    server = _server(
        app, host, port, log_level=log_level, access_log=False, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile
    )
    thread = threading.Thread(target=server.run, name="offload-sim", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("simulator failed to start (see the log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("simulator did not start in time")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    scheme = "https" if ssl_certfile else "http"
    url_host = "127.0.0.1" if host in ("", "0.0.0.0") else f"[{host}]" if ":" in host else host
    try:
        yield RunningSim(f"{scheme}://{url_host}:{bound[1]}", app)
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT)
        if thread.is_alive():  # a held request (Prefer: wait, runsync) keeps a graceful shutdown waiting
            server.force_exit = True
            thread.join(STOP_TIMEOUT)
