"""Anthropic's Message Batches as a client: a pack of jobs becomes one `POST /v1/messages/batches` (each job's
input is its request's `params`), polled by `processing_status`; once it has ended, the results JSONL at
`results_url` is read back into one result per job. `base_url` is the API's root (`https://api.anthropic.com`,
the simulator's own root), as for the anthropic SDK; the key goes in `x-api-key` with `anthropic-version`.

Anthropic's `custom_id` allows `[a-zA-Z0-9_-]{1,64}`, and offload's job ids hold `:` (and `.` in queue names), so
a job id is carried escaped (`custom_id`/`job_id`): a job whose escaped id is longer than 64 characters (a queue
name past ~30 characters) cannot go in a Message Batch (`PackTooLarge`).
Packed and driven by the dispatch worker (offload.worker.packing).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import orjson

from offload.backends.base import Fatal, Transient
from offload.backends.batch import (
    BatchClient,
    BatchState,
    BatchStatus,
    LineResult,
    Listed,
    PackTooLarge,
    check_pack,
    parse_jsonl,
)
from offload.backends.http import require, same_origin

BASE = "https://api.anthropic.com"
VERSION = "2023-06-01"
STATES: dict[str, BatchState] = {"in_progress": "running", "canceling": "cancelling", "ended": "ended"}
# Anthropic's error types and the HTTP status each stands for (its errors guide): how a line's error is retried.
ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}
_ESCAPES = {"_": "__", ":": "_c", ".": "_d"}
_UNESCAPES = {v: k for k, v in _ESCAPES.items()}
_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def custom_id(job_id: str) -> str:
    """The job id in Anthropic's custom_id alphabet (reversible: `job_id`)."""
    escaped = "".join(_ESCAPES.get(c, c) for c in job_id)
    if not _CUSTOM_ID.match(escaped):
        raise PackTooLarge(f"anthropic batch: job id {job_id!r} cannot be a custom_id (at most 64 of [a-zA-Z0-9_-])")
    return escaped


def job_id(custom: str) -> str:
    return re.sub(r"_[_cd]", lambda m: _UNESCAPES[m[0]], custom)


class AnthropicBatch(BatchClient):
    provider = "anthropic"
    list_path = "/v1/messages/batches"
    list_after = "after_id"

    def __init__(self, *, base_url: str = BASE, **kwargs: Any) -> None:
        super().__init__(base_url=base_url, **kwargs)

    def _headers(self) -> dict[str, str]:
        return {"x-api-key": self._api_key or "none", "anthropic-version": VERSION}

    async def submit(self, pack: list[tuple[str, Any]]) -> str:
        """Create the batch; its id. A lost answer is Transient with `maybe_accepted`: the batch may exist."""
        body = {"requests": [{"custom_id": custom_id(job), "params": params} for job, params in pack]}
        content = orjson.dumps(body)
        check_pack(self.provider, len(pack), len(content))
        created = await self._json(
            "POST", "/v1/messages/batches", content=content, headers={"content-type": "application/json"}
        )
        batch_id: str = require(created, "id", str, what="anthropic batch: POST /v1/messages/batches")
        return batch_id

    async def _batch(self, batch_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/messages/batches/{batch_id}", known=True)

    async def status(self, batch_id: str) -> BatchStatus:
        return _status(await self._batch(batch_id))

    async def results(self, batch_id: str) -> dict[str, LineResult]:
        """Each job's result, by job id, once the batch has ended (Transient before: poll again)."""
        batch = await self._batch(batch_id)
        status = _status(batch)
        url = batch.get("results_url")
        if not status.ended or not isinstance(url, str):
            raise Transient(f"anthropic batch {batch_id}: not ended yet ({status.provider_status})")
        if not same_origin(url, self.base_url):  # the key goes with the request: only to the API's own host
            raise Fatal(f"anthropic batch {batch_id}: results_url is on another host than base_url")
        response = await self._request("GET", url, known=True)
        rows = parse_jsonl(response.content, what=f"anthropic batch {batch_id}: results")
        return {job_id(str(row.get("custom_id"))): _line(row.get("result")) for row in rows}

    async def cancel(self, batch_id: str) -> BatchStatus:
        """Ask Anthropic to stop the batch; its status after (an ended batch is answered as it is)."""
        return _status(await self._json("POST", f"/v1/messages/batches/{batch_id}/cancel", known=True))

    def _listed(self, row: dict[str, Any]) -> Listed:
        """No tag: a Message Batch carries nothing of ours but its requests' custom_ids, which only its results
        show; the packer matches by time and count, then by those results."""
        counts = row.get("request_counts") or {}
        total = sum(int(v) for v in counts.values() if isinstance(v, int))
        return Listed(str(row.get("id")), _epoch(row.get("created_at")), total)


def _epoch(value: Any) -> float:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _status(batch: dict[str, Any]) -> BatchStatus:
    provider_status = require(batch, "processing_status", str, what="anthropic batch: GET /v1/messages/batches")
    counts = batch.get("request_counts") or {}
    return BatchStatus(
        STATES.get(provider_status, "running"),
        provider_status,
        {k: int(v) for k, v in counts.items() if isinstance(v, int)},
    )


def _line(result: Any) -> LineResult:
    kind = result.get("type") if isinstance(result, dict) else None
    if kind == "succeeded":
        return LineResult("succeeded", output=result.get("message"))
    if kind in ("canceled", "expired"):
        return LineResult(kind)
    error = result.get("error") if isinstance(result, dict) else None
    inner = error.get("error") if isinstance(error, dict) else None
    if isinstance(inner, dict):
        kind = inner.get("type")
        status = ERROR_STATUS.get(kind) if isinstance(kind, str) else None
        return LineResult("errored", error=f"{kind}: {inner.get('message')}", status=status)
    return LineResult("errored", error=f"unreadable result: {result!r}"[:500])
