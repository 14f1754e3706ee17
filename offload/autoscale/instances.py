"""Instance records: one Redis hash per rented machine, moved through its states by fenced atomic writes.

    provisioning -> booting -> running -> draining -> terminated
         \\------------\\-----------\\----------\\----> failed (with a reason)

- provisioning: the record exists before the provider is called (the journal of the rental: a server that dies
  inside the create call leaves a record a successor reconciles by the machine's `offload-<id>` label);
- booting: the provider reports the machine up, no worker has registered yet;
- running: a worker registered with OFFLOAD_INSTANCE_ID = this id;
- draining: the worker was asked to stop claiming; destroyed once it has nothing in flight (or after the
  queue's drain_timeout). A drain is cancelled (back to running) when load returns before the teardown.

Teardown is orthogonal to status: `teardown=pending` is written before the provider's destroy call and only
becomes `done` when the provider confirms, so a failed call or a restart leaves a journal entry that the next
evaluation retries. `teardown=kept` is a failed instance the operator protected: it stays billed (and counted
against max_workers) until unprotected, then its teardown is journaled like any other. An instance leaves the
live set only once its teardown is done.

Every write of the scaler carries its fencing token; the script refuses it (FENCED) if another server has
become leader meanwhile, so a paused ex-leader cannot overwrite its successor's decisions.

A rented machine is bound to its instance: it receives a random OFFLOAD_INSTANCE_TOKEN (only its SHA-256 is kept
here), and a worker may register as an autoscaler instance (`as-…`) only with that token, only while the
instance is live, and only for the queue it was rented for (`claim_problem`), so one machine (or any holder of
the worker key) cannot pass itself off as another: keep a dead instance looking alive, protect it, or hide the
real worker. Dry-run (mock) instances ship nothing and have no token.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from dataclasses import dataclass, fields
from typing import Any

import orjson

from offload.autoscale import keyspace
from offload.errors import FencingError
from offload.queue.scripts import SCRIPTS
from offload.redact import redact
from offload.redis_client import RedisClient

STATUSES = ("provisioning", "booting", "running", "draining", "terminated", "failed")
ACTIVE = ("provisioning", "booting", "running")  # counted as capacity
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "provisioning": ("booting", "running", "failed", "draining"),
    "booting": ("running", "failed", "draining"),
    "running": ("draining", "failed"),
    "draining": ("terminated", "failed", "running"),  # running again: the drain was cancelled
    "terminated": (),
    "failed": (),
}
EVENTS_MAX = 20_000
ID_PREFIX = "as-"
PRIVATE = ("token_hash",)  # kept in the record, never shown


class EventKind(enum.StrEnum):
    """The kinds of entry in the autoscaler's event journal (`offload autoscale events`)."""

    PROVISIONING = "provisioning"  # a rental journaled, the provider about to be called
    AMBIGUOUS = "ambiguous"  # the create's answer was lost: the machine may exist
    ADOPTED = "adopted"  # ... and it showed up under its label
    READY = "ready"
    BACKOFF = "backoff"
    FAILED = "failed"
    FORGIVEN = "forgiven"
    HOST_AVOIDED = "host_avoided"
    LANDED = "landed"  # a new machine kept on an avoided host: the provider placed us there again and again
    SCHEDULE = "schedule"
    DRAINING = "draining"
    UNDRAINED = "undrained"
    DRAIN_TIMEOUT = "drain_timeout"
    SPEND_CAP = "spend_cap"  # a busy draining machine destroyed for the spend cap
    UNKEPT = "unkept"
    REFUSED = "refused"
    DESTROYED = "destroyed"
    ORPHAN = "orphan"
    ALERT = "alert"


class Fenced(FencingError):
    """This server is no longer the leader: its write (and the provider call after it) must not happen."""


class StaleState(FencingError):
    """The instance is not in a state the write expected (someone else moved it)."""


