"""Who is calling and what they may do.

Every route except the health checks depends on `principal`, which reads the key from `Authorization: Bearer`
or `X-API-Key` (never from the query string: URLs end up in access logs and browser history). The checks below
are the whole permission model, so each route states its rule in one call:

| scope    | may                                                                                 |
|----------|-------------------------------------------------------------------------------------|
| admin    | everything, on every queue                                                          |
| producer | enqueue, read and cancel jobs, read queue stats and events, on its queues           |
| worker   | register, claim, heartbeat, complete and fail jobs, on its queues only               |
| viewer   | read everything on its queues (all queues unless restricted); change nothing        |
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from offload.server.keys import ApiKey
from offload.server.state import get_state

_bearer = HTTPBearer(auto_error=False, description="An offload API key: `Authorization: Bearer ofk_...`")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="An offload API key (alternative header).")


async def principal(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header: Annotated[str | None, Depends(_header)],
) -> ApiKey:
    token = (bearer.credentials if bearer else None) or header
    if not token:
        raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                            headers={"WWW-Authenticate": "Bearer"})
    key = await get_state(request).keys.authenticate(token)
    if key is None:
        raise HTTPException(401, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"})
    return key


Principal = Annotated[ApiKey, Depends(principal)]


def _deny(key: ApiKey, action: str, queue: str | None = None) -> HTTPException:
    where = f" on queue {queue!r}" if queue else ""
    return HTTPException(403, f"a {key.scope} key may not {action}{where}")


def can_read(key: ApiKey, queue: str) -> bool:
    return key.scope == "admin" or (key.scope in ("viewer", "producer") and key.covers(queue))


def need_read(key: ApiKey, queue: str) -> None:
    if not can_read(key, queue):
        raise _deny(key, "read", queue)


def need_produce(key: ApiKey, queue: str, action: str = "enqueue") -> None:
    if not (key.scope == "admin" or (key.scope == "producer" and key.covers(queue))):
        raise _deny(key, action, queue)


def need_work(key: ApiKey, queue: str) -> None:
    if not (key.scope == "admin" or (key.scope == "worker" and key.covers(queue))):
        raise _deny(key, "work", queue)


def need_worker_scope(key: ApiKey) -> None:
    if key.scope not in ("admin", "worker"):
        raise _deny(key, "act as a worker")


def need_admin(key: ApiKey, action: str) -> None:
    if key.scope != "admin":
        raise _deny(key, action)


def need_global_read(key: ApiKey, what: str) -> None:
    """Views that span every queue (workers, metrics): admins and unrestricted viewers."""
    if not (key.scope == "admin" or (key.scope == "viewer" and key.queues is None)):
        raise _deny(key, f"read {what}")
