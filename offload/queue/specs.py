"""What a job to enqueue is, and the checks enqueue makes of it, without a connection.

Split from store.py so a producer (the CLI reading a file, the HTTP API) can check specs up front, and so the
rules enqueue applies to a spec live in one place: the input's JSON encoding and size limit, and each option's
range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from offload.env import env_int
from offload.errors import InvalidJob, PayloadTooLarge
from offload.models import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETENTION_S

DEFAULT_MAX_PAYLOAD = 1 << 20
PRIORITY_RANGE = range(-1000, 1001)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job to enqueue. `delay` (seconds) and `run_at` (epoch seconds) are alternatives."""

    input: Any
    priority: int = 0
    delay: float | None = None
    run_at: float | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    output_key: str | None = None
    retention: int = DEFAULT_RETENTION_S
    idempotency_key: str | None = None
    job_id: str | None = None


def max_payload_limit(max_payload: int | None = None) -> int:
    """The input-size limit in bytes: the one given, else OFFLOAD_MAX_PAYLOAD, else the default."""
    return max_payload or env_int("OFFLOAD_MAX_PAYLOAD", DEFAULT_MAX_PAYLOAD, minimum=1)


def encode_input(spec: JobSpec, max_payload: int) -> bytes:
    """The job input as stored (JSON), or the InvalidJob / PayloadTooLarge enqueue raises. A function, so a
    producer can check specs up front (the CLI reading a file) without a job-store connection."""
    try:
        payload = orjson.dumps(spec.input)
    except TypeError as exc:
        raise InvalidJob(f"job input is not JSON-serialisable: {exc}") from None
    if len(payload) > max_payload:
        raise PayloadTooLarge(f"job input is {len(payload)} bytes, over the limit of {max_payload} bytes")
    return payload


def check_options(spec: JobSpec) -> None:
    """Raise InvalidJob naming the first option of the spec enqueue would refuse."""
    if type(spec.priority) is not int or spec.priority not in PRIORITY_RANGE:
        raise InvalidJob(f"priority must be an integer from -1000 to 1000, got {spec.priority!r}")
    if type(spec.max_attempts) is not int or spec.max_attempts < 1:
        raise InvalidJob(f"max_attempts must be an integer >= 1, got {spec.max_attempts!r}")
    if not isinstance(spec.retention, int) or spec.retention < 0:
        raise InvalidJob(f"retention must be an integer >= 0 seconds, got {spec.retention!r}")
    if spec.delay is not None and spec.run_at is not None:
        raise InvalidJob("give either delay or run_at, not both")
    if spec.delay is not None and (type(spec.delay) not in (int, float) or spec.delay < 0):
        raise InvalidJob(f"delay must be >= 0 seconds, got {spec.delay!r}")
    for name in ("idempotency_key", "output_key"):
        value = getattr(spec, name)
        if value is not None and (
            not isinstance(value, str) or not value or len(value) > 1024 or any(ord(c) < 32 for c in value)
        ):
            raise InvalidJob(f"{name} must be a string of 1-1024 printable characters, got {value!r}")


def validate_spec(spec: JobSpec, max_payload: int | None = None) -> None:
    """Raise the error enqueue would raise for this spec, without enqueuing and without a connection (the CLI
    checks a whole file before the first job goes in)."""
    encode_input(spec, max_payload_limit(max_payload))
    check_options(spec)