@dataclass
class Instance:
    id: str
    queue: str
    provider: str
    provider_type: str = ""
    provider_id: str = ""
    label: str = ""
    status: str = "provisioning"
    reason: str = ""
    worker_id: str = ""
    protect: bool = False  # by an operator (`offload autoscale protect`)
    worker_protected: bool = False  # by the worker itself (OFFLOAD_PROTECTED=true)
    created_at: float = 0.0
    updated_at: float = 0.0
    booted_at: float = 0.0
    ready_at: float = 0.0
    last_seen_at: float = 0.0
    last_task_at: float = 0.0
    drain_at: float = 0.0
    teardown: str = ""  # "" | pending | done | kept (failed, but protected: not destroyed)
    teardown_at: float = 0.0
    teardown_attempts: int = 0
    teardown_error: str = ""
    destroyed_at: float = 0.0
    price: float = 0.0
    price_reported: bool = False
    cost: float = 0.0
    accrued_at: float = 0.0
    host: str = ""
    gpu: str = ""
    in_flight: int = 0
    spot: bool = False  # interruptible / bid rental
    drain_reason: str = ""  # a drain.DrainReason: idle | schedule | disabled | spend cap
    token_hash: str = ""  # SHA-256 of the machine's OFFLOAD_INSTANCE_TOKEN ("" for dry-run and older records)

    @property
    def protected(self) -> bool:
        return self.protect or self.worker_protected

    @property
    def live(self) -> bool:
        return self.status not in ("terminated", "failed") or self.teardown in ("pending", "kept")

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> Instance:
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in h:
                continue
            raw = h[f.name]
            if f.type in ("float",):
                kwargs[f.name] = float(raw or 0)
            elif f.type in ("int",):
                kwargs[f.name] = int(float(raw or 0))
            elif f.type in ("bool",):
                kwargs[f.name] = raw in ("1", "True", "true")
            else:
                kwargs[f.name] = raw
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PRIVATE}
        d["protected"] = self.protected
        return d


def new_instance_id() -> str:
    return ID_PREFIX + secrets.token_hex(8)


def new_instance_token() -> tuple[str, str]:
    """(token the machine receives, the hash the record keeps)."""
    token = secrets.token_urlsafe(32)
    return token, token_hash(token)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def claim_problem(
    redis: RedisClient, instance_id: str | None, token: str | None, queues: list[str]
) -> str | None:
    """Why a worker registering for `queues` may not call itself `instance_id` (None: it may). Ids outside the
    autoscaler's `as-…` namespace are free-form labels the autoscaler never matches against an instance."""
    if not instance_id or not instance_id.startswith(ID_PREFIX):
        return None
    h: dict[str, str] = await redis.hgetall(keyspace.instance(instance_id))
    if not h:
        return f"instance_id {instance_id!r}: the autoscaler rented no such instance"
    inst = Instance.from_hash(h)
    if inst.queue not in queues:
        return f"instance_id {instance_id!r} was rented for another queue than the ones this worker registers for"
    if not inst.live or inst.status in ("terminated", "failed"):
        return f"instance_id {instance_id!r} is no longer live (it is {inst.status})"
    if inst.token_hash and not (token and hmac.compare_digest(token_hash(token), inst.token_hash)):
        return (
            f"instance_id {instance_id!r}: instance_token is missing or is not that machine's "
            "(OFFLOAD_INSTANCE_TOKEN, given to the machine when it was rented)"
        )
    return None


async def machine_price(redis: RedisClient, instance_id: str) -> float | None:
    """USD per hour of the machine a GPU worker registered as, for its jobs' share of the rental (None: unknown,
    a worker that is no rented instance, or a rental whose price is not known)."""
    if not instance_id.startswith(ID_PREFIX):
        return None
    raw = await redis.hget(keyspace.instance(instance_id), "price")
    price = float(raw or 0)
    return price if price > 0 else None


def _encode(values: dict[str, Any]) -> bytes:
    out = {}
    for k, v in values.items():
        out[k] = int(v) if isinstance(v, bool) else (repr(v) if isinstance(v, float) else v)
    return orjson.dumps(out)


