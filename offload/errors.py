"""The exceptions offload raises: one tree under `OffloadError`, so a caller catches one family (or all of them)
and tells problems apart by class.

The branch roots are defined here; a leaf lives beside the code that raises it and stays importable from there
(the module is named on its line). A class that also derives from a builtin says so in parentheses, so
`except KeyError` code keeps working.

* OffloadError
  + ConfigError - a setting is missing or invalid; the message names the field (`storage.bucket: ...`)
    - StorageConfigError - the storage settings, found wrong by the store itself (offload.storage.base)
    - VaultError - no master key, a wrong one, or a damaged ciphertext (offload.autoscale.vault)
    - MissingExtra - an optional dependency is not installed; the message names the extra to install
    - UnsafeEvictionPolicy - the job store's maxmemory-policy is not noeviction; the message says what to set
  + StoreError - the job store on Redis/Valkey refused a request or could not be reached
    - ConnectionFailed - Redis/Valkey unreachable after retrying
    - StoreFull - Redis/Valkey is at its maxmemory and refused an enqueue; `enqueued` lists what got in
    - InvalidQueueName (ValueError)
    - InvalidJob (ValueError)
    - PayloadTooLarge (ValueError)
    - JobNotFound (KeyError)
    - QueueNotFound (KeyError) - nothing was ever enqueued to the queue, paused or configured
    - InvalidTransition - e.g. cancel a succeeded job
    - NoResult - the job has no output to read: it failed, went dead, was cancelled or has not finished; `job`
      (offload.client)
    - NotReplicated (redis's ResponseError) - a write too few replicas confirmed in time (offload.queue.durability)
  + FencingError - a write by someone who no longer owns what it writes; it must not happen
    - StaleLease - the lease token no longer owns the job (the store's answer, and the server's 409)
    - Fenced - this server is no longer the autoscaler's leader (offload.autoscale.instances)
    - StaleState - the instance moved on since it was read (offload.autoscale.instances)
  + BackendError - a remote GPU/model API call failed; `status`, secret-free `excerpt`, `maybe_accepted`
    (offload.backends.base)
    - Throttled - 429; `retry_after`
    - Transient - 5xx, 408, 409, timeouts, connection errors, garbled answers: try again later
    - Fatal - any other 4xx: retrying cannot help
      - TooLarge - an answer over the backend's max_response_bytes: reading stopped at the limit
      - PackTooLarge - a batch pack over the provider's count or size limit, refused unsent (offload.backends.batch)
    - NotFound - a known remote job expired at the provider: submit again
  + ProviderError - an autoscale provider call failed; `retryable`, `ambiguous` (offload.autoscale.providers.base)
    - OutOfCapacity, Unauthorized, NotOurs
  + ObjectStoreError - result storage (S3 or a local directory) (offload.storage.base)
    - StorageError - a transient failure: the same write later is expected to work
      - ClockRefused - a request refused for this host's clock (more than 15 minutes off the storage's)
      - FileRefused - an output file the egress rule refuses to fetch (offload.storage.outputs)
    - AddressRefused (PermissionError) - a connection to an address or host the egress rule refuses (offload.egress)
    - ObjectNotFound (KeyError)
    - InvalidKey (ValueError) - a key unsafe as a path
    - FileTooLarge (ValueError) - a File() over storage.max_input_file_bytes (offload.storage.inputs)
    - UploadCancelled - an input upload stopped midway; what it wrote is removed (offload.storage.inputs)
  + WorkerError - one job inside a worker, or a GPU worker's link to the server
    - PollTimeout - the remote job did not finish within poll_timeout (offload.worker.polling)
    - Unrecorded - a remote job known to exist whose checkpoint failed twice, not as an outage (offload.worker.job_run)
    - Drained - a job that had not sent its call when its worker began to drain: handed back (offload.worker.job_run)
    - PermanentError - raised by a handler: the job goes dead at once (offload.gpu_worker.loop)
    - ServerUnavailable (ConnectionError) - the server was away for the retry period (offload.gpu_worker.server_api)
    - Unregistered - the server no longer knows this worker id (offload.gpu_worker.server_api)
    - ServerRejected - a 4xx the worker cannot fix by retrying (offload.gpu_worker.server_api)
    - FileTransferError - a GPU worker's download or upload of a job file failed (offload.gpu_worker.job_files)
    - MissingInput (LookupError) - a job input lacks a field its backend's input template copies: the job goes
      dead (offload.input_maps)
  + RequestError - an API or operator request that cannot be served as asked
    - FieldError - a 422 about one field (offload.server.errors)
    - BodyTooLarge (starlette's HTTPException) - a 413, raised inside FastAPI's body reader (offload.server.errors)
    - BodyTimeout (starlette's HTTPException) - a 408: the body did not arrive in time (offload.server.limits)
    - InvalidKeyRequest (ValueError) - an API-key request (offload.access.api_keys)
    - ProviderNotFound (KeyError), ProviderInUse (ValueError) - the provider catalogue (autoscale.provider_store)
    - OperatorOnly - a setting only the operator's file may give (offload.autoscale.operator_only)
    - FileUnreadable (ValueError) - a File() whose source cannot be read (offload.files)
    - TooManyReferences (ValueError) - more distinct file references than a job may hold (offload.files)
    - Forged - a provider callback whose signature does not check out (offload.server.webhooks)
    - Refused - a provider callback answered with a 4xx: unknown, forged, unreadable (offload.server.routes_hooks)
  + ErrorReply - the simulator's handlers answering with an error reply (offload.testing.sim.engine); never leaves it
  + SendError - the simulator's webhook POST got no usable answer (offload.testing.sim.sender); never leaves it

A leaf module (it imports nothing), so the simulator, which stands alone, can use it too. `tests/project/test_errors.py`
walks every module of the package and fails on an exception class outside this tree.
"""

