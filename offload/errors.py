"""The exceptions offload raises, so callers can catch one family and tell problems apart by class."""

from __future__ import annotations


class OffloadError(Exception):
    """Base class: every error offload raises on purpose derives from it."""


class ConfigError(OffloadError):
    """A setting is missing or invalid; the message names the field."""


class ConnectionFailed(OffloadError):
    """Redis/Valkey could not be reached after retrying; the message names the (password-masked) URL."""


class InvalidQueueName(OffloadError, ValueError):
    """Queue names become part of Redis keys and URLs, so only a safe alphabet is allowed."""


class PayloadTooLarge(OffloadError, ValueError):
    """A job's input is larger than the configured limit (1 MiB by default)."""


class InvalidJob(OffloadError, ValueError):
    """An enqueue request is malformed (bad priority, bad option value, input not JSON-serialisable)."""


class JobNotFound(OffloadError, KeyError):
    """No record exists for this job id (never created, purged, or expired after its retention)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "job not found"


class StaleLease(OffloadError):
    """The caller's lease token no longer owns the job: another worker took it over, or it finished."""


class InvalidTransition(OffloadError):
    """The job is in a state from which the requested change is not allowed (e.g. cancel a succeeded job)."""
