"""Named credentials in the vault: the tokens a rented machine needs to clone a private repository.

A queue's `deployment.git_credential` names one; the value is never in the queue block, an event, a log or the
API. It is stored AES-GCM encrypted with OFFLOAD_VAULT_MASTER_KEY (see vault.py, the credential's name is the
authenticated context) and revealed only when a machine is rented, into that machine's environment
(OFFLOAD_GIT_TOKEN, and OFFLOAD_GIT_USERNAME when the value is `username:token`). They are set from the CLI by
the operator (`offload autoscale credentials set NAME`): there is no HTTP route that reads or writes them.
"""

from __future__ import annotations

from offload.autoscale import keys
from offload.autoscale.provider_store import MASK, check_name, mask
from offload.autoscale.vault import Vault
from offload.errors import ConfigError
from offload.redis_client import RedisClient


class Credentials:
    def __init__(self, redis: RedisClient, vault: Vault | None = None) -> None:
        self.redis = redis
        self.vault = vault

    def _vault(self) -> Vault:
        if self.vault is None:
            self.vault = Vault.from_env()
        return self.vault

    async def set(self, name: str, value: str) -> None:
        check_name(name, "credential")
        if not value or value.startswith(MASK):
            raise ConfigError("value: empty (or still masked): give the token itself")
        sealed = self._vault().encrypt(value, f"credential:{name}")
        await self.redis.set(keys.credential(name), sealed)
        await self.redis.sadd(keys.CREDENTIALS, name)

    async def reveal(self, name: str) -> tuple[str | None, str]:
        """(username or None, token) of a credential; ConfigError naming it when it does not exist."""
        sealed = await self.redis.get(keys.credential(name))
        if sealed is None:
            raise ConfigError(
                f"deployment.git_credential: no credential named {name!r} (offload autoscale credentials set NAME)"
            )
        value = self._vault().decrypt(sealed, f"credential:{name}")
        user, sep, token = value.partition(":")
        return (user, token) if sep and user and token else (None, value)

    async def list(self) -> dict[str, str]:
        """Names with their values masked (`****abcd`)."""
        out = {}
        for name in sorted(await self.redis.smembers(keys.CREDENTIALS)):
            sealed = await self.redis.get(keys.credential(name))
            if sealed is None:
                continue
            try:
                out[name] = mask(self._vault().decrypt(sealed, f"credential:{name}"))
            except ConfigError:
                out[name] = MASK
        return out

    async def delete(self, name: str) -> bool:
        gone = bool(await self.redis.delete(keys.credential(name)))
        await self.redis.srem(keys.CREDENTIALS, name)
        return gone
