"""Autoscaling over HTTP: status, events, providers (secrets masked), per-queue autoscale blocks, protect.

Reads need an admin key or an unrestricted viewer; every change needs an admin key (it can rent machines).
The server also runs the autoscaler loop (`start`): every server does, and the Redis lock makes exactly one
of them act. `OFFLOAD_AUTOSCALER=off` keeps a server out of the election.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import orjson
from fastapi import APIRouter, Body, HTTPException, Request
from pydantic import BaseModel, Field

from offload.autoscale import keys
from offload.autoscale.config import autoscale_errors, open_env, seal_env, validate_autoscale, yaml_blocks
from offload.autoscale.instances import InstanceStore, read_events
from offload.autoscale.operator_only import OperatorOnly, check_block_over_api, check_provider_over_api
from offload.autoscale.provider_store import MASK, ProviderInUse, ProviderNotFound, ProviderStore, mask
from offload.autoscale.providers import TYPES, describe
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.status import snapshot
from offload.autoscale.vault import Vault
from offload.errors import ConfigError
from offload.queue.keys import validate_queue
from offload.server.auth import GuardedRoute, Principal, admin_only, guard, need_admin, need_global_read
from offload.server.errors import FieldError
from offload.server.state import ServerState, get_state

log = logging.getLogger("offload.server")
router = APIRouter(tags=["autoscale"], prefix="/v1/autoscale", route_class=GuardedRoute)


class ProviderCreate(BaseModel):
    name: str
    type: str
    config: dict[str, Any] = Field(default_factory=dict)


def _bad(exc: Exception, status: int = 422) -> HTTPException:
    return HTTPException(status, str(exc))


@router.get("/status", summary="Instances (live and recent), per-queue spend and backoff, the leader, events")
async def status(request: Request, key: Principal) -> dict[str, Any]:
    need_global_read(key, "autoscaling")
    state = get_state(request)
    snap = await snapshot(state.redis)
    scaler: Autoscaler | None = state.extra.get("autoscaler")
    # This process's own autoscaler (which server answered, whether it leads, how often it called providers):
    # with several servers behind a balancer, it tells them apart. None when OFFLOAD_AUTOSCALER=off.
    snap["server"] = (
        None
        if scaler is None
        else {
            "owner": scaler.leader.owner,
            "leader": bool(snap["leader"] and snap["leader"]["owner"] == scaler.leader.owner),
            "provider_calls": scaler.provider_calls,
        }
    )
    return snap


@router.get("/events", summary="The autoscaler's journal, oldest first")
async def events(request: Request, key: Principal, limit: int = 100) -> list[dict[str, str]]:
    need_global_read(key, "autoscaling")
    return await read_events(get_state(request).redis, max(1, min(limit, 1000)))


@router.get("/providers", summary="Registered providers (secrets masked)")
async def list_providers(request: Request, key: Principal) -> list[dict[str, Any]]:
    need_global_read(key, "providers")
    return [p.to_dict() for p in await ProviderStore(get_state(request).redis).list()]


@router.get("/provider-types", summary="Each provider type's settings (for forms: kind, required, default, secret)")
async def provider_types(key: Principal) -> list[dict[str, Any]]:
    need_global_read(key, "providers")
    return [describe(kind) for kind in TYPES]


@router.get("/providers/{name}", summary="One provider (secrets masked)")
async def get_provider(request: Request, name: str, key: Principal) -> dict[str, Any]:
    need_global_read(key, "providers")
    try:
        return (await ProviderStore(get_state(request).redis).get(name)).to_dict()
    except ProviderNotFound as exc:
        raise _bad(exc, 404) from None


@router.post("/providers", status_code=201, summary="Register a provider (needs OFFLOAD_VAULT_MASTER_KEY)")
@guard(admin_only("create providers"))
async def create_provider(request: Request, body: ProviderCreate, key: Principal) -> dict[str, Any]:
    try:
        check_provider_over_api(body.type)
    except OperatorOnly as exc:
        raise _bad(exc, 403) from None
    try:
        return (await ProviderStore(get_state(request).redis).create(body.name, body.type, body.config)).to_dict()
    except ConfigError as exc:
        raise _bad(exc) from None


@router.patch("/providers/{name}", summary="Change a provider's config; a secret not retyped keeps its value")
@guard(admin_only("change providers"))
async def update_provider(
    request: Request, name: str, key: Principal, changes: dict[str, Any] = Body(...)
) -> dict[str, Any]:
    redis = get_state(request).redis
    try:
        check_provider_over_api(await redis.hget(keys.provider(name), "type") or "")
    except OperatorOnly as exc:
        raise _bad(exc, 403) from None
    try:
        return (await ProviderStore(redis).update(name, changes)).to_dict()
    except ProviderNotFound as exc:
        raise _bad(exc, 404) from None
    except ConfigError as exc:
        raise _bad(exc) from None


@router.delete("/providers/{name}", status_code=204, summary="Delete a provider with no live instances")
async def delete_provider(request: Request, name: str, key: Principal) -> None:
    need_admin(key, "delete providers")
    try:
        await ProviderStore(get_state(request).redis).delete(name)
    except ProviderNotFound as exc:
        raise _bad(exc, 404) from None
    except ProviderInUse as exc:
        raise _bad(exc, 409) from None


@router.get("/queues", summary="Every queue's effective autoscale block (API-set, else offload.yaml)")
async def list_queues(request: Request, key: Principal) -> dict[str, dict[str, Any]]:
    need_global_read(key, "autoscaling")
    state = get_state(request)
    out: dict[str, dict[str, Any]] = {
        name: {"source": "offload.yaml", "autoscale": _masked(block)}
        for name, block in sorted(yaml_blocks(state.options.settings).items())
    }
    names = sorted(await state.redis.smembers(keys.QUEUE_CONFIGS))
    raws = await state.redis.mget([keys.queue_config(q) for q in names]) if names else []
    for name, raw in zip(names, raws, strict=True):
        if raw:
            out[name] = {"source": "api", "autoscale": _masked(_readable(name, orjson.loads(raw)))}
    return dict(sorted(out.items()))


def _readable(queue: str, block: dict[str, Any]) -> dict[str, Any]:
    """An API-set block with its sealed instance.env opened, or (no master key here) left sealed."""
    try:
        return open_env(block, None, queue)
    except ConfigError:
        return block


@router.get("/queues/{queue}", summary="A queue's effective autoscale block (API-set, else offload.yaml)")
async def get_queue(request: Request, queue: str, key: Principal) -> dict[str, Any]:
    need_global_read(key, "autoscaling")
    state = get_state(request)
    block = await _stored_block(state, validate_queue(queue))
    if block is None:
        raise HTTPException(404, f"queue {queue!r} has no autoscale block")
    return {"source": block[0], "autoscale": _masked(block[1])}


async def _stored_block(state: ServerState, queue: str) -> tuple[str, dict[str, Any]] | None:
    """The queue's effective block as stored (secrets in clear): API-set, else offload.yaml's."""
    raw = await state.redis.get(keys.queue_config(queue))
    if raw:
        return "api", _readable(queue, orjson.loads(raw))
    block = yaml_blocks(state.options.settings).get(queue)
    return ("offload.yaml", block) if block is not None else None


def _masked(block: dict[str, Any]) -> dict[str, Any]:
    """`instance.env` values (HF_TOKEN and the like) never leave the server: shown as `****abcd`, like a
    provider's secrets; a PUT that sends one back masked keeps the stored value. Values still sealed (no master
    key on this server) are shown fully masked."""
    instance = block.get("instance")
    if not isinstance(instance, dict) or not isinstance(instance.get("env"), dict):
        return block
    env = {k: MASK if isinstance(v, dict) else mask(str(v)) for k, v in instance["env"].items()}
    return {**block, "instance": {**instance, "env": env}}


def _unmasked(queue: str, block: dict[str, Any], stored: dict[str, Any] | None) -> dict[str, Any]:
    instance = block.get("instance")
    if not isinstance(instance, dict) or not isinstance(instance.get("env"), dict):
        return block
    old = ((stored or {}).get("instance") or {}).get("env") or {}
    env = dict(instance["env"])
    for name, value in env.items():
        if isinstance(value, str) and value.startswith(MASK):
            if name not in old:
                raise FieldError(
                    ["body", "instance", "env", name],
                    f"queues.{queue}.autoscale.instance.env.{name}: a masked value, but none is stored",
                )
            env[name] = old[name]
    return {**block, "instance": {**instance, "env": env}}


@router.put(
    "/queues/{queue}",
    summary="Set a queue's autoscale block (validated; overrides offload.yaml)",
    description="422 lists every problem with its field path (`{path, msg}`); 403 when the block would run "
    "commands on this host (a deployment, handler or env with a `local` provider): those belong "
    "in offload.yaml.",
)
@guard(admin_only("configure autoscaling"))
async def put_queue(request: Request, queue: str, key: Principal, block: dict[str, Any] = Body(...)) -> dict[str, Any]:
    state = get_state(request)
    stored = await _stored_block(state, validate_queue(queue))
    block = _unmasked(queue, block, stored[1] if stored else None)
    if errors := autoscale_errors(block, f"queues.{queue}.autoscale"):
        raise HTTPException(422, [{"path": path, "msg": msg} for path, msg in errors])
    parsed = validate_autoscale(block, f"queues.{queue}.autoscale")
    redis = state.redis
    dumped = parsed.model_dump()
    try:
        for name in parsed.names:  # every provider the queue may rent from
            check_block_over_api(queue, dumped, await redis.hget(keys.provider(name), "type"))
    except OperatorOnly as exc:
        raise _bad(exc, 403) from None
    try:
        sealed = seal_env(block, Vault.from_env(), queue) if parsed.instance.env else block
    except ConfigError as exc:
        raise _bad(ConfigError(f"queues.{queue}.autoscale.instance.env: {exc}")) from None
    await redis.set(keys.queue_config(queue), orjson.dumps(sealed))
    await redis.sadd(keys.QUEUE_CONFIGS, queue)
    return {"source": "api", "autoscale": _masked(parsed.model_dump(mode="json"))}


@router.delete("/queues/{queue}", status_code=204, summary="Drop the API-set block (offload.yaml applies again)")
async def delete_queue(request: Request, queue: str, key: Principal) -> None:
    need_admin(key, "configure autoscaling")
    redis = get_state(request).redis
    await redis.delete(keys.queue_config(validate_queue(queue)))
    await redis.srem(keys.QUEUE_CONFIGS, queue)


@router.post("/instances/{instance_id}/{action}", summary="protect / unprotect an instance")
async def protect(request: Request, instance_id: str, action: str, key: Principal) -> dict[str, Any]:
    need_admin(key, "protect instances")
    if action not in ("protect", "unprotect"):
        raise HTTPException(404, "action must be protect or unprotect")
    try:
        inst = await InstanceStore(get_state(request).redis).set_protect(instance_id, action == "protect")
    except KeyError as exc:
        raise HTTPException(404, str(exc)) from None
    return inst.to_dict()


def start(state: ServerState) -> asyncio.Task[None] | None:
    """Run the autoscaler in this server (one of possibly many; the lock elects the one that acts)."""
    if os.environ.get("OFFLOAD_AUTOSCALER", "").lower() in ("off", "0", "false", "no"):
        return None
    scaler = Autoscaler(state.redis, state.options.settings)
    stop = asyncio.Event()
    state.extra["autoscaler"] = scaler
    state.extra["autoscaler_stop"] = stop
    return asyncio.create_task(scaler.run(stop), name="autoscaler")


async def stop(state: ServerState, task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    state.extra["autoscaler_stop"].set()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.wait_for(task, 10)
