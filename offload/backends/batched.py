"""A provider batch API as one backend of a queue: the `Backend` a worker's lane holds, with the batch client and
the pack policy behind it.

A batch backend does not submit or poll one job: the dispatch worker's packer (offload.worker.packing) packs the
jobs routed to it and drives `client` (offload.backends.batch) directly. The `Backend` methods are there for what
every lane is asked: `cancel` of one job's line is not possible (a batch is cancelled whole, by the packer), and
`find` answers None (a lost batch create is adopted by the packer's listing, not per job).
"""

from __future__ import annotations

from typing import Any

import httpx

from offload.backends.anthropic_batch import AnthropicBatch
from offload.backends.base import Fatal, RemoteResult, Submission
from offload.backends.batch import LIMITS, BatchClient
from offload.backends.openai_batch import OpenAIBatch
from offload.backends.settings import AnthropicBatchSettings, BatchSettings, OpenAIBatchSettings


class BatchBackend:
    """A batch API as a lane's backend: `client` and the pack policy of `settings`."""

    synchronous = False

    def __init__(self, name: str, settings: BatchSettings, client: BatchClient) -> None:
        self.name, self.settings, self.client = name, settings, client
        limits = LIMITS[client.provider]
        self.max_pack = min(settings.pack_limit, limits.max_requests)
        self.max_bytes = limits.max_bytes

    @classmethod
    def from_settings(cls, name: str, settings: BatchSettings, client: httpx.AsyncClient | None) -> BatchBackend:
        key = settings.api_key.get_secret_value().strip() if settings.api_key else None
        common: dict[str, Any] = {"base_url": settings.base_url, "api_key": key, "timeout": settings.timeout}
        batch: BatchClient
        if isinstance(settings, OpenAIBatchSettings):
            batch = OpenAIBatch(endpoint=settings.path, client=client, **common)
        else:
            assert isinstance(settings, AnthropicBatchSettings)
            batch = AnthropicBatch(client=client, **common)
        return cls(name, settings, batch)

    def __repr__(self) -> str:
        return f"BatchBackend({self.name!r}, {self.client!r})"

    def request(self, job_input: Any) -> Any:
        """A job's input as its line's request body: the model filled in when the input lacks one."""
        if isinstance(job_input, dict) and self.settings.model and "model" not in job_input:
            return {**job_input, "model": self.settings.model}
        return job_input

    async def submit(self, job_input: Any, *, tag: str, idempotency_key: str | None = None) -> Submission:
        raise Fatal(f"backend {self.name}: a batch backend takes packs, not single submissions")

    async def poll(self, remote_id: str) -> RemoteResult:
        raise Fatal(f"backend {self.name}: a batch is polled by the packer, not per job")

    async def cancel(self, remote_id: str) -> bool:
        return False  # one line of a batch cannot be cancelled; the packer cancels whole batches

    async def find(self, tag: str) -> str | None:
        return None

    async def aclose(self) -> None:
        await self.client.aclose()
