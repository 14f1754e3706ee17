"""Checking that a webhook really comes from the provider: each provider's own signature, where it has one.

- Replicate: Standard Webhooks (`webhook-id`, `webhook-timestamp`, `webhook-signature`), checked by the
  `standardwebhooks` library with the backend's `webhook_secret` (whsec_...); it also rejects timestamps more
  than five minutes off, which bounds a replay of a captured delivery.
- fal: ED25519 over `request_id \\n user_id \\n timestamp \\n sha256(body)` (the `X-Fal-Webhook-*` headers), with
  the public keys fal publishes as a JWKS (`webhook_jwks_url`), fetched once and cached for `webhook_jwks_ttl_s`.
  A signature no cached key accepts fetches the keys again (fal rotated them), at most once a minute, so forged
  deliveries cannot make the server hammer the JWKS URL.
- RunPod: nothing to check; the per-submission secret in the URL (checked before this) is the whole proof.

Every failure is `Forged` with a reason for the log that carries no secret.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from standardwebhooks import Webhook, WebhookVerificationError

from offload.config import BackendSettings
from offload.errors import RequestError
from offload.http_client import make_client

FAL_TOLERANCE_S = 300  # as Standard Webhooks: a delivery older or newer than five minutes is refused
JWKS_REFRESH_MIN_S = 60.0
JWKS_MAX_BYTES = 64 << 10


class Forged(RequestError):
    """The delivery's signature does not check out (or cannot be checked)."""


@dataclass
class _Keys:
    keys: list[Ed25519PublicKey] = field(default_factory=list)
    fetched_at: float = float("-inf")


class Verifier:
    """Per-process verification state: the fal key cache (per JWKS URL) and an HTTP client to fetch keys."""

    def __init__(self, client: httpx.AsyncClient | None = None) -> None:
        self._client = client
        self._jwks: dict[str, _Keys] = {}
        self._lock = asyncio.Lock()

    async def verify(self, backend: BackendSettings, headers: Mapping[str, str], body: bytes) -> None:
        if backend.kind == "replicate":
            _replicate(backend, headers, body)
        elif backend.kind == "fal":
            await self._fal(backend, headers, body)
        elif backend.kind != "runpod":
            raise Forged(f"backend kind {backend.kind} has no webhooks")

    async def _fal(self, backend: BackendSettings, headers: Mapping[str, str], body: bytes) -> None:
        names = ("x-fal-webhook-request-id", "x-fal-webhook-user-id", "x-fal-webhook-timestamp")
        values = [headers.get(n, "") for n in names]
        signature = headers.get("x-fal-webhook-signature", "")
        if not all(values) or not signature:
            raise Forged("missing X-Fal-Webhook-* headers")
        try:
            stamp = int(values[2])
            raw = binascii.unhexlify(signature)
        except (ValueError, binascii.Error):
            raise Forged("unreadable X-Fal-Webhook-Timestamp or -Signature") from None
        if abs(time.time() - stamp) > FAL_TOLERANCE_S:
            raise Forged("X-Fal-Webhook-Timestamp is more than five minutes off")
        message = "\n".join([*values, hashlib.sha256(body).hexdigest()]).encode()
        url, ttl = backend.webhook_jwks_url, backend.webhook_jwks_ttl_s
        for refresh in (False, True):
            keys = await self._keys(url, ttl, refresh=refresh)
            if keys is None:
                break
            for key in keys:
                try:
                    key.verify(raw, message)
                    return
                except InvalidSignature:
                    continue
        raise Forged("no fal signing key accepts the signature")

    async def _keys(self, url: str, ttl: float, *, refresh: bool) -> list[Ed25519PublicKey] | None:
        """The cached keys; fetched when absent or older than `ttl`, or on `refresh` (None: not refreshed, the
        last fetch was too recent)."""
        async with self._lock:
            cached = self._jwks.setdefault(url, _Keys())
            age = time.monotonic() - cached.fetched_at
            if refresh and age < JWKS_REFRESH_MIN_S:
                return None
            if refresh or age > ttl or not cached.keys:
                if self._client is None:
                    self._client = make_client("webhook_keys")
                try:
                    response = await self._client.get(url)
                    response.raise_for_status()
                    if len(response.content) > JWKS_MAX_BYTES:
                        raise Forged("the JWKS document is too large")
                    cached.keys = _parse_jwks(response.json())
                except (httpx.HTTPError, ValueError) as exc:
                    if not cached.keys:
                        raise Forged(f"fal signing keys unavailable ({type(exc).__name__})") from None
                cached.fetched_at = time.monotonic()
            return cached.keys

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _replicate(backend: BackendSettings, headers: Mapping[str, str], body: bytes) -> None:
    if backend.webhook_secret is None:
        raise Forged("no webhook_secret configured for this replicate backend")
    wanted = {k: headers.get(k, "") for k in ("webhook-id", "webhook-timestamp", "webhook-signature")}
    try:
        Webhook(backend.webhook_secret.get_secret_value()).verify(body, wanted)
    except WebhookVerificationError as exc:
        raise Forged(f"Standard Webhooks signature: {exc}") from None
    except (binascii.Error, ValueError):  # the library decodes a hostile `v1,<not base64>` before comparing
        raise Forged("Standard Webhooks signature: not base64") from None


def _parse_jwks(doc: object) -> list[Ed25519PublicKey]:
    """The ED25519 keys (`kty` OKP, `crv` Ed25519, `x` base64url) of a JWKS document; others are skipped."""
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise ValueError("not a JWKS document")
    keys = []
    for entry in doc["keys"]:
        if isinstance(entry, dict) and entry.get("kty") == "OKP" and entry.get("crv") == "Ed25519":
            x = entry.get("x")
            if isinstance(x, str):
                try:
                    raw = base64.urlsafe_b64decode(x + "=" * (-len(x) % 4))
                    keys.append(Ed25519PublicKey.from_public_bytes(raw))
                except (ValueError, binascii.Error):
                    continue
    if not keys:
        raise ValueError("no Ed25519 key in the JWKS document")
    return keys
