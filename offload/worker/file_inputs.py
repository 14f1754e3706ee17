"""The dispatch worker's side of files by reference: a provider gets URLs, never our storage credentials.

`FileInputs` wraps a backend. At submit time every `{"$file": key, ...}` reference in the job input becomes a
presigned GET URL of its object (valid `storage.input_url_expires_s`, 24 h by default: long enough for a
provider's queue), and the backend sends that body as it would any other; the stored job input keeps the
reference, so a retry signs fresh URLs. Every backend kind takes URLs (see docs/how-to/files.md): Replicate and fal
accept a URL for any file input and fetch it themselves, a RunPod or http-job handler downloads it, an OpenAI
request gets it where the API takes an image URL.

Before anything is paid for, each referenced object must exist: a missing one (expired, purged, never uploaded)
is a `Fatal` naming the field, so the job dead-letters with the reason instead of running on a dead link. A
storage outage at that moment is `Transient`: the job is tried again later, like any provider hiccup.
"""

from __future__ import annotations

from typing import Any

from offload.backends.base import Backend, Fatal, HookEvent, RemoteResult, Submission, Transient, WebhookBackend
from offload.files import references_in
from offload.storage import ObjectNotFound, Storage, StorageError
from offload.storage.inputs import presign_references


def _local(storage: Storage) -> bool:
    """A local directory signs `file://` URLs, which no provider can fetch."""
    return not storage.location("x").startswith("s3://")


class FileInputs:
    """A `Backend` that turns file references into presigned URLs before the wrapped backend submits."""

    def __init__(self, inner: Backend, storage: Storage, expires_s: int) -> None:
        self.inner, self.storage, self.expires_s = inner, storage, expires_s
        self.name = inner.name
        self.synchronous = inner.synchronous

    async def submit(self, job_input: Any, *, tag: str, idempotency_key: str | None = None) -> Submission:
        job_input = await self._presigned(job_input)
        return await self.inner.submit(job_input, tag=tag, idempotency_key=idempotency_key)

    async def _presigned(self, job_input: Any) -> Any:
        if references_in(job_input):
            if _local(self.storage):
                raise Fatal("input files need S3 storage (storage.kind: s3): a provider cannot fetch a local file")
            try:
                job_input = await presign_references(self.storage, job_input, self.expires_s)
            except ObjectNotFound as exc:
                raise Fatal(str(exc)) from None
            except StorageError as exc:
                raise Transient(f"signing input file URLs failed: {exc}") from None
        return job_input

    async def poll(self, remote_id: str) -> RemoteResult:
        return await self.inner.poll(remote_id)

    async def cancel(self, remote_id: str) -> bool:
        return await self.inner.cancel(remote_id)

    async def find(self, tag: str) -> str | None:
        return await self.inner.find(tag)

    async def aclose(self) -> None:
        await self.inner.aclose()


class HookFileInputs(FileInputs):
    """`FileInputs` over a backend with webhooks: the webhook URL and the reading of deliveries pass through."""

    inner: WebhookBackend

    def __init__(self, inner: WebhookBackend, storage: Storage, expires_s: int) -> None:
        super().__init__(inner, storage, expires_s)

    async def submit(
        self, job_input: Any, *, tag: str, idempotency_key: str | None = None, webhook: str | None = None
    ) -> Submission:
        job_input = await self._presigned(job_input)
        return await self.inner.submit(job_input, tag=tag, idempotency_key=idempotency_key, webhook=webhook)

    def hook_event(self, body: Any) -> HookEvent | None:
        return self.inner.hook_event(body)

    def hook_result(self, body: Any) -> RemoteResult | None:
        return self.inner.hook_result(body)


def with_file_inputs(inner: Backend, storage: Storage, expires_s: int) -> FileInputs:
    """The wrapper that keeps what `inner` can do (webhooks included)."""
    if isinstance(inner, WebhookBackend):
        return HookFileInputs(inner, storage, expires_s)
    return FileInputs(inner, storage, expires_s)
