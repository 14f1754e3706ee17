"""The harnesses' own HTTP calls (tests, benchmarks), on the process's one TLS context (`tls_context`).

`httpx.get` builds a client per call, and each client a TLS context that loads the CA bundle: about 27 ms of
CPU, even for a plain-HTTP URL. The suite's readiness and polling loops made that a fifth of its CPU
(docs/explanation/performance.md, *HTTP transport*). These are httpx's own functions and clients otherwise.
"""

from __future__ import annotations

from typing import Any

import httpx

from offload.http_client import tls_context


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("verify", tls_context())
    return httpx.request(method, url, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)


def put(url: str, **kwargs: Any) -> httpx.Response:
    return request("PUT", url, **kwargs)


def client(**kwargs: Any) -> httpx.Client:
    kwargs.setdefault("verify", tls_context())
    return httpx.Client(**kwargs)


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    kwargs.setdefault("verify", tls_context())
    return httpx.AsyncClient(**kwargs)
