"""API keys: scoped, stored hashed in Redis, shown in full exactly once (at creation).

A token is `ofk_<id>_<secret>`: the id finds the record with one read, and only the SHA-256 of the whole token
is stored, so a copy of the database (or a backup, or a `MONITOR` session) never yields a usable key. The
secret has 256 bits of entropy, which is why a fast unsalted hash is enough here (no password-style
stretching is needed for random tokens), and hashes are compared with `hmac.compare_digest` so timing
reveals nothing about how much of a guess was right.

A bootstrap admin key may come from `OFFLOAD_ADMIN_KEY`; it is never written to Redis, and unsetting the
variable (and restarting) revokes it. Being chosen by a person rather than generated, it must be at least 32
characters and hard to guess, judged by zxcvbn (repeats, sequences, keyboard walks, dictionary words and dates
count for little): at least 10^24 guesses (about 80 bits), so it cannot be guessed past the failed-auth limit.
The server refuses to start otherwise, in one line naming the variable.

With `durability` set, a key's creation and its revocation are acknowledged only once the replicas have them
(the store's mark and WAIT): a failover must not lose a key an admin has handed out, nor bring back one revoked.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from offload.env import env_str
from offload.errors import ConfigError, RequestError
from offload.queue.durability import Durability, NotReplicated, confirm
from offload.queue.keyspace import API_KEYS, api_key, validate_queue
from offload.redis_client import RedisClient

SCOPES = ("admin", "producer", "worker", "viewer")
ALL_QUEUES = "*"
TOKEN_PREFIX = "ofk_"
BOOTSTRAP_ID = "bootstrap"
ADMIN_ENV = "OFFLOAD_ADMIN_KEY"
MIN_ADMIN_KEY = 32
MIN_ADMIN_GUESSES_LOG10 = 24  # ~80 bits; `openssl rand -hex 32` scores ~63 (zxcvbn caps random text at 10^len)
JUDGED_CHARS = 100  # zxcvbn's time grows with length; a strong 100-character prefix is strong enough


class InvalidKeyRequest(RequestError, ValueError):
    """A key request is malformed (unknown scope, bad queue name, missing queues)."""


def check_admin_key(token: str) -> str:
    """The bootstrap admin key, if long and random enough to be a secret; else a ConfigError naming the variable."""
    if len(token) < MIN_ADMIN_KEY:
        raise ConfigError(
            f"{ADMIN_ENV} must be at least {MIN_ADMIN_KEY} characters (it has {len(token)}): "
            "generate one with `openssl rand -hex 32`"
        )
    if (why := _weakness(token)) is not None:
        raise ConfigError(f"{ADMIN_ENV} is too easy to guess ({why}): generate one with `openssl rand -hex 32`")
    return token


@functools.lru_cache(maxsize=8)
def _weakness(token: str) -> str | None:
    """What makes the key guessable, per zxcvbn (None: it is not)."""
    from zxcvbn import zxcvbn  # lazy: only a server with a bootstrap key needs it

    judged = zxcvbn(token[:JUDGED_CHARS])
    if judged["guesses_log10"] >= MIN_ADMIN_GUESSES_LOG10:
        return None
    patterns = sorted({m["pattern"] for m in judged["sequence"] if m["pattern"] != "bruteforce"})
    made_of = f"made of {', '.join(patterns)} patterns, " if patterns else ""
    return f"{made_of}about 10^{int(judged['guesses_log10'])} guesses, under 10^{MIN_ADMIN_GUESSES_LOG10}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ApiKey:
    """What a key may do. `queues` None means every queue."""

    id: str
    scope: str
    queues: frozenset[str] | None
    name: str = ""
    created_at: int = 0

    def covers(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues

    def to_dict(self) -> dict[str, Any]:
        """The public view: never the token, never its hash."""
        return {
            "id": self.id,
            "scope": self.scope,
            "queues": sorted(self.queues) if self.queues is not None else [ALL_QUEUES],
            "name": self.name,
            "created_at": self.created_at,
        }


def _check(scope: str, queues: list[str]) -> frozenset[str] | None:
    if scope not in SCOPES:
        raise InvalidKeyRequest(f"unknown scope {scope!r}; choose one of: {', '.join(SCOPES)}")
    if scope == "admin" or ALL_QUEUES in queues:
        return None
    if not queues:
        if scope == "viewer":
            return None
        raise InvalidKeyRequest(f"a {scope} key needs --queues (queue names, or '*' for every queue)")
    return frozenset(validate_queue(q) for q in queues)


class KeyStore:
    """Create, look up, list and revoke keys. Plain single-key commands, so it works on a cluster too."""

    def __init__(
        self, redis: RedisClient, bootstrap_token: str | None = None, durability: Durability | None = None
    ) -> None:
        self.redis = redis
        self.durability = durability
        self._bootstrap = hash_token(check_admin_key(bootstrap_token)) if bootstrap_token else None

    @classmethod
    def from_env(cls, redis: RedisClient, durability: Durability | None = None) -> KeyStore:
        return cls(redis, env_str(ADMIN_ENV) or None, durability)

    async def _replicated(self, key_id: str) -> None:
        """With durability: raise NotReplicated unless the replicas have the writes made so far (the caller's)."""
        if self.durability is not None:
            await confirm(self.redis, api_key(key_id), self.durability)

    async def create(self, scope: str, queues: list[str] | None = None, name: str = "") -> tuple[ApiKey, str]:
        """Returns the key and its token; the token cannot be recovered later."""
        allowed = _check(scope, list(queues or []))
        key_id = secrets.token_hex(6)
        token = f"{TOKEN_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        key = ApiKey(key_id, scope, allowed, name[:200], int(time.time() * 1000))
        await self.redis.hset(
            api_key(key_id),
            mapping={
                "hash": hash_token(token),
                "scope": scope,
                "name": key.name,
                "created_at": key.created_at,
                "queues": ALL_QUEUES if allowed is None else ",".join(sorted(allowed)),
            },
        )
        await self.redis.sadd(API_KEYS, key_id)
        try:
            await self._replicated(key_id)
        except NotReplicated:
            # never acknowledged, so its token is never shown: the record goes (from this primary; a replica that
            # lacked the write lacks the record too)
            with contextlib.suppress(RedisError, OSError):
                await self.redis.delete(api_key(key_id))
                await self.redis.srem(API_KEYS, key_id)
            raise
        return key, token

    async def authenticate(self, token: str) -> ApiKey | None:
        """The key for a presented token, or None. Unknown ids and wrong secrets take the same path."""
        return (await self.lookup(token))[0]

    async def lookup(self, token: str) -> tuple[ApiKey | None, str | None]:
        """(the key, None) for a good token; (None, the key id) for a wrong secret of a key that exists, which the
        server counts per key id; (None, None) for anything else. The answer to the client is the same for both
        failures: only the server's own counters tell them apart."""
        if not token or len(token) > 256:
            return None, None
        digest = hash_token(token)
        if self._bootstrap is not None and hmac.compare_digest(digest, self._bootstrap):
            return ApiKey(BOOTSTRAP_ID, "admin", None, "OFFLOAD_ADMIN_KEY"), None
        if not token.startswith(TOKEN_PREFIX):
            return None, None
        key_id, sep, _ = token[len(TOKEN_PREFIX) :].partition("_")
        if not sep or not key_id.isalnum():
            return None, None
        record = await self.redis.hgetall(api_key(key_id))
        if not record:
            return None, None
        if not hmac.compare_digest(digest, record.get("hash", "")):
            return None, key_id
        return _from_record(key_id, record), None

    async def alive(self, key: ApiKey) -> bool:
        """Whether a key authenticated earlier still exists (long-lived streams re-check on an interval)."""
        return key.id == BOOTSTRAP_ID or bool(await self.redis.exists(api_key(key.id)))

    async def list(self) -> list[ApiKey]:
        ids = sorted(await self.redis.smembers(API_KEYS))
        keys = []
        for key_id in ids:
            record = await self.redis.hgetall(api_key(key_id))
            if record:
                keys.append(_from_record(key_id, record))
        return keys

    async def revoke(self, key_id: str) -> bool:
        """True if the key existed. Takes effect on the next request (no cache)."""
        removed = int(await self.redis.delete(api_key(key_id)))
        await self.redis.srem(API_KEYS, key_id)
        await self._replicated(key_id)  # not acknowledged: the admin revokes again (a failover may bring it back)
        return removed > 0


def _from_record(key_id: str, record: dict[str, str]) -> ApiKey:
    raw = record.get("queues", "")
    queues = None if raw == ALL_QUEUES else frozenset(q for q in raw.split(",") if q)
    return ApiKey(
        key_id, record.get("scope", "viewer"), queues, record.get("name", ""), int(record.get("created_at") or 0)
    )
