"""`fal`: fal's queue API (provider-apis.md A3).

Submit is `POST {base}/{app}` with the raw input as the body and `Authorization: Key <key>`; the answer carries
`status_url`, `response_url` and `cancel_url`, which we follow rather than rebuild, because fal drops the app's
subpath from them (`fal-ai/flux/dev` is polled under `fal-ai/flux/requests/...`). Status is 202 while IN_QUEUE /
IN_PROGRESS and 200 when COMPLETED; COMPLETED also covers failure (`error`) and cancellation, so only a COMPLETED
without `error` fetches `response_url` for the output. `metrics.inference_time` -> duration_s. Cancel is PUT.

Remote id (what a different worker needs to resume): normally the response URL relative to `base_url`,
e.g. `fal-ai/flux/requests/<request_id>`, from which status (`/status`) and cancel (`/cancel`) follow as fal
documents. If an answer ever departs from that shape, the id is a JSON object of the three absolute URLs instead.
The key is only ever sent to `base_url`'s origin: URLs pointing elsewhere are refused (Fatal).
Webhooks: `submit(webhook=...)` goes out as `?fal_webhook=`; fal posts `{"request_id", "status": OK|ERROR,
"payload"}` once, signed with ED25519 (checked by the server); the payload is the output.
Tagging: with `webhook_url`, `?fal_webhook=` carries `offload_tag=<job id>`; fal cannot list requests, so `find`
returns None.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
import orjson

from offload.backends.base import Fatal, HookEvent, RemoteResult, Submission
from offload.backends.http import (
    HttpBackend,
    decode,
    same_origin,
    tagged_url,
    warn_unknown_status,
)
from offload.backends.settings import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_TIMEOUT,
    FAL_BASE,
    FalSettings,
)

DEFAULT_BASE = FAL_BASE
CANCELLED_TYPES = frozenset({"request_cancelled", "cancelled"})
URL_KEYS = ("response_url", "status_url", "cancel_url")
NAMESPACES = frozenset({"workflows", "comfy"})  # apps whose status/result URLs keep three path parts


class FalBackend(HttpBackend):
    """One fal app (`owner/app[/subpath]`) on the queue host."""

    kind = "fal"
    auth_scheme = "Key"

    def __init__(
        self,
        name: str,
        *,
        app: str,
        base_url: str = DEFAULT_BASE,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        webhook_url: str | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            name,
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_connections=max_connections,
            max_response_bytes=max_response_bytes,
            client=client,
        )
        self._submit_url = f"{self.base_url}/{quote(app.strip('/'), safe='/')}"
        parts = app.strip("/").split("/")
        self._short_app = "/".join(parts[: 3 if parts[0] in NAMESPACES else 2])
        self._webhook = webhook_url

    @classmethod
    def from_settings(cls, name: str, s: FalSettings, client: httpx.AsyncClient | None) -> FalBackend:
        return cls(name, app=s.app, **s.http(), webhook_url=s.webhook_url, client=client)

    # --- remote id <-> URLs ---------------------------------------------------------------------------------

    def _check(self, url: str) -> str:
        if not same_origin(url, self.base_url):
            raise Fatal(
                f"fal backend {self.name!r}: the provider pointed at {httpx.URL(url).host}, not base_url's "
                "host; refusing to send the API key there (set base_url to the queue host fal uses)"
            )
        return url

    def encode(self, urls: dict[str, str]) -> str:
        response = urls["response_url"]
        prefix = f"{self.base_url}/"
        if (
            response.startswith(prefix)
            and urls["status_url"] == f"{response}/status"
            and urls["cancel_url"] == f"{response}/cancel"
        ):
            return response[len(prefix) :]
        return orjson.dumps({k: urls[k] for k in URL_KEYS}).decode()

    def decode_id(self, remote_id: str) -> dict[str, str]:
        if remote_id.startswith("{"):
            try:
                urls = orjson.loads(remote_id)
            except orjson.JSONDecodeError:
                urls = None
            if not isinstance(urls, dict) or not all(isinstance(urls.get(k), str) for k in URL_KEYS):
                raise Fatal(f"fal backend {self.name!r}: unreadable remote id {remote_id[:200]!r}")
            return {k: self._check(urls[k]) for k in URL_KEYS}
        response = f"{self.base_url}/{remote_id.strip('/')}"
        return {"response_url": response, "status_url": f"{response}/status", "cancel_url": f"{response}/cancel"}

    # --- the Backend protocol -------------------------------------------------------------------------------

    async def submit(
        self, job_input: Any, *, tag: str, idempotency_key: str | None = None, webhook: str | None = None
    ) -> Submission:
        url = self._submit_url
        if webhook or self._webhook:
            hook = webhook or tagged_url(self._webhook or "", tag)
            url = str(httpx.URL(url).copy_merge_params({"fal_webhook": hook}))
        body = await self._call("POST", url, json=job_input, has_body=True, idempotency_key=idempotency_key)
        self._require(body, "request_id", str, "submit")
        urls = {k: self._check(self._require(body, k, str, "submit")) for k in URL_KEYS}
        return Submission(self.encode(urls))

    def hook_event(self, body: Any) -> HookEvent | None:
        """fal calls back once, when the request is done: `{"request_id", "status": OK|ERROR, "payload"}`. The
        remote id is rebuilt the way fal names its URLs: the app's `owner/app` (namespaced apps keep three
        parts), `/requests/<id>`."""
        if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
            return None
        request_id = body["request_id"]
        if not request_id or "/" in request_id or body.get("status") not in ("OK", "ERROR"):
            return None
        return HookEvent(f"{self._short_app}/requests/{request_id}", True)

    def hook_result(self, body: Any) -> RemoteResult | None:
        """OK with a payload: the output. ERROR: failed, with fal's error. A payload fal could not deliver
        (`payload_error`, e.g. too large) is fetched by a poll instead (None)."""
        if not isinstance(body, dict) or body.get("payload_error"):
            return None
        payload = body.get("payload")
        if body.get("status") == "OK" and payload is not None:
            return RemoteResult("succeeded", output=payload)
        if body.get("status") == "ERROR":
            detail = payload.get("detail") if isinstance(payload, dict) else None
            error_type = payload.get("error_type") if isinstance(payload, dict) else None
            if error_type in CANCELLED_TYPES:
                return RemoteResult("cancelled")
            text = str(body.get("error") or detail or "request failed (no error given)")
            return RemoteResult("failed", error=self._redact(f"{error_type}: {text}" if error_type else text))
        return None

    async def poll(self, remote_id: str) -> RemoteResult:
        urls = self.decode_id(remote_id)
        body = await self._call("GET", urls["status_url"], known=True)
        raw = self._require(body, "status", str, "poll")
        if raw in ("IN_QUEUE", "IN_PROGRESS"):
            return RemoteResult("queued" if raw == "IN_QUEUE" else "running")
        if raw != "COMPLETED":
            warn_unknown_status(self.kind, raw)
            return RemoteResult("running")
        metrics = body.get("metrics") if isinstance(body.get("metrics"), dict) else {}
        inference = metrics.get("inference_time")
        duration = float(inference) if isinstance(inference, int | float) and inference >= 0 else None
        error, error_type = body.get("error"), body.get("error_type")
        if error_type in CANCELLED_TYPES:
            return RemoteResult("cancelled", duration_s=duration, metrics=metrics)
        if error:
            text = f"{error_type}: {error}" if error_type else str(error)
            return RemoteResult("failed", error=self._redact(text), duration_s=duration, metrics=metrics)
        return await self._result(urls["response_url"], duration, metrics)

    async def _result(self, url: str, duration: float | None, metrics: dict[str, Any]) -> RemoteResult:
        """The output of a COMPLETED request. A non-2xx answer that fal marks as the model's own error
        (`error_type` / `X-Fal-Error-Type`, or a 422 validation error) is a failed job; anything else is mapped
        like any other response (an ingress 503 is Transient, a 404 NotFound)."""
        response = await self._send("GET", url)
        what = self._what("GET", url)
        if 200 <= response.status_code < 300:
            output = decode(response, what=what, secrets=[self._api_key])
            return RemoteResult("succeeded", output=output, duration_s=duration, metrics=metrics)
        try:
            body = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            body = None
        error_type = response.headers.get("x-fal-error-type") or (
            body.get("error_type") if isinstance(body, dict) else None
        )
        if error_type in CANCELLED_TYPES:
            return RemoteResult("cancelled", duration_s=duration, metrics=metrics)
        if error_type or (response.status_code == 422 and isinstance(body, dict)):
            detail = body.get("detail") if isinstance(body, dict) else None
            text = f"{error_type or 'validation_error'}: {detail if detail is not None else response.text}"
            return RemoteResult("failed", error=self._redact(text), duration_s=duration, metrics=metrics)
        raise self._fail(response, "GET", url, known=True)

    async def cancel(self, remote_id: str) -> bool:
        """PUT cancel_url. ALREADY_COMPLETED (400) and NOT_FOUND (404) leave nothing to cancel."""
        url = self.decode_id(remote_id)["cancel_url"]
        response = await self._send("PUT", url)
        if 200 <= response.status_code < 300 or response.status_code == 404:
            return True
        if response.status_code == 400 and b"ALREADY_COMPLETED" in response.content:
            return True
        raise self._fail(response, "PUT", url, known=True)