from __future__ import annotations

from typing import ClassVar


class OffloadError(Exception):
    """Base class: every error offload raises on purpose derives from it."""


# --- config ------------------------------------------------------------------------------------------------------


class ConfigError(OffloadError):
    """A setting is missing or invalid; the message names the field."""


class MissingExtra(ConfigError):
    """An optional dependency is not installed. The message names the extra: `pip install 'offload[server]'`.

    A ConfigError, because the fix is in how the machine was set up, not in the job or the request. `EXTRA_OF`
    is the one table of which extra installs which module (pyproject.toml's optional dependencies)."""

    EXTRA_OF: ClassVar[dict[str, str]] = {
        "aiohttp": "worker",
        "boto3": "s3",
        "botocore": "s3",
        "s3transfer": "s3",
        "fastapi": "server",
        "opentelemetry": "otel",
        "prometheus_client": "server",
        "starlette": "server",
        "uvicorn": "server",
    }

    def __init__(self, extra: str, module: str, feature: str) -> None:
        super().__init__(
            f"{feature} needs the optional dependency {module!r}, which is not installed: "
            f"pip install 'offload[{extra}]'"
        )
        self.extra = extra
        self.module = module

    @classmethod
    def of(cls, exc: BaseException, feature: str = "this command") -> MissingExtra | None:
        """The MissingExtra an optional module's ModuleNotFoundError stands for; None for any other error."""
        if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
            return None
        top = exc.name.split(".")[0]
        extra = cls.EXTRA_OF.get(top)
        return cls(extra, top, feature) if extra else None


class UnsafeEvictionPolicy(ConfigError):
    """The job store may evict keys (its `maxmemory-policy` is not `noeviction`): an evicted lease, cap counter,
    idempotency key or job record is a job paid twice or lost, so offload refuses to start new work on it. The
    message is one line naming the policy found and how to set noeviction (offload.queue.memory)."""


# --- store -------------------------------------------------------------------------------------------------------


class StoreError(OffloadError):
    """The job store (Redis/Valkey) refused a request or could not be reached."""


class ConnectionFailed(StoreError):
    """Redis/Valkey could not be reached after retrying; the message names the (password-masked) URL."""


class StoreFull(StoreError):
    """Redis/Valkey is at its `maxmemory` and refused an enqueue (it adds data). Nothing of a refused job was
    written; a batch larger than one script call (500 jobs) may have been refused part-way, and `enqueued` holds
    the ids that did get in (a retry with the same idempotency keys answers those, it does not add them twice)."""

    def __init__(self, message: str, enqueued: list[str] | None = None) -> None:
        super().__init__(message)
        self.enqueued = list(enqueued or [])


class InvalidQueueName(StoreError, ValueError):
    """Queue names become part of Redis keys and URLs, so only a safe alphabet is allowed."""


class PayloadTooLarge(StoreError, ValueError):
    """A job's input is larger than the configured limit (1 MiB by default)."""


class InvalidJob(StoreError, ValueError):
    """An enqueue request is malformed (bad priority, bad option value, input not JSON-serialisable). `field`: the
    option it is about, where one is (the HTTP API's 422 names it)."""

    field: str | None = None

    @classmethod
    def about(cls, field: str, msg: str) -> InvalidJob:
        exc = cls(msg)
        exc.field = field
        return exc


class JobNotFound(StoreError, KeyError):
    """No record exists for this job id (never created, purged, or expired after its retention)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "job not found"


class QueueNotFound(StoreError, KeyError):
    """No queue of this name: nothing was enqueued to it or paused, and offload.yaml does not declare it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "queue not found"


class InvalidTransition(StoreError):
    """The job is in a state from which the requested change is not allowed (e.g. cancel a succeeded job)."""


# --- fencing -----------------------------------------------------------------------------------------------------


class FencingError(OffloadError):
    """A write by a party that no longer owns what it writes (a lease, the leadership, a state): it must not
    happen, and the caller must not retry it as if it were transient."""


class StaleLease(FencingError):
    """The caller's lease token no longer owns the job: another worker took it over, or it finished. Also what a
    GPU worker gets when the server answers 409 for its lease."""


# --- branch roots whose leaves live beside their code ------------------------------------------------------------


class BackendError(OffloadError):
    """A remote GPU/model API call failed. `excerpt` is a short, secret-free piece of the provider's response for
    the job record. `maybe_accepted`: the request was sent and no answer the provider gave says it refused it (a
    gateway's 502/503/504/52x, a timeout or a reset after sending, an unreadable 2xx), so a submission may run
    and be paid for. The leaves (offload.backends.base) say what the worker does about it."""

    def __init__(
        self, message: str, *, status: int | None = None, excerpt: str = "", maybe_accepted: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.excerpt = excerpt
        self.maybe_accepted = maybe_accepted


class ProviderError(OffloadError):
    """An autoscale provider call failed. `retryable`: worth trying again later; `ambiguous`: the machine may
    exist anyway (a create whose answer was lost), so the caller must look it up by label rather than rent again."""

    def __init__(
        self, message: str, *, retryable: bool = True, ambiguous: bool = False, host_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.ambiguous = ambiguous
        self.host_id = host_id


class ObjectStoreError(OffloadError):
    """Result storage (S3-compatible or a local directory) failed or refused a key (offload.storage.base)."""


class WorkerError(OffloadError):
    """About one job inside a worker, or a GPU worker's link to the server (offload.worker)."""


class RequestError(OffloadError):
    """An API or operator request that cannot be served as asked; the server answers it with a 4xx."""
