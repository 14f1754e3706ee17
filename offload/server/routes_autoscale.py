"""Autoscaling over HTTP: status, events, providers (secrets masked), per-queue autoscale blocks, protect.

Reads need an admin key or an unrestricted viewer; every change needs an admin key (it can rent machines).
Viewers see commands (a deployment's setup_cmd and startup_cmd, a provider's on-start script) masked: they may
hold tokens. Where secrets may go is decided in offload/autoscale/operator_only.py; here the API refuses what
would send one elsewhere (a provider the operator made, a masked value sent back for another destination).
The server also runs the autoscaler loop (`start`): every server does, and the Redis lock makes exactly one
of them act. `OFFLOAD_AUTOSCALER=off` keeps a server out of the election.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson
from fastapi import APIRouter, Body, HTTPException, Request
from pydantic import BaseModel, Field

from offload.access.api_keys import ApiKey
from offload.autoscale import keyspace
from offload.autoscale.instances import InstanceStore, read_events
from offload.autoscale.operator_only import API, OperatorOnly, check_block_over_api, check_provider_over_api
from offload.autoscale.provider_store import MASK, ProviderInUse, ProviderNotFound, ProviderStore, mask
from offload.autoscale.providers import TYPES, describe
from offload.autoscale.scaler import Autoscaler
from offload.autoscale.settings import (
    autoscale_errors,
    env_bound,
    open_env,
    overflow_over_api,
    seal_env,
    validate_autoscale,
    yaml_blocks,
)
from offload.autoscale.status import snapshot
from offload.autoscale.vault import Vault
from offload.env import env_str
from offload.errors import ConfigError
from offload.eventloop import within
from offload.queue.keyspace import validate_queue
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


def _shown(key: ApiKey, record: dict[str, Any]) -> dict[str, Any]:
    """A provider as this key sees it: secrets masked for everyone, commands for all but admins."""
    kind = TYPES.get(record["type"])
    hidden = [f for f in (kind.command_fields if kind else ()) if record["config"].get(f)]
    if key.scope == "admin" or not hidden:
        return record
    return {**record, "config": {**record["config"], **dict.fromkeys(hidden, MASK)}}


@router.get("/providers", summary="Registered providers (secrets masked)")
async def list_providers(request: Request, key: Principal) -> list[dict[str, Any]]:
    need_global_read(key, "providers")
    return [_shown(key, p.to_dict()) for p in await ProviderStore(get_state(request).redis).list()]


@router.get("/provider-types", summary="Each provider type's settings (for forms: kind, required, default, secret)")
async def provider_types(key: Principal) -> list[dict[str, Any]]:
    need_global_read(key, "providers")
    return [describe(kind) for kind in TYPES]


@router.get("/providers/{name}", summary="One provider (secrets masked)")
async def get_provider(request: Request, name: str, key: Principal) -> dict[str, Any]:
    need_global_read(key, "providers")
    try:
        return _shown(key, (await ProviderStore(get_state(request).redis).get(name)).to_dict())
    except ProviderNotFound as exc:
        raise _bad(exc, 404) from None


async def _check_api_may_change(store: ProviderStore, name: str) -> None:
    """403 for a provider that runs on this host or that the operator made; 404 for none."""
    try:
        record = await store.get(name)
    except ProviderNotFound as exc:
        raise _bad(exc, 404) from None
    try:
        check_provider_over_api(record.type, record.origin, name)
    except OperatorOnly as exc:
        raise _bad(exc, 403) from None


@router.post("/providers", status_code=201, summary="Register a provider (needs OFFLOAD_VAULT_MASTER_KEY)")
@guard(admin_only("create providers"))
async def create_provider(request: Request, body: ProviderCreate, key: Principal) -> dict[str, Any]:
    try:
        check_provider_over_api(body.type)
    except OperatorOnly as exc:
        raise _bad(exc, 403) from None
    try:
        store = ProviderStore(get_state(request).redis)
        return (await store.create(body.name, body.type, body.config, origin=API)).to_dict()
    except ConfigError as exc:
        raise _bad(exc) from None


@router.patch("/providers/{name}", summary="Change a provider's config; a secret not retyped keeps its value")
@guard(admin_only("change providers"))
async def update_provider(
    request: Request, name: str, key: Principal, changes: dict[str, Any] = Body(...)
) -> dict[str, Any]:
    store = ProviderStore(get_state(request).redis)
    await _check_api_may_change(store, name)
    try:
        return (await store.update(name, changes)).to_dict()
    except ProviderNotFound as exc:
        raise _bad(exc, 404) from None
    except ConfigError as exc:
        raise _bad(exc) from None


@router.delete("/providers/{name}", status_code=204, summary="Delete a provider with no live instances")
async def delete_provider(request: Request, name: str, key: Principal) -> None:
    need_admin(key, "delete providers")
    store = ProviderStore(get_state(request).redis)
    await _check_api_may_change(store, name)
    try:
        await store.delete(name)
    except ProviderNotFound as exc:
        raise _bad(exc, 404) from None
    except ProviderInUse as exc:
        raise _bad(exc, 409) from None


@router.get("/queues", summary="Every queue's effective autoscale block (API-set, else offload.yaml)")
async def list_queues(request: Request, key: Principal) -> dict[str, dict[str, Any]]:
    need_global_read(key, "autoscaling")
    state = get_state(request)
    out: dict[str, dict[str, Any]] = {
        name: {"source": "offload.yaml", "autoscale": _masked(block, key)}
        for name, block in sorted(yaml_blocks(state.options.settings).items())
    }
    names = sorted(await state.redis.smembers(keyspace.QUEUE_CONFIGS))
    raws = await state.redis.mget([keyspace.queue_config(q) for q in names]) if names else []
    for name, raw in zip(names, raws, strict=True):
        if raw:
            out[name] = {"source": "api", "autoscale": _masked(_readable(name, orjson.loads(raw)), key)}
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
    return {"source": block[0], "autoscale": _masked(block[1], key)}


async def _stored_block(state: ServerState, queue: str) -> tuple[str, dict[str, Any]] | None:
    """The queue's effective block as stored (secrets in clear): API-set, else offload.yaml's."""
    found = await _stored(state, queue)
    return (found[0], found[1]) if found else None


async def _stored(state: ServerState, queue: str) -> tuple[str, dict[str, Any], dict[str, str]] | None:
    """(source, block with secrets in clear, the providers its API-set instance.env was given for)."""
    raw = await state.redis.get(keyspace.queue_config(queue))
    if raw:
        stored = orjson.loads(raw)
        return "api", _readable(queue, stored), env_bound(stored) or {}
    block = yaml_blocks(state.options.settings).get(queue)
    return ("offload.yaml", block, {}) if block is not None else None


COMMANDS = ("setup_cmd", "startup_cmd")  # a deployment's shell commands: shown to admin keys only


def _masked(block: dict[str, Any], key: ApiKey | None = None) -> dict[str, Any]:
    """`instance.env` values (HF_TOKEN and the like) never leave the server: shown as `****abcd`, like a
    provider's secrets; a PUT that sends one back masked keeps the stored value (see `_unmasked`). Values still
    sealed (no master key on this server) are shown fully masked. Commands are masked for all but admins."""
    deployment = block.get("deployment")
    if key is not None and key.scope != "admin" and isinstance(deployment, dict):
        hidden = {c: MASK for c in COMMANDS if deployment.get(c)}
        block = {**block, "deployment": {**deployment, **hidden}}
    instance = block.get("instance")
    if not isinstance(instance, dict) or not isinstance(instance.get("env"), dict):
        return block
    env = {k: MASK if isinstance(v, dict) else mask(str(v)) for k, v in instance["env"].items()}
    return {**block, "instance": {**instance, "env": env}}


def _route(block: dict[str, Any]) -> Any:
    """What decides where a block's instance.env values go: its providers, image, handler and deployment."""
    try:
        cfg = validate_autoscale(block)
    except ConfigError:
        return None
    deployment = cfg.deployment.model_dump() if cfg.deployment else None
    return cfg.names, cfg.instance.image, cfg.instance.handler, deployment


