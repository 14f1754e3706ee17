"""`http-job`: the tutorial's job API, so a team that followed it keeps its provider and env file.

`POST {base}/jobs` with the job input as the body -> `{"id"}`; `GET {base}/jobs/{id}` ->
`{"status": queued|running|succeeded|failed, "output", "error"?}`; Bearer auth. Cancel (`POST {base}/jobs/{id}/cancel`)
is an extension the tutorial lacks: it is tried when enabled, and a 404/405 (no such route, or the job is gone) is
not an error but reports the job as not cancelled, since the tutorial's API gives no way to tell those apart: a
remote job still running at `poll_timeout` is then not submitted again (see the worker's poll timeout).

Remote id: the provider's job id as is (the base URL comes from the shared config, so any worker can resume).
Tagging: none: the API has no metadata field and no listing, so `find` returns None.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

from offload.backends.base import RemoteResult, RemoteStatus, Submission
from offload.backends.http import HttpBackend, warn_unknown_status
from offload.backends.settings import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_TIMEOUT,
    HttpJobSettings,
)

STATUSES: dict[str, RemoteStatus] = {
    "queued": "queued",
    "pending": "queued",
    "running": "running",
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled",
    "canceled": "cancelled",
}


class HttpJobBackend(HttpBackend):
    """The tutorial API over a shared client. `cancel=False` for providers without the cancel route."""

    kind = "http-job"

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        cancel: bool = True,
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
        self._cancel = cancel

    @classmethod
    def from_settings(cls, name: str, s: HttpJobSettings, client: httpx.AsyncClient | None) -> HttpJobBackend:
        return cls(name, **s.http(), cancel=s.cancel, client=client)

    def _job_url(self, remote_id: str) -> str:
        return f"{self.base_url}/jobs/{quote(remote_id, safe='')}"

    async def submit(self, job_input: Any, *, tag: str, idempotency_key: str | None = None) -> Submission:
        body = await self._call(
            "POST", f"{self.base_url}/jobs", json=job_input, has_body=True, idempotency_key=idempotency_key
        )
        remote_id = self._require(body, "id", (str, int), "submit")
        return Submission(str(remote_id))

    async def poll(self, remote_id: str) -> RemoteResult:
        body = await self._call("GET", self._job_url(remote_id), known=True)
        raw = self._require(body, "status", str, "poll")
        status = STATUSES.get(raw.lower())
        if status is None:
            warn_unknown_status(self.kind, raw)
            return RemoteResult("running")
        if status == "succeeded":
            output = self._require(body, "output", object, "poll")
            return RemoteResult("succeeded", output=output)
        if status == "failed":
            error = body.get("error") or "remote job failed (no error given)"
            return RemoteResult("failed", error=self._redact(str(error)))
        return RemoteResult(status)

    async def cancel(self, remote_id: str) -> bool:
        """False without the route (`cancel: false`, or a 404/405 from it: a job that ended or expired needs no
        cancel, but one still running keeps running)."""
        if not self._cancel:
            return False
        url = f"{self._job_url(remote_id)}/cancel"
        response = await self._send("POST", url)
        if 200 <= response.status_code < 300:
            return True
        if response.status_code in (404, 405):
            return False
        raise self._fail(response, "POST", url, known=True)