class InstanceStore:
    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis

    async def _write(
        self, instance_id: str, fence: str, expect: str, values: dict[str, Any], live: str = "", score: float = 0.0
    ) -> None:
        code = await SCRIPTS.instance_write(
            self.redis,
            [keyspace.LEADER, keyspace.instance(instance_id), keyspace.LIVE, keyspace.ALL],
            [fence, expect, _encode(values), live, instance_id, int(score * 1000)],
        )
        if code == "FENCED":
            raise Fenced("lost the autoscaler leadership: another server decides now")
        if code != "OK":
            raise StaleState(f"instance {instance_id}: {code}")

    async def create(self, inst: Instance, fence: str) -> None:
        values = {k: v for k, v in inst.to_dict().items() if k != "protected"}
        values["token_hash"] = inst.token_hash
        await self._write(inst.id, fence, "+create", values, live="add", score=inst.created_at)

    async def update(
        self, inst: Instance, fence: str, now: float, *, expect: tuple[str, ...] | None = None, **changes: Any
    ) -> None:
        """Write `changes` (and apply them to `inst`); `status` changes are checked against TRANSITIONS."""
        if "status" in changes and changes["status"] != inst.status:
            allowed = TRANSITIONS[inst.status]
            if changes["status"] not in allowed:
                raise StaleState(f"instance {inst.id}: {inst.status} -> {changes['status']} is not allowed")
            expect = expect or (inst.status,)
        current = inst.to_dict()
        changes = {k: v for k, v in changes.items() if k == "status" or current.get(k) != v}
        if not changes:
            return
        changes["updated_at"] = now
        leaving = False
        merged = {**inst.to_dict(), **changes}
        if merged["status"] in ("terminated", "failed") and merged["teardown"] not in ("pending", "kept"):
            leaving = True
        await self._write(inst.id, fence, ",".join(expect or ()), changes, live="remove" if leaving else "")
        for k, v in changes.items():
            setattr(inst, k, v)

    async def get(self, instance_id: str) -> Instance | None:
        h = await self.redis.hgetall(keyspace.instance(instance_id))
        return Instance.from_hash(h) if h else None

    async def _many(self, ids: list[str]) -> list[Instance]:
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(keyspace.instance(i))
        return [Instance.from_hash(h) for h in await pipe.execute() if h]

    async def live(self) -> list[Instance]:
        ids = sorted(await self.redis.smembers(keyspace.LIVE))
        return sorted(await self._many(ids), key=lambda i: (i.created_at, i.id))

    async def recent(self, limit: int = 200) -> list[Instance]:
        return await self._many(list(await self.redis.zrevrange(keyspace.ALL, 0, limit - 1)))

    async def forget_before(self, cutoff: float, limit: int = 1000) -> int:
        """Delete finished instance records created before `cutoff` (history retention); live ones stay."""
        ids = await self.redis.zrangebyscore(keyspace.ALL, "-inf", int(cutoff * 1000), start=0, num=limit)
        gone = [i for i in ids if not await self.redis.sismember(keyspace.LIVE, i)]
        if gone:
            await self.redis.delete(*(keyspace.instance(i) for i in gone))
            await self.redis.zrem(keyspace.ALL, *gone)
        return len(gone)

    async def set_protect(self, instance_id: str, value: bool) -> Instance:
        """Operators protect/unprotect at any time, leader or not: the flag only ever prevents a destroy."""
        if not await self.redis.exists(keyspace.instance(instance_id)):
            raise KeyError(f"no instance {instance_id!r}")
        await self.redis.hset(keyspace.instance(instance_id), "protect", int(value))
        inst = await self.get(instance_id)
        assert inst is not None
        return inst


async def log_event(redis: RedisClient, now: float, kind: EventKind, message: str, **fields_: Any) -> None:
    """The autoscaler's journal for people: `offload autoscale events` and the API read it (viewer keys too), so
    the message is redacted once more here, whatever the caller did (offload/redact.py)."""
    entry = {
        "ts": repr(now),
        "kind": str(kind),
        "message": redact(message),
        **{k: str(v) for k, v in fields_.items() if v is not None},
    }
    await redis.xadd(keyspace.EVENTS, entry, maxlen=EVENTS_MAX, approximate=True)


async def read_events(redis: RedisClient, count: int = 50) -> list[dict[str, str]]:
    rows = await redis.xrevrange(keyspace.EVENTS, count=count)
    return [dict(fields_) for _, fields_ in reversed(rows)]