async def _destinations(state: ServerState, queue: str, names: list[str]) -> dict[str, str]:
    """Where each provider points now (provider_store.py); 422 for one that does not exist."""
    store, out = ProviderStore(state.redis), {}
    for name in names:
        found = await store.origin_of(name)
        if found is None:
            raise FieldError(
                ["body", "instance", "env"],
                f"queues.{queue}.autoscale.instance.env: provider {name!r} does not exist; create it first "
                "(the values are bound to the providers they are given for)",
            )
        out[name] = found[1]
    return out


async def _known_providers(state: ServerState, queue: str, names: list[str], field: str) -> None:
    """422 naming a provider the block would rent from that does not exist (it would fail every evaluation)."""
    store = ProviderStore(state.redis)
    for i, name in enumerate(names):
        if await store.origin_of(name) is None:
            loc: list[str | int] = ["body", field] if field == "provider" else ["body", field, i]
            raise FieldError(
                loc,
                f"queues.{queue}.autoscale.{field}: provider {name!r} does not exist; create it first "
                "(`offload providers create` or POST /v1/autoscale/providers)",
            )


def _unmasked(
    queue: str,
    block: dict[str, Any],
    stored: tuple[str, dict[str, Any], dict[str, str]] | None,
    now: dict[str, str],
) -> dict[str, Any]:
    """The block with each masked `instance.env` value replaced by the stored one, which is kept only where it
    would go to the same place: the queue's API-set block (offload.yaml's values are the operator's, never
    handed to a block an admin key writes), the same providers pointing where they pointed when the value was
    given (`now` against the stored binding), the same image, handler and deployment. Else 422: give it again."""
    instance = block.get("instance")
    if not isinstance(instance, dict) or not isinstance(instance.get("env"), dict):
        return block
    source, old_block, bound = stored if stored else ("", {}, {})
    old = (old_block.get("instance") or {}).get("env") or {}
    same = source == "api" and bound == now and _route(block) == _route(old_block)
    env = dict(instance["env"])
    for name, value in env.items():
        if isinstance(value, str) and value.startswith(MASK):
            if name not in old:
                why = "a masked value, but none is stored"
            elif not same:
                why = (
                    "a masked value is kept only for the block it was given for, with the same providers "
                    "(pointing where they did), image, handler and deployment: give the value again"
                    if source == "api"
                    else "a masked value of offload.yaml's block is the operator's: give the value itself"
                )
            else:
                env[name] = old[name]
                continue
            raise FieldError(["body", "instance", "env", name], f"queues.{queue}.autoscale.instance.env.{name}: {why}")
    return {**block, "instance": {**instance, "env": env}}


