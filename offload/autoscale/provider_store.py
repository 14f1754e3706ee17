"""Named provider configurations in Redis, credentials encrypted (see vault.py) and masked when read back.

Secret fields (each provider type declares them, e.g. `api_key`) are split off and stored as one AES-GCM
blob; everything else is plain JSON so `providers list` works without the master key. A type without secrets
(`mock`, `local`) needs no master key at all. Reading back shows
`****` plus the last four characters. Saving with a secret missing or still masked keeps the stored value,
so a form (or `providers update`) never has to retype a key it did not mean to change, except when the
update moves the provider to another endpoint (`base_url`): the stored key would then be sent to a host it
was never meant for, so every secret must be given again.

Each record says who made it (`origin`): `operator` (the CLI on the server's host, direct Redis access) or
`api` (an admin key over HTTP; also records written before origins were kept, until `offload providers adopt`).
Only an operator-made provider receives the operator's secrets (offload/autoscale/operator_only.py), and the
HTTP API can neither change nor delete one. Its `destination` (a digest of the record's random uid, type and
endpoint) changes when the provider is re-created under the same name or moved, so values bound to where a
provider pointed are not sent to where it points now.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson

from offload.autoscale import keyspace
from offload.autoscale.operator_only import API, OPERATOR
from offload.autoscale.providers import HOST_TYPES, TYPES, validate_config
from offload.autoscale.vault import Vault
from offload.errors import ConfigError, RequestError
from offload.queue.scripts import SCRIPTS
from offload.redis_client import RedisClient

MASK = "****"
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")


class ProviderNotFound(RequestError, KeyError):
    """No provider by that name."""


class ProviderInUse(RequestError, ValueError):
    """A provider with live instances cannot be deleted (they would be leaked)."""


def mask(value: str) -> str:
    return MASK + value[-4:] if len(value) >= 12 else MASK


@dataclass
class ProviderRecord:
    name: str
    type: str
    config: dict[str, Any]  # secrets masked unless revealed
    created_at: int
    updated_at: int
    origin: str = API
    destination: str = ""  # where its requests go, as a digest (see the module's docstring)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "origin": self.origin,
            "config": self.config,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


def check_name(name: str, what: str = "provider") -> str:
    if not name or len(name) > 64 or not set(name.lower()) <= NAME_CHARS:
        raise ConfigError(f"name: invalid {what} name {name!r} (1-64 of a-z 0-9 - _ .)")
    return name


def _origin(raw: dict[str, str]) -> str:
    """Who made the provider. The API never creates a type that runs on this host, so those are the operator's."""
    return OPERATOR if raw.get("type") in HOST_TYPES else raw.get("origin") or API


