"""`offload server`: the HTTP API, SSE events, /metrics and the dashboard (FastAPI on uvicorn)."""

from __future__ import annotations

from typing import Annotated

import typer

from offload.cli.errors import errors
from offload.cli.logs import configure as configure_logging
from offload.cli.options import ConfigOpt, LogLevel, LogLevelOpt, UrlOpt
from offload.cli.session import run_redis, settings
from offload.config import (
    SERVER_BODY_MIN_RATE,
    SERVER_BODY_TIMEOUT_S,
    SERVER_HEADER_TIMEOUT_S,
    SERVER_MAX_BATCH,
    SERVER_MAX_BODY,
    SERVER_MAX_CONNECTIONS,
    SERVER_MAX_REQUESTS_PER_ADDRESS,
    SERVER_MAX_REQUESTS_PER_KEY,
    SERVER_MAX_STREAMS_PER_KEY,
    SERVER_WORKER_LEASE_MS,
)
from offload.env import env_str
from offload.queue.memory import read_memory

WorkerLease = Annotated[float, typer.Option(min=0.5, help="Seconds a GPU worker's leases last without a heartbeat.")]
MaxConnections = Annotated[
    int, typer.Option(min=1, help="Concurrent connections and requests; past it new requests get 503.")
]
HeaderTimeout = Annotated[
    float,
    typer.Option(min=0.1, help="Seconds a client has to send a request's headers before its connection is closed."),
]
BodyTimeout = Annotated[
    float, typer.Option(min=0.1, help="Seconds a request body gets to arrive (plus what --body-min-rate earns).")
]
BodyMinRate = Annotated[
    int, typer.Option(min=1, help="Bytes per second of body that earn one more second; slower bodies get 408.")
]
MaxRequestsPerKey = Annotated[int, typer.Option(min=1, help="Requests one API key may have open at once; past it 429.")]
MaxStreamsPerKey = Annotated[
    int, typer.Option(min=1, help="Event streams and long-polls (SSE, wait, claim) one key may have open; 429.")
]
MaxRequestsPerAddress = Annotated[
    int, typer.Option(min=1, help="Requests without an API key (webhooks too) open per client address; 429.")
]


def server(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8080,
    config: ConfigOpt = None,
    url: UrlOpt = None,
    max_batch: Annotated[int, typer.Option(min=1, max=100_000, help="Jobs per batch enqueue.")] = SERVER_MAX_BATCH,
    max_body: Annotated[int, typer.Option(min=1024, help="Largest request body, bytes.")] = SERVER_MAX_BODY,
    worker_lease: WorkerLease = SERVER_WORKER_LEASE_MS / 1000,
    max_connections: MaxConnections = SERVER_MAX_CONNECTIONS,
    header_timeout: HeaderTimeout = SERVER_HEADER_TIMEOUT_S,
    body_timeout: BodyTimeout = SERVER_BODY_TIMEOUT_S,
    body_min_rate: BodyMinRate = SERVER_BODY_MIN_RATE,
    max_requests_per_key: MaxRequestsPerKey = SERVER_MAX_REQUESTS_PER_KEY,
    max_streams_per_key: MaxStreamsPerKey = SERVER_MAX_STREAMS_PER_KEY,
    max_requests_per_address: MaxRequestsPerAddress = SERVER_MAX_REQUESTS_PER_ADDRESS,
    log_level: LogLevelOpt = LogLevel.INFO,
    access_log: Annotated[bool, typer.Option(help="Log each request (method, path, status).")] = True,
) -> None:
    """Serve the HTTP API, SSE events and /metrics. Keys: `offload keys create`, or OFFLOAD_ADMIN_KEY."""
    from offload.access.api_keys import ADMIN_ENV, check_admin_key
    from offload.server.runner import serve
    from offload.server.state import ServerOptions

    configure_logging(log_level)
    with errors():
        if admin := env_str(ADMIN_ENV):
            check_admin_key(admin)  # refuse before listening, naming the variable
    loaded = settings(config)
    options = ServerOptions(
        redis_url=url or loaded.redis_url,
        settings=loaded,
        max_batch=max_batch,
        max_body=max_body,
        worker_lease_ms=int(worker_lease * 1000),
        max_connections=max_connections,
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        body_min_rate=body_min_rate,
        max_requests_per_key=max_requests_per_key,
        max_streams_per_key=max_streams_per_key,
        max_requests_per_address=max_requests_per_address,
        freeze_heap=True,
    )
    # An unreachable store is said before listening, in one line; one that may evict is not refused: the server
    # starts paused (app.py), as a worker does, so a restart while the store is being reconfigured does not loop
    run_redis(options.redis_url, read_memory)
    with errors():
        serve(options, host, port, log_level=log_level.value, access_log=access_log)


def register(app: typer.Typer) -> None:
    app.command()(server)