@router.put(
    "/queues/{queue}",
    summary="Set a queue's autoscale block (validated; overrides offload.yaml)",
    description="422 lists every problem with its field path (`{path, msg}`), and a masked `instance.env` value "
    "sent back for another destination than it was given for; 403 when the block would run commands on this host "
    "(a deployment, handler or env with a `local` provider) or names a vault credential: those belong "
    "in offload.yaml.",
)
@guard(admin_only("configure autoscaling"))
async def put_queue(request: Request, queue: str, key: Principal, block: dict[str, Any] = Body(...)) -> dict[str, Any]:
    state = get_state(request)
    stored = await _stored(state, validate_queue(queue))
    if errors := autoscale_errors(block, f"queues.{queue}.autoscale"):  # a masked value is text like any other
        raise HTTPException(422, [{"path": path, "msg": msg} for path, msg in errors])
    parsed = validate_autoscale(block, f"queues.{queue}.autoscale")
    if (why := overflow_over_api(queue, parsed.overflow, state.options.settings)) is not None:
        raise HTTPException(422, [{"path": ["body", "overflow", "backends"], "msg": why}])
    await _known_providers(state, queue, parsed.names, "provider" if parsed.provider else "providers")
    now = await _destinations(state, queue, parsed.names) if parsed.instance.env else {}
    block = _unmasked(queue, block, stored, now)
    redis = state.redis
    dumped = parsed.model_dump()
    try:
        for kind in [await redis.hget(keyspace.provider(n), "type") for n in parsed.names] or [None]:
            check_block_over_api(queue, dumped, kind)  # every provider the queue may rent from
    except OperatorOnly as exc:
        raise _bad(exc, 403) from None
    try:
        sealed = seal_env(block, Vault.from_env(), queue, now) if parsed.instance.env else block
    except ConfigError as exc:
        raise _bad(ConfigError(f"queues.{queue}.autoscale.instance.env: {exc}")) from None
    await redis.set(keyspace.queue_config(queue), orjson.dumps(sealed))
    await redis.sadd(keyspace.QUEUE_CONFIGS, queue)
    return {"source": "api", "autoscale": _masked(parsed.model_dump(mode="json"))}


@router.delete("/queues/{queue}", status_code=204, summary="Drop the API-set block (offload.yaml applies again)")
async def delete_queue(request: Request, queue: str, key: Principal) -> None:
    need_admin(key, "configure autoscaling")
    redis = get_state(request).redis
    await redis.delete(keyspace.queue_config(validate_queue(queue)))
    await redis.srem(keyspace.QUEUE_CONFIGS, queue)


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
    if env_str("OFFLOAD_AUTOSCALER", "").lower() in ("off", "0", "false", "no"):
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
        await within(task, 10)
