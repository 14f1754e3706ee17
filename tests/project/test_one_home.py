"""Concepts with one home, held to it: the environment is read only in offload/env.py (`env_str`, `env_int`,
`env_float`, `process_env`), so every variable offload reads can be found there and in
docs/reference/environment.md; every HTTP client is built by offload/http_client.py's `make_client`, so each
timeout is written once, in its table, and every client shares the process's one TLS context (the tests' and
benchmarks' own calls too, through bench/web.py); the clock types are offload/clock.py's alone."""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any

import pytest

from bench import web
from offload.http_client import TIMEOUTS, make_client, tls_context

ROOT = Path(__file__).resolve().parents[2]
HTTPX_CLIENT = re.compile(r"\bhttpx\.(Async)?Client\(|\bhttpx\.Timeout\(")
# (a client handed a transport builds no TLS context)
HTTPX_CALL = re.compile(
    r"\bhttpx\.(get|post|put|patch|delete|request|stream)\(|\bhttpx\.(Async)?Client\((?!transport=)"
)
# bench/transport.py measures httpx's own transport; bench/tutorial_worker.py is the tutorial's loop as a user
# writes it
HTTPX_AS_IS = ("bench/web.py", "bench/transport.py", "bench/tutorial_worker.py")
CLOCK_ALIAS = re.compile(r"^Clock(Ms)? = ", re.MULTILINE)
DIRECT = re.compile(r"\bos\.(environ|getenv|putenv)\b|\bfrom os import\b.*\b(environ|getenv)\b")


def test_only_env_py_reads_the_environment() -> None:
    readers = _offenders(DIRECT, "offload/env.py")
    assert not readers, f"read the environment through offload/env.py instead: {readers}"


def test_every_variable_named_in_the_code_is_documented() -> None:
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    named = {
        name
        for path in (ROOT / "offload").rglob("*.py")
        for name in re.findall(r"\bOFFLOAD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    missing = sorted(n for n in named if not re.search(rf"`{n}[`=]", page))
    assert not missing, f"variables docs/reference/environment.md does not list: {missing}"


def _offenders(pattern: re.Pattern[str], home: str) -> list[str]:
    return [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "offload").rglob("*.py"))
        if path != ROOT / home and pattern.search(path.read_text())
    ]


def test_only_http_client_py_builds_http_clients() -> None:
    builders = _offenders(HTTPX_CLIENT, "offload/http_client.py")
    assert not builders, f"build the client with offload.http_client.make_client (a named timeout): {builders}"


def test_every_client_shares_the_processs_tls_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a TLS context loads the CA bundle (about 27 ms of CPU); httpx builds one per client unless it is
    handed one. It is built once, and verifies."""
    built: list[object] = []
    real = ssl.create_default_context

    def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counted)
    tls_context.cache_clear()
    clients = [make_client(kind) for kind in TIMEOUTS] + [web.async_client()]
    with web.client() as client:  # (a sync client too)
        assert not client.is_closed
    assert len(built) == 1, built
    context = tls_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    for c in clients:
        assert not c.is_closed


def test_harnesses_call_http_through_bench_web() -> None:
    """httpx's `get` and a client made without a context build a TLS context a call; the suite's polling loops
    once spent a fifth of its CPU there."""
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("tests", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in HTTPX_AS_IS and HTTPX_CALL.search(path.read_text())
    ]
    assert not offenders, f"call through bench/web.py (one TLS context): {offenders}"


def test_only_clock_py_defines_the_clock_types() -> None:
    aliases = _offenders(CLOCK_ALIAS, "offload/clock.py")
    assert not aliases, f"import Clock / ClockMs from offload.clock: {aliases}"
