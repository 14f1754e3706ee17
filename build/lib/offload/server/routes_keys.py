"""Admin routes for API keys (the same operations as `offload keys`), so a dashboard can manage them."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from offload.server.auth import GuardedRoute, Principal, admin_only, guard, need_admin
from offload.server.schemas import KeyCreated, KeyCreateRequest, KeyView
from offload.server.state import get_state

router = APIRouter(tags=["keys"], route_class=GuardedRoute)


@router.post(
    "/v1/keys", response_model=KeyCreated, status_code=201, summary="Create a key; the token is in this reply only"
)
@guard(admin_only("manage keys"))
async def create_key(request: Request, body: KeyCreateRequest, key: Principal) -> KeyCreated:
    created, token = await get_state(request).keys.create(body.scope, body.queues, body.name)
    return KeyCreated(**created.to_dict(), token=token)


@router.get("/v1/keys", response_model=list[KeyView], summary="Every key (never a token or its hash)")
async def list_keys(request: Request, key: Principal) -> list[KeyView]:
    need_admin(key, "manage keys")
    return [KeyView(**k.to_dict()) for k in await get_state(request).keys.list()]


@router.delete("/v1/keys/{key_id}", status_code=204, summary="Revoke a key (effective on the next request)")
async def revoke_key(request: Request, key_id: str, key: Principal) -> None:
    need_admin(key, "manage keys")
    if not await get_state(request).keys.revoke(key_id):
        raise HTTPException(404, f"unknown key {key_id!r}")
