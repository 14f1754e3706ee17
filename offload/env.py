"""The one place offload reads its environment: numbers checked (OFFLOAD_MAX_PAYLOAD, OFFLOAD_REDIS_CONNECT_TIMEOUT,
...), strings as set, and the whole mapping for what takes one (the config's ${VAR}s, a child's environment).
Every variable is listed in docs/reference/environment.md.

A bad number is a ConfigError naming the variable, raised where the value is first needed, so the command line
shows `error: OFFLOAD_MAX_PAYLOAD: expected an integer, got 'lots'` instead of a ValueError traceback.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TypeVar, overload

from offload.errors import ConfigError

D = TypeVar("D", int, float, None)


def process_env() -> Mapping[str, str]:
    """This process's environment, for a caller that takes a whole mapping (a function given `env` in tests)."""
    return os.environ


@overload
def env_str(name: str, default: str, *, env: Mapping[str, str] | None = None) -> str: ...
@overload
def env_str(name: str, default: None = None, *, env: Mapping[str, str] | None = None) -> str | None: ...
def env_str(name: str, default: str | None = None, *, env: Mapping[str, str] | None = None) -> str | None:
    """The variable as it is set (not stripped, possibly empty), or `default` when it is unset."""
    return (os.environ if env is None else env).get(name, default)


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(name, "").strip()


def _check(name: str, raw: str, value: float, minimum: float | None) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number, got {raw!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}: must be at least {minimum:g}, got {raw!r}")


def env_int(name: str, default: D, *, minimum: int | None = None, env: Mapping[str, str] | None = None) -> int | D:
    """The variable as an integer, or `default` when it is unset or blank; a bad value names the variable."""
    raw = _raw(name, env)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    _check(name, raw, value, minimum)
    return value


def env_float(
    name: str, default: D, *, minimum: float | None = None, env: Mapping[str, str] | None = None
) -> float | D:
    """The variable as a number, or `default` when it is unset or blank; a bad value names the variable."""
    raw = _raw(name, env)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
    _check(name, raw, value, minimum)
    return value
