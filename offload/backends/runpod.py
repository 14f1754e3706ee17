"""`runpod`: RunPod serverless queue endpoints (provider-apis.md A1).

`POST {base}/{endpoint_id}/run` with `{"input", "webhook"?, "policy"?}` -> `{"id"}`; `GET .../status/{id}`;
`POST .../cancel/{id}`. `base_url` is RunPod's `https://api.runpod.ai/v2` (a root without `/v2`, like the
simulator's, gets it appended). IN_QUEUE -> queued, IN_PROGRESS/RUNNING -> running, COMPLETED -> succeeded,
FAILED/TIMED_OUT -> failed, CANCELLED -> cancelled. A FAILED job's `error` is often the worker SDK's JSON string
(`{"error_type", "error_message", "error_traceback", ...}`): we keep type and message, not the traceback.
`executionTime` (ms) is the billed time -> duration_s. A 404 on a known job is RunPod's TTL: NotFound.

Remote id: RunPod's job id as is (the endpoint comes from config, so any worker with it can resume).
Webhooks: `submit(webhook=...)` goes out as `webhook`; RunPod posts the status body (unsigned), read by
`hook_event` / `hook_result` like a poll's answer.
Tagging: RunPod cannot list jobs, so `find` returns None; with `webhook_url` set, each job's webhook carries
`offload_tag=<job id>`, so a webhook receiver can still adopt an orphan.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
import orjson

from offload.backends.base import TERMINAL, BackendError, HookEvent, RemoteResult, RemoteStatus, Submission
from offload.backends.http import (
    HttpBackend,
    tagged_url,
    warn_unknown_status,
)
from offload.backends.settings import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_TIMEOUT,
    RUNPOD_BASE,
    RunPodSettings,
)

DEFAULT_BASE = RUNPOD_BASE
STATUSES: dict[str, RemoteStatus] = {
    "IN_QUEUE": "queued",
    "IN_PROGRESS": "running",
    "RUNNING": "running",
    "COMPLETED": "succeeded",
    "FAILED": "failed",
    "TIMED_OUT": "failed",
    "CANCELLED": "cancelled",
}


def error_text(raw: Any) -> str:
    """A readable error from RunPod's `error`, which may be plain text, a dict, or a dict serialised as JSON."""
    if isinstance(raw, str):
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        if not isinstance(parsed, dict):
            return raw
        raw = parsed
    if isinstance(raw, dict):
        message = raw.get("error_message") or raw.get("message") or raw.get("error")
        kind = raw.get("error_type")
        if message is not None:
            return f"{kind}: {message}" if kind else str(message)
        return orjson.dumps(raw).decode()
    return str(raw)


class RunPodBackend(HttpBackend):
    """One serverless endpoint. `policy` is passed through as RunPod's `policy` object (executionTimeout, ttl in
    ms), so per-endpoint limits stay in config."""

    kind = "runpod"

    def __init__(
        self,
        name: str,
        *,
        endpoint_id: str,
        base_url: str = DEFAULT_BASE,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        webhook_url: str | None = None,
        policy: dict[str, Any] | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        root = base_url.rstrip("/")
        super().__init__(
            name,
            base_url=root if root.endswith("/v2") else f"{root}/v2",
            api_key=api_key,
            timeout=timeout,
            max_connections=max_connections,
            max_response_bytes=max_response_bytes,
            client=client,
        )
        self._endpoint = f"{self.base_url}/{quote(endpoint_id, safe='')}"
        self._webhook = webhook_url
        self._policy = policy

    @classmethod
    def from_settings(cls, name: str, s: RunPodSettings, client: httpx.AsyncClient | None) -> RunPodBackend:
        return cls(
            name, **s.http(), endpoint_id=s.endpoint_id, webhook_url=s.webhook_url, policy=s.policy, client=client
        )

    async def submit(
        self, job_input: Any, *, tag: str, idempotency_key: str | None = None, webhook: str | None = None
    ) -> Submission:
        body: dict[str, Any] = {"input": job_input}
        if webhook or self._webhook:
            body["webhook"] = webhook or tagged_url(self._webhook or "", tag)
        if self._policy:
            body["policy"] = self._policy
        answer = await self._call(
            "POST", f"{self._endpoint}/run", json=body, has_body=True, idempotency_key=idempotency_key
        )
        return Submission(self._require(answer, "id", str, "submit"))

    async def poll(self, remote_id: str) -> RemoteResult:
        body = await self._call("GET", f"{self._endpoint}/status/{quote(remote_id, safe='')}", known=True)
        return self._read(body)

    def hook_event(self, body: Any) -> HookEvent | None:
        """RunPod posts the job's status body (unsigned: the URL secret is the whole check)."""
        if not isinstance(body, dict) or not isinstance(body.get("id"), str) or not isinstance(body.get("status"), str):
            return None
        status = STATUSES.get(body["status"])
        return HookEvent(body["id"], status is not None and status in TERMINAL)

    def hook_result(self, body: Any) -> RemoteResult | None:
        try:
            return self._read(body)
        except BackendError:
            return None

    def _read(self, body: Any) -> RemoteResult:
        raw = self._require(body, "status", str, "poll")
        status = STATUSES.get(raw)
        if status is None:
            warn_unknown_status(self.kind, raw)
            return RemoteResult("running")
        metrics = {k: body[k] for k in ("delayTime", "executionTime", "workerId") if k in body}
        execution = body.get("executionTime")
        duration = execution / 1000 if isinstance(execution, int | float) and execution >= 0 else None
        if status == "succeeded":
            output = self._require(body, "output", object, "poll")
            delay = body.get("delayTime")  # ms in RunPod's queue before a worker took it: the queue delay
            queued = delay / 1000 if isinstance(delay, int | float) and delay >= 0 else None
            return RemoteResult("succeeded", output=output, duration_s=duration, metrics=metrics, queue_s=queued)
        if status == "failed":
            default = "timed out" if raw == "TIMED_OUT" else "failed (no error given)"
            error = error_text(body.get("error") or f"RunPod job {default}")
            if raw == "TIMED_OUT" and "time" not in error.lower():
                error = f"TIMED_OUT: {error}"
            return RemoteResult("failed", error=self._redact(error), duration_s=duration, metrics=metrics)
        return RemoteResult(status, duration_s=duration, metrics=metrics)

    async def cancel(self, remote_id: str) -> bool:
        """A job that is gone (404) has nothing left to cancel; an ended one answers 200 with its final status."""
        url = f"{self._endpoint}/cancel/{quote(remote_id, safe='')}"
        response = await self._send("POST", url)
        if response.status_code == 404 or 200 <= response.status_code < 300:
            return True
        raise self._fail(response, "POST", url, known=True)
