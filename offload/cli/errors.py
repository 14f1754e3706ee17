"""How every offload command fails: one `error: ...` line and a non-zero exit, never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer
from redis.exceptions import RedisError

from offload.errors import OffloadError


def _fail(message: str) -> NoReturn:
    """One line, so logs and `2>err` captures stay greppable; exit 1 separates 'it failed' from misuse."""
    typer.echo(f"error: {' '.join(message.split()) or 'unknown error'}", err=True)
    raise typer.Exit(1)


@contextmanager
def _errors() -> Iterator[None]:
    """Turn the failures an operator can cause into `_fail` lines instead of tracebacks."""
    try:
        yield
    except OffloadError as exc:
        _fail(str(exc) or type(exc).__name__)
    except RedisError as exc:  # e.g. the server went away mid-command, or a script error
        _fail(f"Redis/Valkey: {exc}")
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
