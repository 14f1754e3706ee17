"""`replicate`: Replicate predictions (provider-apis.md A2).

Create with `POST {base}/predictions` and `{"version", "input"}`, or `POST {base}/models/{owner}/{name}/predictions`
(official models) or `.../deployments/{owner}/{name}/predictions` when `model` / `deployment` is configured;
`GET {base}/predictions/{id}`; `POST .../cancel`. `base_url` is `https://api.replicate.com/v1` (a root without
`/v1`, like the simulator's, gets it appended). starting -> queued, processing -> running, succeeded, failed,
canceled/aborted -> cancelled; `metrics.predict_time` (the billed seconds) -> duration_s. A failed model run is
HTTP 200 with `status: failed`. After about an hour Replicate nulls `output` and sets `data_removed`: a succeeded
prediction whose data is gone is NotFound, like a 404, because the result must be produced again.

Remote id: the prediction id as is (`GET /predictions/{id}` needs nothing else).
Webhooks: `submit(webhook=...)` (offload's own per-submission URL, when `server.public_url` is set) is sent as
`webhook` with `webhook_events_filter: ["start", "completed"]`; the body Replicate posts is the prediction, read
by `hook_event` / `hook_result` like a poll's answer. `start` comes the moment the prediction exists: it names
the remote id of a submission whose worker died inside the create call (or lost its answer), so the job is
adopted within a webhook's round trip instead of when the prediction ends (see hook.lua); `completed` carries
the result.
Tagging: with `webhook_url`, each prediction's webhook carries `offload_tag=<job id>`; with `tag_input_key`, the
tag is also put into the input under that key (only for models that tolerate an extra input field), and `find`
lists the newest `find_pages` pages of `GET /predictions` for a prediction whose input carries it. Without
`tag_input_key`, `find` returns None.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from offload.backends.base import (
    TERMINAL,
    BackendError,
    Fatal,
    HookEvent,
    NotFound,
    RemoteResult,
    RemoteStatus,
    Submission,
)
from offload.backends.http import (
    HttpBackend,
    same_origin,
    tagged_url,
    warn_unknown_status,
)
from offload.backends.settings import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_TIMEOUT,
    REPLICATE_BASE,
    REPLICATE_FIND_PAGES,
    ReplicateSettings,
)

DEFAULT_BASE, DEFAULT_FIND_PAGES = REPLICATE_BASE, REPLICATE_FIND_PAGES
WEBHOOK_EVENTS = ("start", "completed")  # never output/logs: each would cost a delivery and a script call
STATUSES: dict[str, RemoteStatus] = {
    "starting": "queued",
    "processing": "running",
    "succeeded": "succeeded",
    "failed": "failed",
    "canceled": "cancelled",
    "cancelled": "cancelled",
    "aborted": "cancelled",
}


class ReplicateBackend(HttpBackend):
    """One model version, official model or deployment. Exactly one of `version`, `model`, `deployment`."""

    kind = "replicate"

    def __init__(
        self,
        name: str,
        *,
        version: str | None = None,
        model: str | None = None,
        deployment: str | None = None,
        base_url: str = DEFAULT_BASE,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        webhook_url: str | None = None,
        tag_input_key: str | None = None,
        find_pages: int = DEFAULT_FIND_PAGES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        owner_name = model or deployment  # exactly one of the three: ReplicateSettings checks it
        root = base_url.rstrip("/")
        super().__init__(
            name,
            base_url=root if root.endswith("/v1") else f"{root}/v1",
            api_key=api_key,
            timeout=timeout,
            max_connections=max_connections,
            max_response_bytes=max_response_bytes,
            client=client,
        )
        self._version = version
        collection = "models" if model else "deployments"
        self._create_url = (
            f"{self.base_url}/{collection}/{owner_name}/predictions" if owner_name else f"{self.base_url}/predictions"
        )
        self._webhook = webhook_url
        self._tag_key = tag_input_key
        self._find_pages = find_pages

    @classmethod
    def from_settings(cls, name: str, s: ReplicateSettings, client: httpx.AsyncClient | None) -> ReplicateBackend:
        return cls(
            name,
            version=s.version,
            model=s.model,
            deployment=s.deployment,
            **s.http(),
            webhook_url=s.webhook_url,
            tag_input_key=s.tag_input_key,
            find_pages=s.find_pages,
            client=client,
        )

    def _prediction_url(self, remote_id: str) -> str:
        return f"{self.base_url}/predictions/{quote(remote_id, safe='')}"

    async def submit(
        self, job_input: Any, *, tag: str, idempotency_key: str | None = None, webhook: str | None = None
    ) -> Submission:
        if not isinstance(job_input, dict):
            raise Fatal(
                f"replicate backend {self.name!r}: the job input must be a JSON object (the model's input), "
                f"got {type(job_input).__name__}"
            )
        payload = {**job_input, self._tag_key: tag} if self._tag_key else job_input
        body: dict[str, Any] = {"input": payload}
        if self._version:
            body["version"] = self._version
        if webhook or self._webhook:
            body["webhook"] = webhook or tagged_url(self._webhook or "", tag)
            body["webhook_events_filter"] = list(WEBHOOK_EVENTS)
        answer = await self._call("POST", self._create_url, json=body, has_body=True, idempotency_key=idempotency_key)
        return Submission(self._require(answer, "id", str, "submit"))

    async def poll(self, remote_id: str) -> RemoteResult:
        body = await self._call("GET", self._prediction_url(remote_id), known=True)
        return self._read(body, remote_id)

    def hook_event(self, body: Any) -> HookEvent | None:
        """A webhook's body is the prediction object, as a poll returns it."""
        if not isinstance(body, dict) or not isinstance(body.get("id"), str) or not isinstance(body.get("status"), str):
            return None
        status = STATUSES.get(body["status"])
        return HookEvent(body["id"], status is not None and status in TERMINAL)

    def hook_result(self, body: Any) -> RemoteResult | None:
        try:
            return self._read(body, str(body.get("id")) if isinstance(body, dict) else "?")
        except BackendError:
            return None

    def _read(self, body: Any, remote_id: str) -> RemoteResult:
        raw = self._require(body, "status", str, "poll")
        status = STATUSES.get(raw)
        if status is None:
            warn_unknown_status(self.kind, raw)
            return RemoteResult("running")
        metrics = body.get("metrics") if isinstance(body.get("metrics"), dict) else {}
        predict = metrics.get("predict_time")
        duration = float(predict) if isinstance(predict, int | float) and predict >= 0 else None
        if status == "succeeded":
            if body.get("data_removed") is True:
                raise NotFound(
                    f"replicate backend {self.name!r}: prediction {remote_id} succeeded, but its output "
                    "was removed (data_removed): it must be run again"
                )
            output = self._require(body, "output", object, "poll")
            return RemoteResult("succeeded", output=output, duration_s=duration, metrics=metrics, queue_s=_queued(body))
        if status == "failed":
            error = self._redact(str(body.get("error") or "prediction failed (no error given)"))
            return RemoteResult("failed", error=error, duration_s=duration, metrics=metrics)
        return RemoteResult(status, duration_s=duration, metrics=metrics)

    async def cancel(self, remote_id: str) -> bool:
        """Replicate answers a finished prediction with its final state; a vanished one (404) needs nothing."""
        url = f"{self._prediction_url(remote_id)}/cancel"
        response = await self._send("POST", url)
        if response.status_code == 404 or 200 <= response.status_code < 300:
            return True
        raise self._fail(response, "POST", url, known=True)

    async def find(self, tag: str) -> str | None:
        """The newest prediction whose input carries `tag` under `tag_input_key`, within the first pages, unless
        it ended badly.
        Bounded: an orphan is looked for right after the crash that made it, so it is among the newest; a deep
        scan would cost every restarted worker many requests against the 3000/min limit."""
        if not self._tag_key:
            return None
        url: str | None = f"{self.base_url}/predictions"
        for _ in range(self._find_pages):
            if url is None:
                break
            page = await self._call("GET", url)
            results = self._require(page, "results", list, "find")
            for prediction in results:
                payload = prediction.get("input") if isinstance(prediction, dict) else None
                if isinstance(payload, dict) and payload.get(self._tag_key) == tag:
                    found = prediction.get("id")
                    # The newest submission decides: one that failed or was cancelled is why the job is being
                    # retried, and adopting it would only fail the job again.
                    if prediction.get("status") in ("failed", "canceled", "aborted"):
                        return None
                    if isinstance(found, str):
                        return found
            following = page.get("next")
            # The cursor is a full URL; never send the key to another host.
            url = following if isinstance(following, str) and same_origin(following, self.base_url) else None
        return None


def _queued(body: dict[str, Any]) -> float | None:
    """How long the prediction waited before it started (`started_at` - `created_at`, both the provider's clock);
    None when either is missing or unreadable."""
    try:
        took = datetime.fromisoformat(body["started_at"]) - datetime.fromisoformat(body["created_at"])
    except (KeyError, TypeError, ValueError):
        return None
    return max(took.total_seconds(), 0.0)
