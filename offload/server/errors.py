"""Every error is JSON: `{"error": <kind>, "detail": <message or list of field problems>}`.

Status codes carry the meaning (401 no/invalid key, 403 wrong scope, 404 unknown queue or job, 408 a body that
did not arrive in time, 409 a transition the job's state does not allow or a stale lease, 413 too large, 422
invalid input with field paths, 429 a limit reached, 503 the job store is unreachable, full at its maxmemory, may
evict, or could not make a write safe), so clients can branch without parsing messages. Messages come from
offload's own exceptions, which never carry credentials; Redis errors are not echoed at all, because a connection
error can name a URL with a password in it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from offload.access.api_keys import InvalidKeyRequest
from offload.connection import is_oom
from offload.errors import (
    ConnectionFailed,
    InvalidJob,
    InvalidQueueName,
    InvalidTransition,
    JobNotFound,
    PayloadTooLarge,
    RequestError,
    StaleLease,
    StoreFull,
    UnsafeEvictionPolicy,
)
from offload.queue.durability import NotReplicated
from offload.redact import hook_paths

log = logging.getLogger("offload.server")
KINDS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    409: "conflict",
    413: "too_large",
    422: "invalid",
    429: "too_many_requests",
    500: "internal",
    503: "unavailable",
}
MAX_PROBLEMS = 50


class FieldError(RequestError):
    """A 422 about one field, for checks pydantic cannot express (they need the store or the server's limits)."""

    def __init__(self, loc: Sequence[str | int], msg: str) -> None:
        super().__init__(msg)
        self.loc = list(loc)
        self.msg = msg


def error_body(status: int, detail: Any) -> dict[str, Any]:
    """The one error shape (see the module docstring); also used by routes_hooks.FastPath, outside FastAPI."""
    return {"error": KINDS.get(status, "error"), "detail": detail}


def _json(status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, detail), status_code=status, headers=headers)


def _field(loc: Sequence[str | int], msg: str, kind: str = "value_error") -> dict[str, Any]:
    return {"loc": list(loc), "path": ".".join(str(p) for p in loc), "msg": msg, "type": kind}


def install(app: FastAPI) -> None:
    """Answer every error in the one shape, with the status that carries its meaning (see the module docstring)."""
    for exc_type, handler in _HANDLERS:
        app.exception_handler(exc_type)(handler)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _json(exc.status_code, exc.detail, getattr(exc, "headers", None))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """At most MAX_PROBLEMS entries (a batch of 1,000 bad jobs is not 3,000 lines), the rest counted."""
    errors = exc.errors()
    problems = [_field(e["loc"], e["msg"], e["type"]) for e in errors[:MAX_PROBLEMS]]
    if len(errors) > MAX_PROBLEMS:
        problems.append(_field(["body"], f"... and {len(errors) - MAX_PROBLEMS} more problems", "truncated"))
    return JSONResponse(jsonable_encoder(error_body(422, problems)), status_code=422)


async def _field_error(request: Request, exc: FieldError) -> JSONResponse:
    return _json(422, [_field(exc.loc, exc.msg)])


def _invalid_at(loc: Sequence[str | int]) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    """A 422 naming `loc` as the one problem, with the exception's message."""

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        return _json(422, [_field(loc, str(exc))])

    return invalid


async def _invalid_job(request: Request, exc: Exception) -> JSONResponse:
    """A 422 naming the option the job is refused for (`InvalidJob.field`), else the body."""
    field = exc.field if isinstance(exc, InvalidJob) else None
    return _json(422, [_field(["body", field] if field else ["body"], str(exc))])


def _status(status: int) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    """`status` with the exception's message as the detail."""

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        return _json(status, str(exc))

    return answer


async def _redis_down(request: Request, exc: RedisError) -> JSONResponse:
    log.warning("job store error on %s %s: %s", request.method, hook_paths(request.url.path), type(exc).__name__)
    if is_oom(exc):
        _oom_seen(request)
        return _json(503, "the job store is full (its maxmemory); retry later", {"Retry-After": "5"})
    return _json(503, "the job store is unavailable; retry later", {"Retry-After": "1"})


async def _store_full(request: Request, exc: StoreFull) -> JSONResponse:
    _oom_seen(request)
    return _json(503, str(exc), {"Retry-After": "5"})


async def _may_evict(request: Request, exc: UnsafeEvictionPolicy) -> JSONResponse:
    return _json(503, str(exc), {"Retry-After": "30"})


async def _not_replicated(request: Request, exc: NotReplicated) -> JSONResponse:
    """Not acknowledged: a failover could lose the write (durability); the client sends it again."""
    return _json(503, str(exc).removeprefix("NOREPLICAS "), {"Retry-After": "1"})


async def _unreachable(request: Request, exc: ConnectionFailed) -> JSONResponse:
    return _json(503, "the job store is unavailable; retry later", {"Retry-After": "1"})


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    """A bug: logged with its traceback here, a bare JSON 500 for the client (no internals leak)."""
    log.error("unhandled error on %s %s", request.method, hook_paths(request.url.path), exc_info=exc)
    return _json(500, "internal error")


_HANDLERS: tuple[tuple[type[Exception], Callable[..., Awaitable[JSONResponse]]], ...] = (
    (StarletteHTTPException, _http_error),
    (RequestValidationError, _validation_error),
    (FieldError, _field_error),
    (InvalidJob, _invalid_job),
    (InvalidQueueName, _invalid_at(["path", "queue"])),
    (InvalidKeyRequest, _invalid_at(["body"])),
    (JobNotFound, _status(404)),
    (PayloadTooLarge, _status(413)),
    (InvalidTransition, _status(409)),
    (StaleLease, _status(409)),
    (RedisError, _redis_down),
    (StoreFull, _store_full),
    (UnsafeEvictionPolicy, _may_evict),
    (NotReplicated, _not_replicated),
    (ConnectionFailed, _unreachable),
    (Exception, _internal),
)


def _oom_seen(request: Request) -> None:
    """The store watch alerts on its next pass (server/store_watch.py)."""
    state = getattr(request.app.state, "offload", None)
    if state is not None:
        state.store_watch.oom_seen()


class BodyTooLarge(RequestError, StarletteHTTPException):
    """413. An HTTPException so FastAPI's body reader re-raises it as is (it turns other errors into a 400);
    raised by the per-route body bound (auth.GuardedRoute)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over this route's limit of {limit} bytes")
