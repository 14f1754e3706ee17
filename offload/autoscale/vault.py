"""Encryption of provider credentials at rest: AES-256-GCM under a key derived from OFFLOAD_VAULT_MASTER_KEY.

Why not store them plainly: Redis backups, replicas and `MONITOR` sessions see everything, and a provider key
can rent machines on the owner's card. The master key never touches Redis; only a short fingerprint of the
derived key is stored beside each secret, so a server started with a different master key says so instead of
failing with a bare authentication-tag error. The provider's name is authenticated data, so a ciphertext
copied onto another provider's record does not decrypt.

The key is derived with scrypt (`cryptography`'s, n=2^15, r=8, p=1: ~0.1 s and 32 MiB per derivation) under a
random salt stored in the token, so the fingerprint in a copy of the database is no shortcut to guessing the
master key offline: every guess costs a full scrypt. A process derives once per salt (cached) and writes with
one salt of its own, so a provider listing costs one derivation, not one per record.

Format `v2:<salt>:<fingerprint>:<nonce+ciphertext>` (urlsafe base64). Records written before it (`v1`, HKDF
with a fixed salt) are still read; `ProviderStore` rewrites each as v2 the first time it decrypts it.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from offload.env import process_env
from offload.errors import ConfigError

ENV = "OFFLOAD_VAULT_MASTER_KEY"
VERSION = "v2"
LEGACY = "v1"
MIN_KEY_CHARS = 16
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1


class VaultError(ConfigError):
    """No master key, a wrong one, or a damaged ciphertext."""


@functools.lru_cache(maxsize=64)
def _scrypt(master_key: str, salt: bytes) -> bytes:
    return Scrypt(salt=salt, length=32, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P).derive(master_key.encode())


@functools.lru_cache(maxsize=8)
def _process_salt(master_key: str) -> bytes:
    """The salt this process encrypts with (per master key): one derivation per process, not per write."""
    return os.urandom(16)


def _fingerprint(key: bytes) -> str:
    return hashlib.sha256(b"offload-vault-fp" + key).hexdigest()[:12]


def _b64decode(text: str, context: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text.encode())
    except (binascii.Error, ValueError):
        raise VaultError(f"stored secret of {context!r} is damaged (not valid base64)") from None


class Vault:
    def __init__(self, master_key: str) -> None:
        if len(master_key) < MIN_KEY_CHARS:
            raise VaultError(f"{ENV} must be at least {MIN_KEY_CHARS} characters (use a random 32-byte value)")
        self._master = master_key

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Vault:
        env = process_env() if env is None else env
        key = env.get(ENV)
        if not key:
            raise VaultError(
                f"{ENV} is not set: provider credentials are stored encrypted with it, so providers "
                "cannot be created or used without it"
            )
        return cls(key)

    def encrypt(self, plaintext: str, context: str) -> str:
        salt = _process_salt(self._master)
        key = _scrypt(self._master, salt)
        nonce = os.urandom(12)
        sealed = AESGCM(key).encrypt(nonce, plaintext.encode(), context.encode())
        return ":".join(
            (
                VERSION,
                base64.urlsafe_b64encode(salt).decode(),
                _fingerprint(key),
                base64.urlsafe_b64encode(nonce + sealed).decode(),
            )
        )

    @staticmethod
    def outdated(token: str) -> bool:
        """Written in an older format: worth rewriting (ProviderStore does, on first decrypt)."""
        return token.startswith(LEGACY + ":")

    def decrypt(self, token: str, context: str) -> str:
        version, _, rest = token.partition(":")
        if version == VERSION:
            salt_text, fingerprint, blob = [*rest.split(":", 2), "", ""][:3]
            key = _scrypt(self._master, _b64decode(salt_text, context))
        elif version == LEGACY:
            fingerprint, _, blob = rest.partition(":")
            key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"offload-vault", info=b"provider-secrets").derive(
                self._master.encode()
            )
        else:
            raise VaultError("stored secret is not in the vault format")
        if not blob:
            raise VaultError("stored secret is not in the vault format")
        if fingerprint != _fingerprint(key):
            raise VaultError(
                f"stored secret of {context!r} was encrypted with another {ENV} "
                f"(fingerprint {fingerprint}, this server has {_fingerprint(key)})"
            )
        raw = _b64decode(blob, context)
        if len(raw) < 12 + 16:
            raise VaultError(f"stored secret of {context!r} is damaged (too short)")
        try:
            return AESGCM(key).decrypt(raw[:12], raw[12:], context.encode()).decode()
        except InvalidTag:
            raise VaultError(f"stored secret of {context!r} does not decrypt (damaged or moved)") from None
