"""Concepts with one home, held to it: the environment is read only in offload/env.py (`env_str`, `env_int`,
`env_float`, `process_env`), so every variable offload reads can be found there and in
docs/reference/environment.md; every HTTP client is built by offload/http_client.py's `make_client`, so each
timeout is written once, in its table; the clock types are offload/clock.py's alone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HTTPX_CLIENT = re.compile(r"\bhttpx\.(Async)?Client\(|\bhttpx\.Timeout\(")
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


def test_only_clock_py_defines_the_clock_types() -> None:
    aliases = _offenders(CLOCK_ALIAS, "offload/clock.py")
    assert not aliases, f"import Clock / ClockMs from offload.clock: {aliases}"
