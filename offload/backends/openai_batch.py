"""OpenAI's Batch API as a client: a pack of jobs becomes one JSONL file (`POST /files`, purpose `batch`) and one
batch (`POST /batches`, completion window 24 h), polled with `GET /batches/{id}`; once it has ended, its output
and error files are read back into one result per job. `base_url` follows the OpenAI SDK
(`https://api.openai.com/v1`; the simulator's is `{sim}/v1`).

Each line's `custom_id` is the job id, its body the job's request body (for `/v1/chat/completions`: model,
messages, ...). A batch that fails OpenAI's validation (`status: failed`) has no results: `results` raises Fatal
with its errors, as every job of it would fail the same way.
Packed and driven by the dispatch worker (offload.worker.packing).
"""

from __future__ import annotations

from typing import Any

from offload.backends.base import Fatal, Transient
from offload.backends.batch import (
    BatchClient,
    BatchState,
    BatchStatus,
    LineResult,
    Listed,
    check_pack,
    jsonl,
    parse_jsonl,
)
from offload.backends.http import require
from offload.backends.settings import OPENAI_BASE

ENDPOINT = "/v1/chat/completions"
TAG = "offload_pack"  # the metadata key a batch carries its pack id in (what adopting a lost create looks for)
STATES: dict[str, BatchState] = {
    "validating": "running",
    "in_progress": "running",
    "finalizing": "running",
    "cancelling": "cancelling",
    "completed": "ended",
    "failed": "ended",
    "expired": "ended",
    "cancelled": "ended",
}


class OpenAIBatch(BatchClient):
    provider = "openai"
    list_path = "/batches"

    def __init__(self, *, base_url: str = OPENAI_BASE, endpoint: str = ENDPOINT, **kwargs: Any) -> None:
        super().__init__(base_url=base_url, **kwargs)
        self.endpoint = endpoint

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key or 'none'}"}

    async def submit(self, pack: list[tuple[str, Any]], *, metadata: dict[str, str] | None = None) -> str:
        """Upload the pack and start its batch; the batch id. A lost answer to either call is Transient with
        `maybe_accepted` (the upload is harmless; the batch may exist: `metadata` can tag it for a listing)."""
        data = jsonl(
            {"custom_id": job_id, "method": "POST", "url": self.endpoint, "body": body} for job_id, body in pack
        )
        check_pack(self.provider, len(pack), len(data))
        uploaded = await self._json(
            "POST",
            "/files",
            files={"file": ("offload-batch.jsonl", data, "application/jsonl")},
            data={"purpose": "batch"},
        )
        file_id = require(uploaded, "id", str, what="openai batch: POST /files")
        create = {"input_file_id": file_id, "endpoint": self.endpoint, "completion_window": "24h"}
        if metadata:
            create["metadata"] = metadata
        batch = await self._json("POST", "/batches", json=create)
        batch_id: str = require(batch, "id", str, what="openai batch: POST /batches")
        return batch_id

    async def _batch(self, batch_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/batches/{batch_id}", known=True)

    async def status(self, batch_id: str) -> BatchStatus:
        return _status(await self._batch(batch_id))

    async def results(self, batch_id: str) -> dict[str, LineResult]:
        """Each job's result, by job id, once the batch has ended (Transient before: poll again)."""
        batch = await self._batch(batch_id)
        status = _status(batch)
        if not status.ended:
            raise Transient(f"openai batch {batch_id}: not ended yet ({status.provider_status})")
        if status.provider_status == "failed":
            errors = (batch.get("errors") or {}).get("data") or []
            detail = "; ".join(f"line {e.get('line')}: {e.get('code')}: {e.get('message')}" for e in errors[:5])
            raise Fatal(f"openai batch {batch_id} failed validation: {detail or 'no detail'}")
        out: dict[str, LineResult] = {}
        for key in ("output_file_id", "error_file_id"):
            file_id = batch.get(key)
            if isinstance(file_id, str):
                response = await self._request("GET", f"/files/{file_id}/content", known=True)
                for row in parse_jsonl(response.content, what=f"openai batch {batch_id}: {key}"):
                    out[str(row.get("custom_id"))] = _line(row)
        return out

    async def cancel(self, batch_id: str) -> BatchStatus:
        """Ask OpenAI to stop the batch; its status after (an ended batch is left as it is)."""
        try:
            return _status(await self._json("POST", f"/batches/{batch_id}/cancel", known=True))
        except Transient as exc:
            if exc.status != 409:  # 409: it had ended already, not an error
                raise
        return await self.status(batch_id)

    def _listed(self, row: dict[str, Any]) -> Listed:
        meta, counts = row.get("metadata") or {}, row.get("request_counts") or {}
        tag = meta.get(TAG) if isinstance(meta, dict) else None
        return Listed(str(row.get("id")), float(row.get("created_at") or 0), int(counts.get("total") or 0), tag)


def _status(batch: dict[str, Any]) -> BatchStatus:
    provider_status = require(batch, "status", str, what="openai batch: GET /batches")
    counts = batch.get("request_counts") or {}
    return BatchStatus(
        STATES.get(provider_status, "running"),  # a status OpenAI adds later is not an end
        provider_status,
        {k: int(v) for k, v in counts.items() if isinstance(v, int)},
    )


def _line(row: dict[str, Any]) -> LineResult:
    """One output- or error-file line as a job's result."""
    response, error = row.get("response"), row.get("error")
    if isinstance(response, dict):
        status, body = response.get("status_code"), response.get("body")
        if isinstance(status, int) and 200 <= status < 300:
            return LineResult("succeeded", output=body)
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        return LineResult(
            "errored", error=f"HTTP {status}: {message or body}", status=status if isinstance(status, int) else None
        )
    if isinstance(error, dict) and error.get("code") == "batch_expired":
        return LineResult("expired", error=str(error.get("message")))
    if isinstance(error, dict) and error.get("code") == "batch_cancelled":
        return LineResult("canceled", error=str(error.get("message")))
    return LineResult("errored", error=str(error))
