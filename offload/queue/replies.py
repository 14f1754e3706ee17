"""Script replies decoded into named records, each in one place: a Lua script answers flat lists (the cheapest
thing to build and send), and the position of every field is written down here, next to its name, instead of
as an index wherever the reply is read. Each decoder's docstring names the script whose `Returns:` it follows.
"""

from __future__ import annotations

from typing import Any

from offload.models import ClaimedJob, Enqueued, QueueStats

#: claim.lua's fields per job, in reply order.
CLAIM_FIELDS = (
    "id",
    "token",
    "attempt",
    "max_attempts",
    "input",
    "output_key",
    "backend",
    "remote_id",
    "cancel",
    "claimed_before",
    "submission",
    "intent_open",
    "begun",
)
CLAIM_WIDTH = len(CLAIM_FIELDS)

#: stats.lua's per-state counts, in reply order (after `paused`), by the state names users see.
STATS_STATES = ("queued", "delayed", "active", "submitted", "retrying", "held", "succeeded", "dead", "cancelled")


def _claimed_job(
    job_id: str,
    token: str,
    attempt: str,
    max_attempts: str,
    input_json: str,
    output_key: str,
    backend: str,
    remote_id: str,
    cancel: str,
    claimed_before: str,
    submission: str,
    intent_open: str,
    begun: str,
) -> ClaimedJob:
    return ClaimedJob(
        id=job_id,
        token=token,
        attempt=int(attempt),
        max_attempts=int(max_attempts),
        input_json=input_json,
        output_key=output_key,
        backend=backend or None,
        remote_id=remote_id or None,
        cancel_requested=cancel == "1",
        redelivered=claimed_before == "1",
        submission=int(submission or 0),
        intent_open=intent_open == "1",
        begun=begun == "1",
    )


def claimed(flat: list[str]) -> list[ClaimedJob]:
    """claim.lua's reply (CLAIM_WIDTH fields per job, CLAIM_FIELDS) as ClaimedJob records."""
    if len(flat) % CLAIM_WIDTH:
        raise ValueError(
            f"claim reply of {len(flat)} fields is not {CLAIM_WIDTH} per job: claim.lua and replies.py disagree"
        )
    rows = [iter(flat)] * CLAIM_WIDTH  # one iterator CLAIM_WIDTH times: zip takes each job's fields in turn
    return [_claimed_job(*row) for row in zip(*rows, strict=True)]


def enqueued(reply: list[Any]) -> list[Enqueued]:
    """enqueue.lua's reply: per job its id, or {id, 'gone'} for a key whose job's record was trimmed."""
    return [Enqueued(item) if isinstance(item, str) else Enqueued(item[0], record_gone=True) for item in reply]


def pairs(flat: list[str]) -> dict[str, str]:
    """A hash as a script returns it (HGETALL inside Lua: field, value, field, value, ...)."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def queue_stats(queue: str, reply: list[Any]) -> QueueStats:
    """stats.lua's reply: paused, the STATS_STATES counts, oldest ready age (ms, -1 none), live workers, totals."""
    paused, *counts = reply[: 1 + len(STATS_STATES)]
    age, workers, totals = reply[1 + len(STATS_STATES) :]
    return QueueStats(
        queue=queue,
        paused=bool(paused),
        counts={name: int(v) for name, v in zip(STATS_STATES, counts, strict=True)},
        oldest_ready_age_ms=int(age) if int(age) >= 0 else None,
        workers=int(workers),
        totals={k: int(v) for k, v in pairs(totals).items()},
    )