def _destination(name: str, raw: dict[str, str]) -> str:
    """A digest of where a provider's requests go: its identity (uid, or creation time for older records),
    type and endpoint settings. Re-created under the same name or moved, it differs."""
    kind = TYPES.get(raw.get("type", ""))
    plain = orjson.loads(raw.get("config") or "{}")
    endpoint = {f: plain.get(f) for f in (kind.endpoint_fields if kind else ())}
    ident = [name, raw.get("uid") or raw.get("created_at", ""), raw.get("type", ""), endpoint]
    return hashlib.sha256(orjson.dumps(ident, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


class ProviderStore:
    def __init__(self, redis: RedisClient, vault: Vault | None = None) -> None:
        self.redis = redis
        self.vault = vault
        self._pending: list[tuple[str, str, str]] = []

    def _need_vault(self) -> Vault:
        if self.vault is None:
            self.vault = Vault.from_env()
        return self.vault

    def _vault_for(self, kind: str) -> Vault | None:
        """The vault, for a type that has secrets (refusing without a master key); None for one that has none."""
        return self._need_vault() if kind in TYPES and TYPES[kind].secret_fields else None

    async def create(self, name: str, kind: str, config: dict[str, Any], *, origin: str = OPERATOR) -> ProviderRecord:
        """`origin`: OPERATOR from the CLI (direct Redis access), API from the HTTP API."""
        check_name(name)
        validate_config(kind, config)
        vault = self._vault_for(kind)  # refuse before anything is stored
        if await self.redis.exists(keyspace.provider(name)):
            raise ConfigError(f"name: a provider named {name!r} exists (use update)")
        await self._save(vault, name, kind, config, created=None, origin=origin, uid=secrets.token_hex(8))
        return await self.get(name)

    async def adopt(self, name: str) -> ProviderRecord:
        """The operator vouches for a provider made over the API (or before origins were recorded): from now on
        it receives the operator's secrets, and the API can no longer change or delete it."""
        await self._raw(name)
        await self.redis.hset(keyspace.provider(name), "origin", OPERATOR)
        return await self.get(name)

    async def update(self, name: str, changes: dict[str, Any]) -> ProviderRecord:
        raw = await self._raw(name)
        vault = self._vault_for(raw["type"])
        current = self._decrypt(vault, name, raw)
        merged = dict(current)
        kind = TYPES[raw["type"]]
        moved = [f for f in kind.endpoint_fields if f in changes and changes[f] != current.get(f)]

        def retyped(field: str) -> bool:
            value = changes.get(field)
            return value is not None and not str(value).startswith(MASK)

        if moved and (stale := [f for f in kind.secret_fields if current.get(f) and not retyped(f)]):
            raise ConfigError(
                f"config.{stale[0]}: changing {moved[0]} needs {stale[0]} again (the stored one "
                "would otherwise be sent to the new host)"
            )
        for field, value in changes.items():
            if field in kind.secret_fields and not retyped(field):
                continue  # not retyped: keep the stored secret
            merged[field] = value
        validate_config(raw["type"], merged)
        await self._save(
            vault,
            name,
            raw["type"],
            merged,
            created=int(raw["created_at"]),
            origin=raw.get("origin") or API,
            uid=raw.get("uid") or "",
        )
        return await self.get(name)

    async def _save(
        self,
        vault: Vault | None,
        name: str,
        kind: str,
        config: dict[str, Any],
        created: int | None,
        *,
        origin: str,
        uid: str,
    ) -> None:
        secret_names = TYPES[kind].secret_fields
        hidden = {k: v for k, v in config.items() if k in secret_names and v is not None}
        plain = {k: v for k, v in config.items() if k not in secret_names}
        now = int(time.time() * 1000)
        sealed = vault.encrypt(orjson.dumps(hidden).decode(), f"provider:{name}") if vault is not None else ""
        await self.redis.hset(
            keyspace.provider(name),
            mapping={
                "type": kind,
                "config": orjson.dumps(plain),
                "secrets": sealed,
                "secret_fields": ",".join(sorted(hidden)),
                "created_at": created or now,
                "updated_at": now,
                "origin": origin,
                "uid": uid,
            },
        )
        await self.redis.sadd(keyspace.PROVIDERS, name)

    async def _raw(self, name: str) -> dict[str, str]:
        raw: dict[str, str] = await self.redis.hgetall(keyspace.provider(name))
        if not raw:
            raise ProviderNotFound(f"no provider named {name!r}")
        return raw

    def _decrypt(self, vault: Vault | None, name: str, raw: dict[str, str]) -> dict[str, Any]:
        config: dict[str, Any] = orjson.loads(raw["config"])
        if raw.get("secrets"):  # a mock provider holds no secret and needs no vault
            vault = vault or self._need_vault()
            plain = vault.decrypt(raw["secrets"], f"provider:{name}")
            config.update(orjson.loads(plain))
            if Vault.outdated(raw["secrets"]):
                self._pending.append((name, raw["secrets"], vault.encrypt(plain, f"provider:{name}")))
        return config

    async def _upgrade(self) -> None:
        """Rewrite records read in an older vault format (see vault.py), unless they changed meanwhile."""
        while self._pending:
            name, old, new = self._pending.pop()
            await SCRIPTS.provider_swap(self.redis, [keyspace.provider(name)], [old, new])

    async def get(self, name: str, *, reveal: bool = False) -> ProviderRecord:
        raw = await self._raw(name)
        if reveal:
            config = self._decrypt(self.vault, name, raw)
        else:
            config = orjson.loads(raw["config"])
            if raw.get("secret_fields"):
                try:
                    revealed = self._decrypt(self._need_vault(), name, raw)
                    config.update({k: mask(str(revealed[k])) for k in raw["secret_fields"].split(",")})
                except ConfigError:  # no or another master key: still list it, secrets fully masked
                    config.update(dict.fromkeys(raw["secret_fields"].split(","), MASK))
        await self._upgrade()
        return ProviderRecord(
            name,
            raw["type"],
            config,
            int(raw["created_at"]),
            int(raw["updated_at"]),
            origin=_origin(raw),
            destination=_destination(name, raw),
        )

    async def origin_of(self, name: str) -> tuple[str, str] | None:
        """(origin, destination) of a provider without reading any secret; None: no such provider."""
        raw: dict[str, str] = await self.redis.hgetall(keyspace.provider(name))
        return (_origin(raw), _destination(name, raw)) if raw else None

    async def list(self) -> list[ProviderRecord]:
        names = sorted(await self.redis.smembers(keyspace.PROVIDERS))
        out = []
        for name in names:
            try:
                out.append(await self.get(name))
            except ProviderNotFound:
                await self.redis.srem(keyspace.PROVIDERS, name)
        return out

    async def type_of(self, name: str) -> str | None:
        """The provider's type, without reading any secret (None: no such provider)."""
        kind: str | None = await self.redis.hget(keyspace.provider(name), "type")
        return kind

    async def delete(self, name: str) -> None:
        await self._raw(name)
        for instance_id in await self.redis.smembers(keyspace.LIVE):
            if await self.redis.hget(keyspace.instance(instance_id), "provider") == name:
                raise ProviderInUse(
                    f"provider {name!r} still has live instance {instance_id}: scale it to zero "
                    "(or wait for teardown) before deleting the provider"
                )
        await self.redis.delete(keyspace.provider(name))
        await self.redis.srem(keyspace.PROVIDERS, name)
