"""Script replies decoded into named records, each in one place: a Lua script answers flat lists (the cheapest
thing to build and send), and the position of every field is written down here, next to its name, instead of
as an index wherever the reply is read. Each decoder's docstring names the script whose `Returns:` it follows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
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
    "max_cost",
    "deadline",
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
    max_cost: str,
    deadline: str,
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
        max_cost=float(max_cost) if max_cost else None,
        deadline=int(float(deadline)) if deadline else None,
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
    """stats.lua's reply: paused, the STATS_STATES counts, oldest ready age (ms, -1 none), live workers, totals,
    today's spend per kind of capacity and the spend per kind since the queue began."""
    paused, *counts = reply[: 1 + len(STATS_STATES)]
    age, workers, totals, today, spent = reply[1 + len(STATS_STATES) :]
    return QueueStats(
        queue=queue,
        paused=bool(paused),
        counts={name: int(v) for name, v in zip(STATS_STATES, counts, strict=True)},
        oldest_ready_age_ms=int(age) if int(age) >= 0 else None,
        workers=int(workers),
        totals={k: int(v) for k, v in pairs(totals).items()},
        spend={k: float(v) for k, v in pairs(today).items()},
        spend_total={k: float(v) for k, v in pairs(spent).items()},
    )


class Verdict(enum.StrEnum):
    """What a script says of one job's lease, the word before any payload. A StrEnum: equal to the reply text."""

    OK = "OK"
    CANCEL = "CANCEL"  # a cancel was requested: begin opened nothing; a checkpoint recorded the id all the same
    DUP = "DUP"  # the submission already has another remote id (checkpoint: the lease is ours, or STALE:DUP)
    REMOTE = "REMOTE"  # begin: a stale worker's answer was attached since the claim: poll it, pay nothing
    CAP = "CAP"  # begin: a daily cap is reached (held until the window rolls over)
    MOVED = "MOVED"  # begin: an unknown outcome at another backend (the detail): settled there, never here
    ATTACHED = "ATTACHED"  # checkpoint: the lease was lost, the answer recorded for the job's next owner
    STALE = "STALE"  # another lease holds the job, or it finished
    NOTFOUND = "NOTFOUND"


class _ReplyText:
    """A decoded reply equal to the same record and to the reply text it came from (as a `Verdict` is): its
    `__str__` gives that text back."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        """Equal to the same record, and to the reply text it was decoded from (as a `Verdict` is)."""
        if isinstance(other, str):
            return str(self) == other
        return isinstance(other, type(self)) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


@dataclass(frozen=True, slots=True, eq=False)
class Begun(_ReplyText):
    """begin.lua's verdict on one item: OK:<n>, OK:<n>:DUP, REMOTE:<n>:<remote id>, MOVED:<backend>, CAP:<cap>,
    CANCEL, STALE or NOTFOUND. `submission`: the number the intent opened (OK) or attached (REMOTE); `duplicate`:
    an earlier try of that submission has an unknown outcome; `detail`: the cap reached (CAP), the remote id
    (REMOTE) or the backend the open intent went to (MOVED)."""

    verdict: Verdict
    submission: int = 0
    duplicate: bool = False
    detail: str = ""

    def __str__(self) -> str:
        if self.verdict is Verdict.OK:
            return f"OK:{self.submission}:DUP" if self.duplicate else f"OK:{self.submission}"
        if self.verdict is Verdict.REMOTE:
            return f"REMOTE:{self.submission}:{self.detail}"
        if self.verdict in (Verdict.CAP, Verdict.MOVED):
            return f"{self.verdict.value}:{self.detail}"
        return self.verdict.value


def begun(reply: str) -> Begun:
    word, _, rest = str(reply).partition(":")
    verdict = Verdict(word)
    if verdict is Verdict.OK:
        number, _, dup = rest.partition(":")
        return Begun(verdict, int(number), duplicate=dup == "DUP")
    if verdict is Verdict.REMOTE:
        number, _, remote_id = rest.partition(":")
        return Begun(verdict, int(number), detail=remote_id)
    return Begun(verdict, detail=rest)


@dataclass(frozen=True, slots=True, eq=False)
class Checkpointed(_ReplyText):
    """checkpoint.lua's verdict on one item: OK, OK:CANCEL, DUP:<first id>, ATTACHED, STALE:DUP, STALE or NOTFOUND.
    `recorded`: the remote id is the job's now; `cancel`: a cancel was requested meanwhile; `duplicate`: the
    submission already had another remote id (`first`, when the lease is still ours), so ours is a copy."""

    verdict: Verdict
    cancel: bool = False
    duplicate: bool = False
    first: str = ""

    @property
    def recorded(self) -> bool:
        """The lease is ours and the job goes on with a remote id (ours, or `first`)."""
        return self.verdict is Verdict.OK or self.verdict is Verdict.DUP

    def __str__(self) -> str:
        if self.verdict is Verdict.OK:
            return "OK:CANCEL" if self.cancel else "OK"
        if self.verdict is Verdict.DUP:
            return f"DUP:{self.first}"
        return "STALE:DUP" if self.duplicate else self.verdict.value


def checkpointed(reply: str) -> Checkpointed:
    word, _, rest = str(reply).partition(":")
    verdict = Verdict(word)
    if verdict is Verdict.OK:
        return Checkpointed(verdict, cancel=rest == "CANCEL")
    if verdict is Verdict.DUP:
        return Checkpointed(verdict, duplicate=True, first=rest)
    return Checkpointed(verdict, duplicate=rest == "DUP")


def lease_verdict(reply: str) -> Verdict:
    """complete.lua's and fence.lua's word per item: OK, STALE or NOTFOUND."""
    return Verdict(str(reply))


def cap_reached(reply: str) -> str | None:
    """reserve.lua's verdict on one item: None for OK, else the cap reached ("jobs" or "spend") of CAP:<cap>."""
    verdict = Verdict(str(reply).partition(":")[0])
    return None if verdict is Verdict.OK else str(reply).partition(":")[2]


def already(reply: str) -> str | None:
    """cancel.lua's reply: the terminal state of ALREADY:<state>, else None (cancelled, requested, NOTFOUND)."""
    word, _, state = str(reply).partition(":")
    return state if word == "ALREADY" else None
