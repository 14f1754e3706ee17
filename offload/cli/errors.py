"""How every offload command fails: one `error: ...` line on stderr and exit code 1, never a traceback.

Typer reports usage mistakes itself (exit code 2). Everything an operator can cause (bad input, a bad setting
or environment value, an unknown job, unreachable Redis, a file that cannot be written) is an `OffloadError`, a
Redis error or an OSError and is mapped here; anything else is a bug, and `offload.cli.app.main` still turns it
into one line rather than a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer
from redis.exceptions import RedisError

from offload.errors import MissingExtra, OffloadError


def error_line(message: str) -> str:
    """One line, so logs and `2>err` captures stay greppable."""
    return f"error: {' '.join(message.split()) or 'unknown error'}"


def fail(message: str) -> NoReturn:
    """Print the error line and exit 1, which separates 'it failed' from misuse (Typer's exit 2)."""
    typer.echo(error_line(message), err=True)
    raise typer.Exit(1)


def describe(exc: BaseException) -> str:
    """The message of one error line: ours carry their own, Redis's get a prefix, a bug names its type."""
    if isinstance(exc, OffloadError):
        return str(exc) or type(exc).__name__
    if missing := MissingExtra.of(exc):  # an optional dependency: name the extra that installs it
        return str(missing)
    if isinstance(exc, RedisError):  # e.g. the server went away mid-command, or a script error
        return f"Redis/Valkey: {exc}"
    if isinstance(exc, OSError):  # a file the operator named: `[Errno 2] No such file or directory: 'x'`
        return str(exc)
    return f"unexpected {type(exc).__name__}: {exc}"


@contextmanager
def errors() -> Iterator[None]:
    """Turn the failures an operator can cause into `fail` lines instead of tracebacks."""
    try:
        yield
    except (OffloadError, RedisError, OSError) as exc:
        fail(describe(exc))
    except ModuleNotFoundError as exc:
        if MissingExtra.of(exc) is None:
            raise  # a bug (a module of offload itself missing), which `main` still reports in one line
        fail(describe(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
