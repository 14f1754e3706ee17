"""What a job to enqueue is, and the checks enqueue makes of it, without a connection.

Split from store.py so a producer (the CLI reading a file, the HTTP API) can check specs up front, and so the
rules enqueue applies to a spec live in one place: the input's JSON encoding and size limit, and each option's
range.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from offload.egress import url_problem
from offload.env import env_int
from offload.errors import InvalidJob, PayloadTooLarge
from offload.models import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETENTION_S

DEFAULT_MAX_PAYLOAD = 1 << 20
PRIORITY_RANGE = range(-1000, 1001)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job to enqueue. `delay` (seconds) and `run_at` (epoch seconds) are alternatives, and so are
    `deadline` (epoch seconds) and `deadline_in` (seconds from the store's clock at enqueue): the latest time the
    job may start; past it the job fails `deadline passed` instead of running late. `max_cost` (USD): the most
    one submission may cost by the backend's price model; a dearer one fails `over max_cost` unsent.
    `callback_url`: where the job's completion webhook goes (docs/how-to/completion-webhooks.md)."""

    input: Any
    priority: int = 0
    delay: float | None = None
    run_at: float | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    output_key: str | None = None
    retention: int = DEFAULT_RETENTION_S
    idempotency_key: str | None = None
    job_id: str | None = None
    deadline: float | None = None
    deadline_in: float | None = None
    max_cost: float | None = None
    callback_url: str | None = None


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
    check_budget(spec)
    for name in ("idempotency_key", "output_key"):
        value = getattr(spec, name)
        if value is not None and (
            not isinstance(value, str) or not value or len(value) > 1024 or any(ord(c) < 32 for c in value)
        ):
            raise InvalidJob(f"{name} must be a string of 1-1024 printable characters, got {value!r}")
    if spec.callback_url is not None and (problem := url_problem(spec.callback_url)):
        raise InvalidJob.about("callback_url", f"callback_url {problem}")


def _number(value: object) -> bool:
    return type(value) in (int, float) and value == value and value not in (float("inf"), float("-inf"))


def check_budget(spec: JobSpec) -> None:
    """The deadline and max_cost checks: a deadline already past (by this process's clock: the store's decides
    at claim) or not after the job's run_at/delay, and a negative max_cost, are refused."""
    if spec.max_cost is not None and (not _number(spec.max_cost) or spec.max_cost < 0):
        raise InvalidJob.about("max_cost", f"max_cost must be a number >= 0 (USD), got {spec.max_cost!r}")
    if spec.deadline is not None and spec.deadline_in is not None:
        raise InvalidJob.about("deadline_in", "give either deadline or deadline_in, not both")
    if spec.deadline_in is not None:
        if not _number(spec.deadline_in) or spec.deadline_in <= 0:
            raise InvalidJob.about("deadline_in", f"deadline_in must be > 0 seconds, got {spec.deadline_in!r}")
        start = (spec.delay or 0.0) if spec.run_at is None else spec.run_at - time.time()
        if spec.deadline_in <= start:
            raise InvalidJob.about(
                "deadline_in", f"deadline_in {spec.deadline_in:g}s is not after the job's start ({start:g}s from now)"
            )
    if spec.deadline is not None:
        if not _number(spec.deadline):
            raise InvalidJob.about("deadline", f"deadline must be epoch seconds, got {spec.deadline!r}")
        now = time.time()
        if spec.deadline <= now:
            raise InvalidJob.about(
                "deadline", f"deadline {spec.deadline:.0f} is in the past (now {now:.0f}, epoch seconds)"
            )
        start = spec.run_at if spec.run_at is not None else now + (spec.delay or 0.0)
        if spec.deadline <= start:
            raise InvalidJob.about(
                "deadline", f"deadline {spec.deadline:.0f} is not after the job's run_at {start:.0f}"
            )


def deadline_options(deadline: float | datetime | timedelta | None) -> tuple[float | None, float | None]:
    """(deadline, deadline_in) for JobSpec from the one `deadline` the client and the CLI take: epoch seconds or
    a datetime (a naive one is UTC) as it is, a timedelta counted from enqueue on the store's clock."""
    if isinstance(deadline, timedelta):
        return None, deadline.total_seconds()
    if isinstance(deadline, datetime):
        aware = deadline if deadline.tzinfo is not None else deadline.replace(tzinfo=UTC)
        return aware.timestamp(), None
    return deadline, None


def validate_spec(spec: JobSpec, max_payload: int | None = None) -> None:
    """Raise the error enqueue would raise for this spec, without enqueuing and without a connection (the CLI
    checks a whole file before the first job goes in)."""
    encode_input(spec, max_payload_limit(max_payload))
    check_options(spec)
