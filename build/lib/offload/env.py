"""Numbers read from the environment (OFFLOAD_MAX_PAYLOAD, OFFLOAD_REDIS_CONNECT_TIMEOUT, ...), checked in one place.

A bad value is a ConfigError naming the variable, raised where the value is first needed, so the command line
shows `error: OFFLOAD_MAX_PAYLOAD: expected an integer, got 'lots'` instead of a ValueError traceback.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TypeVar

from offload.errors import ConfigError

D = TypeVar("D", int, float, None)


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
