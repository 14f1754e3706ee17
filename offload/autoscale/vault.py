"""Encryption of provider credentials at rest: AES-256-GCM under a key derived from OFFLOAD_VAULT_MASTER_KEY.

Why not store them plainly: Redis backups, replicas and `MONITOR` sessions see everything, and a provider key
can rent machines on the owner's card. The master key never touches Redis; only a short fingerprint of it is
stored beside each secret, so a server started with a different master key says so instead of failing with a
bare authentication-tag error. The provider's name is authenticated data, so a ciphertext copied onto another
provider's record does not decrypt.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from offload.errors import ConfigError

ENV = "OFFLOAD_VAULT_MASTER_KEY"
VERSION = "v1"
MIN_KEY_CHARS = 16


class VaultError(ConfigError):
    """No master key, a wrong one, or a damaged ciphertext."""


class Vault:
    def __init__(self, master_key: str) -> None:
        if len(master_key) < MIN_KEY_CHARS:
            raise VaultError(f"{ENV} must be at least {MIN_KEY_CHARS} characters (use a random 32-byte value)")
        material = master_key.encode()
        self._key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"offload-vault", info=b"provider-secrets"
                         ).derive(material)
        self.fingerprint = hashlib.sha256(b"offload-vault-fp" + self._key).hexdigest()[:12]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Vault:
        env = os.environ if env is None else env
        key = env.get(ENV)
        if not key:
            raise VaultError(f"{ENV} is not set: provider credentials are stored encrypted with it, so providers "
                             "cannot be created or used without it")
        return cls(key)

    def encrypt(self, plaintext: str, context: str) -> str:
        nonce = os.urandom(12)
        sealed = AESGCM(self._key).encrypt(nonce, plaintext.encode(), context.encode())
        return f"{VERSION}:{self.fingerprint}:{base64.urlsafe_b64encode(nonce + sealed).decode()}"

    def decrypt(self, token: str, context: str) -> str:
        try:
            version, fingerprint, blob = token.split(":", 2)
        except ValueError:
            raise VaultError("stored secret is not in the vault format") from None
        if version != VERSION:
            raise VaultError(f"stored secret has unknown format {version!r}")
        if fingerprint != self.fingerprint:
            raise VaultError(f"stored secret of {context!r} was encrypted with another {ENV} "
                             f"(fingerprint {fingerprint}, this server has {self.fingerprint})")
        raw = base64.urlsafe_b64decode(blob.encode())
        try:
            return AESGCM(self._key).decrypt(raw[:12], raw[12:], context.encode()).decode()
        except InvalidTag:
            raise VaultError(f"stored secret of {context!r} does not decrypt (damaged or moved)") from None
