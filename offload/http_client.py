"""Every HTTP client offload builds, from one table of named timeouts, on one TLS context.

A site names what its client is for (`make_client("alerts")`); the table says how long each kind may wait, so
the numbers are written once and compared in one place. `timeout=` overrides the kind's total for a caller
configured with its own (a backend's `timeout:`, a provider's); the kind's connect limit stays.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any, Literal, NamedTuple

import httpx


class Timeouts(NamedTuple):
    """Seconds a request may take: `total` for each of connect, read, write and a free connection from the
    pool, `connect` for the connect alone when it is shorter (None: `total`)."""

    total: float
    connect: float | None = None


ClientKind = Literal[
    "backend", "provider_api", "server_api", "file_transfer", "webhook_keys", "alerts", "in_process", "sim_fetch"
]

TIMEOUTS: dict[ClientKind, Timeouts] = {
    # a provider's job API (backends' `timeout:` overrides; a request past it is a Transient, retried)
    "backend": Timeouts(30.0),
    # a machine provider's API (RunPod, Vast.ai): a dead host fails fast, a slow listing may take its time
    "provider_api": Timeouts(30.0, connect=10.0),
    # a GPU-machine worker calling offload's server
    "server_api": Timeouts(30.0, connect=10.0),
    # a GPU-machine worker's file downloads and uploads through presigned URLs: large files
    "file_transfer": Timeouts(300.0, connect=10.0),
    # a provider's webhook signing keys (JWKS), fetched while a delivery waits
    "webhook_keys": Timeouts(10.0),
    # the autoscaler's alert webhooks (Slack, a pager): an alert must not hold up a tick
    "alerts": Timeouts(10.0),
    # requests into an app in this process (the server's route warm-up): httpx's default
    "in_process": Timeouts(5.0),
    # the simulator's fetch of a job's input URLs (a large input, a slow store)
    "sim_fetch": Timeouts(600.0),
}


def timeout_for(kind: ClientKind, total: float | None = None) -> httpx.Timeout:
    """The kind's timeouts as httpx takes them; `total` in place of the kind's own."""
    limits = TIMEOUTS[kind]
    seconds = limits.total if total is None else total
    # (httpx reads an explicit connect=None as "no limit", so it is passed only when the kind has one)
    return httpx.Timeout(seconds) if limits.connect is None else httpx.Timeout(seconds, connect=limits.connect)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process (httpx's default: certifi's bundle, or SSL_CERT_FILE / SSL_CERT_DIR).
    Building one loads the CA bundle, about 27 ms of CPU, which httpx otherwise pays for every client it makes
    (docs/explanation/performance.md, *HTTP transport*)."""
    return httpx.create_ssl_context()


def make_client(kind: ClientKind, *, timeout: float | None = None, **kwargs: Any) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` with the kind's timeouts (`timeout`: another total) on the process's TLS context;
    `kwargs` go to httpx as they are (base_url, headers, transport, ...)."""
    if "transport" not in kwargs:
        kwargs.setdefault("verify", tls_context())
    return httpx.AsyncClient(timeout=timeout_for(kind, timeout), **kwargs)
