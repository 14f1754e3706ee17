"""offload: a control plane for bursty GPU work on a durable Redis/Valkey job queue."""

from offload.client import AsyncClient, Client
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
)
from offload.files import File
from offload.models import ClaimedJob, Job, JobState, QueueStats
from offload.queue.store import JobSpec, QueueStore

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
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
    "OffloadError",
    "PayloadTooLarge",
    "QueueStats",
    "QueueStore",
    "StaleLease",
]
