"""Completion-webhook routes: a queue's signing secret (shown to admin keys only, and rotated), and its
dead-lettered webhooks, listed with their reasons and requeued (offload/server/callbacks.py sends them)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, Field

from offload.autoscale.vault import VaultError
from offload.redact import url_host
from offload.server.auth import GuardedRoute, Principal, admin_only, guard, need_admin, need_read
from offload.server.callback_secrets import QueueSecrets
from offload.server.callbacks import CallbackSender
from offload.server.errors import FieldError
from offload.server.routes_jobs import require_queue
from offload.server.schemas import MoveReply, MoveRequest
from offload.server.state import ServerState, get_state

router = APIRouter(tags=["callbacks"], route_class=GuardedRoute)
MOVE_BATCH = 1000


class SecretView(BaseModel):
    secret: str = Field(..., description="The current signing secret (whsec_...): verify with it.")
    previous: str | None = Field(None, description="The secret before the last rotation, while it still signs.")
    previous_until: int | None = Field(None, description="Epoch ms: when the previous secret stops signing.")

    @classmethod
    def of(cls, secrets: QueueSecrets) -> SecretView:
        return cls(secret=secrets.current, previous=secrets.previous, previous_until=secrets.previous_until)


class RotateRequest(BaseModel):
    grace_s: int | None = Field(
        None, ge=0, le=30 * 86_400, description="Seconds the old secret still signs (callbacks.rotation_grace_s)."
    )


class FailedView(BaseModel):
    job_id: str
    tries: int
    error: str = Field(..., description="Why the last try failed.")
    failed_at: int = Field(..., description="Epoch ms.")
    host: str | None = Field(
        None,
        description="The host (and port) the webhook goes to: the job's callback_url, else its queue's. Never the "
        "whole URL: its path or query may hold the receiver's token.",
    )


class FailedPage(BaseModel):
    failed: list[FailedView]
    owed: int = Field(..., description="Webhooks of the queue not yet delivered nor dead-lettered.")


def _sender(state: ServerState) -> CallbackSender:
    sender: CallbackSender = state.extra["callbacks"]
    return sender


def _vault_problem(exc: VaultError) -> HTTPException:
    return HTTPException(409, f"no signing secret can be kept: {exc}")


@router.get(
    "/v1/queues/{queue}/callbacks/secret", response_model=SecretView, summary="The queue's webhook signing secret"
)
async def get_secret(request: Request, queue: str, key: Principal) -> SecretView:
    need_admin(key, "read webhook signing secrets")
    state = get_state(request)
    await require_queue(state, queue)
    try:
        return SecretView.of(await _sender(state).secrets.get(queue))
    except VaultError as exc:
        raise _vault_problem(exc) from None


@router.post(
    "/v1/queues/{queue}/callbacks/secret/rotate",
    response_model=SecretView,
    summary="A new signing secret; the old one still signs through the grace period",
)
@guard(admin_only("rotate webhook signing secrets"))
async def rotate_secret(request: Request, queue: str, body: RotateRequest, key: Principal) -> SecretView:
    state = get_state(request)
    await require_queue(state, queue)
    grace = body.grace_s if body.grace_s is not None else state.options.settings.callbacks.rotation_grace_s
    try:
        return SecretView.of(await _sender(state).secrets.rotate(queue, grace))
    except VaultError as exc:
        raise _vault_problem(exc) from None


@router.get(
    "/v1/queues/{queue}/callbacks/failed",
    response_model=FailedPage,
    summary="Dead-lettered completion webhooks, newest first, with why",
)
async def failed(
    request: Request, queue: str, key: Principal, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> FailedPage:
    need_read(key, queue)
    state = get_state(request)
    await require_queue(state, queue)
    outbox = _sender(state).outbox
    rows = await outbox.failed(queue, limit)
    q = state.options.settings.queues.get(queue)
    queue_url = q.callback_url if q is not None else None
    views = [FailedView(**r.to_dict(), host=url_host(r.job_url or queue_url)) for r in rows]
    return FailedPage(failed=views, owed=await outbox.owed(queue))


@router.post(
    "/v1/queues/{queue}/callbacks/failed/requeue",
    response_model=MoveReply,
    summary="Dead-lettered webhooks sent again, with a fresh budget of tries",
)
@guard(admin_only("requeue webhooks"), big_body=True)  # up to 10,000 ids
async def requeue(request: Request, queue: str, body: MoveRequest, key: Principal) -> MoveReply:
    if bool(body.ids) == body.all:
        raise FieldError(["body"], "give ids or all=true (not both)")
    state = get_state(request)
    await require_queue(state, queue)
    outbox = _sender(state).outbox
    if body.ids:
        return MoveReply(moved=await outbox.requeue(queue, body.ids))
    budget = await outbox.failed_count(queue)  # the set's size now: webhooks that fail back meanwhile stay
    moved: list[str] = []
    while len(moved) < budget and (batch := await outbox.requeue(queue, limit=min(MOVE_BATCH, budget - len(moved)))):
        moved += batch
    return MoveReply(moved=moved)
