"""A job's attempts, one per lease (lua/includes/attempts.lua): those that ended other than by success are records
in a hash beside the job, written by the script that ended them; the current one (running, or the one that
succeeded) is read from the job's own record, where claim, checkpoint and complete keep it. story.lua reads both
at one moment. Read-only here.
"""

from __future__ import annotations

from typing import Any

import orjson

from offload.errors import JobNotFound
from offload.models import Attempt

ATTEMPTS_HEAD, ATTEMPTS_TAIL = 5, 45  # the ended attempts kept: the first and the last (attempts.lua's copy)
CURRENT = (
    "state",
    "started_at",
    "token",
    "backend",
    "remote_id",
    "sub_n",
    "remote_n",
    "submitted_at",
    "adopted_at",
    "hook_n",
    "finished_at",
    "cost",
    "kind",
)  # story.lua's order
CURRENT_STATES = ("active", "submitted", "succeeded")  # the states whose lease is in the record, not yet written


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) or (isinstance(value, str) and value.isdigit()) else None


def _float(value: Any) -> float | None:
    if isinstance(value, int | float):
        return float(value)
    return float(value) if isinstance(value, str) and value else None


def worker_of(token: str) -> str:
    """The worker a lease token was issued to (claim.lua's `<worker id>/<sequence>`)."""
    return token.rpartition("/")[0] or token


def ended(number: int, text: str) -> Attempt:
    """An attempt as attempts.lua wrote it when it ended."""
    rec = orjson.loads(text)
    token = str(rec.get("token") or "")
    claimed, submitted = _int(rec.get("claimed_at")) or 0, _int(rec.get("submitted_at"))
    return Attempt(
        number=number,
        claimed_at=claimed,
        claimed_by=worker_of(token),
        token=token,
        backend=rec.get("backend") or None,
        remote_id=rec.get("remote_id") or None,
        submission=_int(rec.get("sub")),
        submitted_at=submitted,
        resumed=submitted is not None and submitted < claimed,
        adopted=bool(rec.get("adopted")),
        learned_by=rec.get("learned") or None,
        finished_at=_int(rec.get("ended_at")),
        outcome=rec.get("outcome") or None,
        error=rec.get("error") or None,
        cost=_float(rec.get("cost")),
        kind=rec.get("kind") or None,
    )


def _submission(started: int, submitted_at: int | None, adopted_at: int | None) -> tuple[int | None, bool]:
    """(when the lease's remote job was submitted or learnt of, adopted): adopted when a webhook recorded it during
    the lease and the lease never checkpointed it (a `start` webhook followed by its own checkpoint is no
    adoption); else its own checkpoint's time, or an earlier lease's checkpoint or adoption, whichever is later
    (before the claim: resumed). attempts.lua's rule."""
    own = submitted_at is not None and submitted_at >= started
    if adopted_at is not None and adopted_at >= started and not own:
        return adopted_at, True
    if own or adopted_at is None:
        return submitted_at, False
    return max(adopted_at, submitted_at or 0), False


def current(number: int, job: dict[str, str | None]) -> Attempt | None:
    """The attempt the job's record holds: its lease while it runs, or the lease that succeeded."""
    state, token, started = job["state"], job["token"] or "", _int(job["started_at"])
    if state not in CURRENT_STATES or not token or started is None:
        return None
    done = state == "succeeded"
    remote = bool(job["remote_id"]) and job["remote_n"] == job["sub_n"]
    submitted, adopted = (
        _submission(started, _int(job["submitted_at"]), _int(job["adopted_at"])) if remote else (None, False)
    )
    finished = _int(job["finished_at"]) if done else None
    learned = None
    if done and job["kind"] == "fleet":
        learned = "worker"
    elif done and remote:  # a synchronous answer records the submission in the ack itself (complete.lua)
        learned = "webhook" if job["hook_n"] == job["sub_n"] else "response" if submitted == finished else "poll"
    return Attempt(
        number=number,
        claimed_at=started,
        claimed_by=worker_of(token),
        token=token,
        backend=job["backend"] or None,
        remote_id=job["remote_id"] if remote else None,
        submission=_int(job["sub_n"]) if remote else None,
        submitted_at=submitted,
        resumed=submitted is not None and submitted < started,
        adopted=adopted,
        learned_by=learned,
        finished_at=finished,
        outcome="succeeded" if done else None,
        cost=_float(job["cost"]) if done else None,
        kind=job["kind"] if done else None,
    )


def decode(job_id: str, reply: Any) -> tuple[list[Attempt], int]:
    """story.lua's reply: (the attempts kept, oldest first; how many the job made). JobNotFound when its record is
    gone."""
    if not reply:
        raise JobNotFound(f"job {job_id} not found")
    flat, values = reply
    raw = dict(zip(flat[::2], flat[1::2], strict=True))
    written = int(raw.pop("n", 0) or 0)
    kept = [ended(int(n), text) for n, text in sorted(raw.items(), key=lambda kv: int(kv[0]))]
    now = current(written + 1, dict(zip(CURRENT, values, strict=True)))
    return ([*kept, now] if now else kept), written + (1 if now else 0)
