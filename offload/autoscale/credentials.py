"""Named credentials in the vault: the tokens a rented machine needs to clone a private repository.

A queue's `deployment.git_credential` names one; the value is never in the queue block, an event, a log or the
API. It is stored AES-GCM encrypted with OFFLOAD_VAULT_MASTER_KEY (see vault.py) and revealed only when a
machine is rented, into that machine's environment (OFFLOAD_GIT_TOKEN, and OFFLOAD_GIT_USERNAME when the value
is `username:token`). They are set from the CLI by the operator (`offload autoscale credentials set NAME --host
github.com`): there is no HTTP route that reads or writes them.

Each credential is bound to the git host it was given for: revealed only for a deployment whose `git_url` names
that host, so a block pointing at another host (a server that logs what it is sent) never gets it. The host is
part of the sealed value's authenticated context, so the binding cannot be changed without the master key.
Credentials stored before the binding existed have no host and are refused until set again with one.
"""

from __future__ import annotations

import re

from offload.autoscale import keyspace
from offload.autoscale.deploy import git_host
from offload.autoscale.provider_store import MASK, check_name, mask
from offload.autoscale.vault import Vault
from offload.errors import ConfigError
from offload.redis_client import RedisClient

HOST = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")


def check_host(host: str) -> str:
    host = host.strip().lower()
    if not HOST.match(host):
        raise ConfigError(f"host: {host!r} is not a git host name (e.g. github.com)")
    return host


class Credentials:
    def __init__(self, redis: RedisClient, vault: Vault | None = None) -> None:
        self.redis = redis
        self.vault = vault

    def _vault(self) -> Vault:
        if self.vault is None:
            self.vault = Vault.from_env()
        return self.vault

    async def set(self, name: str, value: str, host: str) -> None:
        """Store `value` for clones from `host` only."""
        check_name(name, "credential")
        host = check_host(host)
        if not value or value.startswith(MASK):
            raise ConfigError("value: empty (or still masked): give the token itself")
        sealed = self._vault().encrypt(value, _context(name, host))
        await self.redis.set(keyspace.credential_host(name), host)
        await self.redis.set(keyspace.credential(name), sealed)
        await self.redis.sadd(keyspace.CREDENTIALS, name)

    async def host(self, name: str) -> str | None:
        """The git host the credential is bound to (None: it has none, or does not exist)."""
        found: str | None = await self.redis.get(keyspace.credential_host(name))
        return found

    async def problem(self, name: str, git_url: str) -> str | None:
        """Why the credential must not be revealed for a clone of `git_url` (None: it may)."""
        where = f"deployment.git_credential: credential {name!r}"
        if not await self.redis.exists(keyspace.credential(name)):
            return f"{where} does not exist (offload autoscale credentials set NAME --host HOST)"
        bound = await self.host(name)
        if not bound:
            return f"{where} is bound to no git host: set it again with --host"
        if git_host(git_url) != bound:
            return f"{where} is bound to {bound}; deployment.git_url goes to {git_host(git_url) or 'no host'}"
        return None

    async def reveal(self, name: str, git_url: str) -> tuple[str | None, str]:
        """(username or None, token) of a credential, for a clone of `git_url` only; ConfigError naming why not."""
        if why := await self.problem(name, git_url):
            raise ConfigError(why)
        sealed: str = await self.redis.get(keyspace.credential(name)) or ""
        value = self._vault().decrypt(sealed, _context(name, git_host(git_url)))
        user, sep, token = value.partition(":")
        return (user, token) if sep and user and token else (None, value)

    async def list(self) -> dict[str, dict[str, str]]:
        """Names with their values masked (`****abcd`) and the git host each is bound to."""
        out = {}
        for name in sorted(await self.redis.smembers(keyspace.CREDENTIALS)):
            sealed = await self.redis.get(keyspace.credential(name))
            if sealed is None:
                continue
            host = await self.host(name) or ""
            try:
                shown = mask(self._vault().decrypt(sealed, _context(name, host)))
            except ConfigError:
                shown = MASK
            out[name] = {"value": shown, "host": host}
        return out

    async def delete(self, name: str) -> bool:
        gone = bool(await self.redis.delete(keyspace.credential(name)))
        await self.redis.delete(keyspace.credential_host(name))
        await self.redis.srem(keyspace.CREDENTIALS, name)
        return gone


def _context(name: str, host: str) -> str:
    return f"credential:{name}@{host}" if host else f"credential:{name}"
