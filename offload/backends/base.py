"""The one small interface every remote GPU/model API implements, and the error classes the worker acts on.

A backend knows nothing of Redis or storage: it turns a job input into a remote job and reports what became
of it. The worker decides what an error means for the job: throttled -> shared cool-down and try again;
transient -> try again later (the remote job, if any, is kept); fatal -> dead now; not found -> the remote
result expired, submit again (counted). Any of them with `maybe_accepted` on a submit: the submission's outcome
is unknown, so its intent stays open and a resend is counted (see offload.backends.http for the rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from offload.errors import BackendError as BackendError  # the branch root, drawn in offload.errors

RemoteStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class Throttled(BackendError):
    """HTTP 429 (or the provider's equivalent). `retry_after` seconds when the provider said so."""

    def __init__(
        self, message: str, *, retry_after: float | None = None, status: int | None = 429, excerpt: str = ""
    ) -> None:
        super().__init__(message, status=status, excerpt=excerpt)
        self.retry_after = retry_after


class Transient(BackendError):
    """5xx, 408, 409, timeouts, connection errors, malformed responses: worth another try."""


class Fatal(BackendError):
    """4xx other than 408/409/429 (bad input, bad credentials): retrying cannot help."""


class TooLarge(Fatal):
    """A 2xx answer longer than the backend's `max_response_bytes`: reading stopped at the limit, so one answer
    cannot grow the worker past it. The remote work was done (it may be paid for): the job is dead with the
    reason, never run again by itself (the same run would answer the same); a large output belongs in files."""


class NotFound(BackendError):
    """404 for a remote job we know: it expired at the provider (e.g. RunPod's TTL)."""


@dataclass(frozen=True, slots=True)
class RemoteResult:
    """What a remote job is doing. `output` is set once succeeded; `cost` (USD) when the provider reports it,
    `duration_s` (billable seconds) when it reports that instead; `queue_s`, how long the provider queued it
    before it started, when it reports that (a routed queue's expected finish, worker/job_limits.py)."""

    status: RemoteStatus
    output: Any = None
    error: str | None = None
    cost: float | None = None
    duration_s: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    queue_s: float | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True, slots=True)
class Submission:
    """The remote id to checkpoint, and for synchronous APIs (one call does the work) the result at once."""

    remote_id: str
    result: RemoteResult | None = None


class Backend(Protocol):
    """submit / poll / cancel. `tag` is offload's job id: backends that let a submission carry a tag
    (metadata, webhook URL, custom id) send it, so `find` can adopt a submission whose id was never recorded.
    `synchronous`: submit does the whole job (its answer is the result), so a submit lasts as long as the job."""

    name: str
    synchronous: bool

    async def submit(self, job_input: Any, *, tag: str, idempotency_key: str | None = None) -> Submission:
        """Start a remote job. The remote id is an opaque string that lets any worker process with the same
        backend config poll or cancel it (it may encode more than the provider's id, e.g. fal's URLs).
        `idempotency_key` (`<job id>.<submission number>`) goes out as the `Idempotency-Key` header: a provider
        or gateway that honours it answers a repeat with the first remote job instead of starting another."""
        ...

    async def poll(self, remote_id: str) -> RemoteResult:
        """What the remote job is doing now. NotFound when the provider no longer knows it (its result expired);
        a status the backend does not recognise is reported as non-terminal, never as a failure."""
        ...

    async def cancel(self, remote_id: str) -> bool:
        """Ask the provider to stop the job: True once it took the cancel (or the job had already ended or no
        longer exists: not an error), False when this backend cannot cancel (no cancel route), so the job may
        still run and be paid for. Idempotent. Throttled/Transient still propagate, so the caller can try again."""
        ...

    async def find(self, tag: str) -> str | None:
        """The remote id of an earlier submission carrying `tag`, or None (also when unsupported)."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class HookEvent:
    """What a provider webhook says: which remote job, and whether it has ended (its body then is the result)."""

    remote_id: str
    terminal: bool


@runtime_checkable
class WebhookBackend(Backend, Protocol):
    """A backend whose provider calls a URL when a job ends (Replicate, fal, RunPod). `submit(webhook=url)`
    sends that URL with the submission; the server reads a delivery with `hook_event` (after it checked the
    URL secret and the provider's signature) and the worker turns a final one into the result with
    `hook_result` (None: the body does not carry the result, e.g. fal's `payload_error`: poll for it)."""

    async def submit(
        self, job_input: Any, *, tag: str, idempotency_key: str | None = None, webhook: str | None = None
    ) -> Submission: ...

    def hook_event(self, body: Any) -> HookEvent | None: ...

    def hook_result(self, body: Any) -> RemoteResult | None: ...
