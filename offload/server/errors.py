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
from collections.abc import Sequence
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
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _json(exc.status_code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        """At most MAX_PROBLEMS entries (a batch of 1,000 bad jobs is not 3,000 lines), the rest counted."""
        errors = exc.errors()
        problems = [_field(e["loc"], e["msg"], e["type"]) for e in errors[:MAX_PROBLEMS]]
        if len(errors) > MAX_PROBLEMS:
            problems.append(_field(["body"], f"... and {len(errors) - MAX_PROBLEMS} more problems", "truncated"))
        return JSONResponse(jsonable_encoder(error_body(422, problems)), status_code=422)

    @app.exception_handler(FieldError)
    async def field_error(request: Request, exc: FieldError) -> JSONResponse:
        return _json(422, [_field(exc.loc, exc.msg)])

    @app.exception_handler(InvalidJob)
    async def invalid_job(request: Request, exc: InvalidJob) -> JSONResponse:
        return _json(422, [_field(["body"], str(exc))])

    @app.exception_handler(InvalidQueueName)
    async def invalid_queue(request: Request, exc: InvalidQueueName) -> JSONResponse:
        return _json(422, [_field(["path", "queue"], str(exc))])

    @app.exception_handler(InvalidKeyRequest)
    async def invalid_key(request: Request, exc: InvalidKeyRequest) -> JSONResponse:
        return _json(422, [_field(["body"], str(exc))])

    @app.exception_handler(JobNotFound)
    async def not_found(request: Request, exc: JobNotFound) -> JSONResponse:
        return _json(404, str(exc))

    @app.exception_handler(PayloadTooLarge)
    async def too_large(request: Request, exc: PayloadTooLarge) -> JSONResponse:
        return _json(413, str(exc))

    @app.exception_handler(InvalidTransition)
    async def conflict(request: Request, exc: InvalidTransition) -> JSONResponse:
        return _json(409, str(exc))

    @app.exception_handler(StaleLease)
    async def stale(request: Request, exc: StaleLease) -> JSONResponse:
        return _json(409, str(exc))

    @app.exception_handler(RedisError)
    async def redis_down(request: Request, exc: RedisError) -> JSONResponse:
        log.warning("job store error on %s %s: %s", request.method, hook_paths(request.url.path), type(exc).__name__)
        if is_oom(exc):
            _oom_seen(request)
            return _json(503, "the job store is full (its maxmemory); retry later", {"Retry-After": "5"})
        return _json(503, "the job store is unavailable; retry later", {"Retry-After": "1"})

    @app.exception_handler(StoreFull)
    async def store_full(request: Request, exc: StoreFull) -> JSONResponse:
        _oom_seen(request)
        return _json(503, str(exc), {"Retry-After": "5"})

    @app.exception_handler(UnsafeEvictionPolicy)
    async def may_evict(request: Request, exc: UnsafeEvictionPolicy) -> JSONResponse:
        return _json(503, str(exc), {"Retry-After": "30"})

    @app.exception_handler(NotReplicated)
    async def not_replicated(request: Request, exc: NotReplicated) -> JSONResponse:
        """Not acknowledged: a failover could lose the write (durability); the client sends it again."""
        return _json(503, str(exc).removeprefix("NOREPLICAS "), {"Retry-After": "1"})

    @app.exception_handler(ConnectionFailed)
    async def unreachable(request: Request, exc: ConnectionFailed) -> JSONResponse:
        return _json(503, "the job store is unavailable; retry later", {"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        """A bug: logged with its traceback here, a bare JSON 500 for the client (no internals leak)."""
        log.error("unhandled error on %s %s", request.method, hook_paths(request.url.path), exc_info=exc)
        return _json(500, "internal error")


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
