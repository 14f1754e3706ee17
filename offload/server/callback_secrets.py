"""Each queue's completion-webhook signing secret (Standard Webhooks' `whsec_<base64>`): made on first use, stored
sealed by the vault (offload/autoscale/vault.py, as provider credentials are: a Redis backup or replica never holds
it in the clear), rotated on an admin's request with the old one still signing through a grace period, so a
receiver that switches secrets meanwhile never sees a webhook fail verification.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from offload.autoscale.vault import Vault, VaultError
from offload.queue.outbox import Outbox

PREFIX = "whsec_"


def new_secret() -> str:
    """A fresh secret in Standard Webhooks' form: 32 random bytes, base64, after `whsec_`."""
    return PREFIX + base64.b64encode(os.urandom(32)).decode()


def _context(queue: str) -> str:
    """The vault's authenticated data: a sealed secret copied onto another queue does not open."""
    return f"callback-secret:{queue}"


@dataclass(frozen=True, slots=True)
class QueueSecrets:
    """A queue's secrets in the clear, for the sender and for an admin: the previous one only while it signs."""

    current: str
    previous: str | None = None
    previous_until: int | None = None  # epoch ms

    @property
    def signing(self) -> list[str]:
        return [self.current] if self.previous is None else [self.current, self.previous]


class CallbackSecrets:
    """`vault` is made on first use (OFFLOAD_VAULT_MASTER_KEY), so a server without callbacks never needs one."""

    def __init__(self, outbox: Outbox, vault: Callable[[], Vault] = Vault.from_env) -> None:
        self.outbox = outbox
        self._make_vault = vault
        self._vault: Vault | None = None

    def _sealer(self) -> Vault:
        if self._vault is None:
            self._vault = self._make_vault()  # VaultError names the variable when it is not set
        return self._vault

    def problem(self) -> str | None:
        """Why no secret can be kept (no vault key), for one warning at start; None when it can."""
        try:
            self._sealer()
        except VaultError as exc:
            return str(exc)
        return None

    async def get(self, queue: str, now_ms: int | None = None) -> QueueSecrets:
        """The queue's secrets, its first one made now if it has none; a previous one past its grace left out."""
        vault = self._sealer()
        sealed = await self.outbox.sealed_secrets(queue)
        if sealed.current is None:
            await self.outbox.seal_first(queue, vault.encrypt(new_secret(), _context(queue)))
            sealed = await self.outbox.sealed_secrets(queue)  # another server's, if it was first
        assert sealed.current is not None
        now = int(time.time() * 1000) if now_ms is None else now_ms
        current = vault.decrypt(sealed.current, _context(queue))
        if sealed.previous is None or sealed.previous_until is None or sealed.previous_until <= now:
            return QueueSecrets(current)
        return QueueSecrets(current, vault.decrypt(sealed.previous, _context(queue)), sealed.previous_until)

    async def rotate(self, queue: str, grace_s: int) -> QueueSecrets:
        """A new current secret; the old one keeps signing for `grace_s` (0: it stops at once)."""
        vault = self._sealer()
        await self.get(queue)  # a queue rotated before its first use has an old secret to keep
        await self.outbox.rotate(queue, vault.encrypt(new_secret(), _context(queue)), grace_s * 1000)
        return await self.get(queue)
