"""offload: a control plane for bursty GPU work on a durable Redis/Valkey job queue."""

from importlib.metadata import PackageNotFoundError, version

from offload.client import AsyncClient, Client, NoResult
from offload.errors import (
    ConfigError,
    ConnectionFailed,
    InvalidJob,
    InvalidQueueName,
    InvalidTransition,
    JobNotFound,
    OffloadError,
    PayloadTooLarge,
    StaleLease,
    StoreFull,
    UnsafeEvictionPolicy,
)
from offload.files import File
from offload.models import Attempt, ClaimedJob, Job, JobState, QueueStats
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

try:  # the one version is pyproject's; an uninstalled checkout (no metadata) says so rather than guessing
    __version__ = version("offload")
except PackageNotFoundError:  # pragma: no cover - only a source tree on sys.path without `pip install -e`
    __version__ = "0+unknown"

__all__ = [
    "AsyncClient",
    "Attempt",
    "ClaimedJob",
    "Client",
    "ConfigError",
    "ConnectionFailed",
    "File",
    "InvalidJob",
    "InvalidQueueName",
    "InvalidTransition",
    "Job",
    "JobNotFound",
    "JobSpec",
    "JobState",
    "NoResult",
    "OffloadError",
    "PayloadTooLarge",
    "QueueStats",
    "QueueStore",
    "StaleLease",
    "StoreFull",
    "UnsafeEvictionPolicy",
    "__version__",
]
