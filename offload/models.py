"""Typed records shared by the queue, the clients and the CLI."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from offload import exactjson
from offload.caps import CapKind, QueueStatus, queue_status

# A job's defaults, the same through every way in: `Client.enqueue`, `offload enqueue`, POST /v1/jobs, `JobSpec`.
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_RETENTION_S = 7 * 86_400  # how long a finished job's record is kept
# A queue's defaults: offload.yaml's (config.QueueSettings), and of what runs a queue without one (`offload up`).
DEFAULT_CONCURRENCY = 256  # jobs in flight per dispatch worker
DEFAULT_POLL_INTERVAL_S = 5.0
DEFAULT_POLL_TIMEOUT_S = 600.0
DEFAULT_SUBMIT_CONCURRENCY = 32


class JobState(enum.StrEnum):
    """Where a job is in its lifecycle (see docs/explanation/architecture.md, "The job lifecycle")."""

    QUEUED = "queued"
    DELAYED = "delayed"
    ACTIVE = "active"
    SUBMITTED = "submitted"
    RETRYING = "retrying"
    HELD = "held"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED})


def _int(value: str | None, default: int = 0) -> int:
    return int(value) if value not in (None, "") else default


def _opt_int(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


def _opt_float(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


def _opt_str(value: str | None) -> str | None:
    return value if value not in (None, "") else None


def _files(recorded: str | None, raw_input: str | None) -> tuple[str, ...] | None:
    """The keys enqueue recorded; none when the input cannot hold a `$file` key (not even escaped); None when a
    record without the field (written before it, or ingested as the producer wrote it) may hold references."""
    if recorded:
        return tuple(orjson.loads(recorded))
    if not raw_input or ("$file" not in raw_input and "\\u" not in raw_input):
        return ()
    return None


@dataclass(frozen=True, slots=True)
class Job:
    """A snapshot of one job record. Times are Unix epoch milliseconds."""

    id: str
    queue: str
    state: JobState
    input: Any
    output_key: str
    priority: int
    attempts: int
    max_attempts: int
    lease_expiries: int
    created_at: int
    run_at: int | None = None
    started_at: int | None = None
    finished_at: int | None = None
    lease_owner: str | None = None
    lease_token: str | None = None
    lease_deadline: int | None = None
    backend: str | None = None
    remote_id: str | None = None
    result: str | None = None
    cost: float | None = None
    kind: str | None = None  # the capacity that ran it (CapacityKind), once a run of it finished or cost something
    error: str | None = None
    cancel_requested: bool = False
    idempotency_key: str | None = None
    raw: str | None = None
    submission: int | None = None
    intent_at: int | None = None
    intent_by: str | None = None
    possible_duplicates: int = 0
    routed: str | None = None  # a routed queue's reason for its latest submission's backend (worker/routing.py)
    files: tuple[str, ...] | None = ()  # the object keys the input refers to; None: not recorded (`_files`)
    deadline: int | None = None  # epoch ms: not started after it (fails `deadline passed`)
    max_cost: float | None = None  # USD: no submission priced over it (fails `over max_cost`)
    callback_url: str | None = None  # where its completion webhook goes (its own; a queue's is in offload.yaml)

    @classmethod
    def from_hash(cls, job_id: str, h: dict[str, str], lease_deadline: int | None = None) -> Job:
        """Build a Job from the Redis hash. The store writes only fields that differ from their defaults
        (attempts 0, output key results/<id>.json), so absent fields take those defaults here."""
        raw_input = h.get("input")
        try:
            decoded = exactjson.loads(raw_input) if raw_input not in (None, "") else None
        except ValueError:  # orjson's and the standard library's decode errors both derive from it
            decoded = raw_input
        cost = h.get("cost")
        state = JobState(h["state"])
        leased = state in (JobState.ACTIVE, JobState.SUBMITTED)
        return cls(
            id=job_id,
            queue=job_id.partition(":")[0],
            state=state,
            input=decoded,
            output_key=h.get("output_key") or f"results/{job_id}.json",
            priority=_int(h.get("priority")),
            attempts=_int(h.get("attempts")),
            max_attempts=_int(h.get("max_attempts"), 1),
            lease_expiries=_int(h.get("expiries")),
            created_at=_int(h.get("created_at")),
            run_at=_opt_int(h.get("run_at")),
            started_at=_opt_int(h.get("started_at")),
            finished_at=_opt_int(h.get("finished_at")),
            lease_owner=_opt_str(h.get("owner")),
            lease_token=_opt_str(h.get("token")) if leased else None,  # a finished job keeps it only to
            # recognise a repeated complete; it is no lease any more
            lease_deadline=lease_deadline if _opt_str(h.get("owner")) else None,
            backend=_opt_str(h.get("backend")),
            remote_id=_opt_str(h.get("remote_id")),
            result=_opt_str(h.get("result")),
            cost=_opt_float(cost),
            kind=_opt_str(h.get("kind")),
            error=_opt_str(h.get("error")),
            cancel_requested=h.get("cancel") == "1",
            idempotency_key=_opt_str(h.get("idem")),
            raw=_opt_str(h.get("raw")),
            submission=_opt_int(h.get("sub_n")),
            intent_at=_opt_int(h.get("intent_at")),
            intent_by=_opt_str(h.get("intent_by")),
            possible_duplicates=_int(h.get("possible_duplicates")),
            routed=_opt_str(h.get("routed")),
            files=_files(h.get("files"), raw_input),
            deadline=_opt_int(h.get("deadline")),
            max_cost=_opt_float(h.get("max_cost")),
            callback_url=_opt_str(h.get("callback")),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view; the lease token is left out because it authorises writes."""
        return {
            "id": self.id,
            "queue": self.queue,
            "state": self.state.value,
            "input": self.input,
            "output_key": self.output_key,
            "priority": self.priority,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "lease_expiries": self.lease_expiries,
            "created_at": self.created_at,
            "run_at": self.run_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "lease_owner": self.lease_owner,
            "lease_deadline": self.lease_deadline,
            "backend": self.backend,
            "remote_id": self.remote_id,
            "result": self.result,
            "cost": self.cost,
            "kind": self.kind,
            "error": self.error,
            "cancel_requested": self.cancel_requested,
            "idempotency_key": self.idempotency_key,
            "raw": self.raw,
            "submission": self.submission,
            "intent_at": self.intent_at,
            "intent_by": self.intent_by,
            "possible_duplicates": self.possible_duplicates,
            "deadline": self.deadline,
            "max_cost": self.max_cost,
            "routed": self.routed,
            "callback_url": self.callback_url,
        }


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What an enqueue made of one job: its id, and `record_gone` when an idempotency key answered with a job
    that finished and whose record was trimmed since (the key outlives it): nothing new runs, and `get` of the
    id raises JobNotFound."""

    id: str
    record_gone: bool = False


#: Who claims on a queue served by GPU workers and serverless overflow ("": any other queue; see pick.lua).
ClaimMode = Literal["", "fleet", "overflow"]


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """What a worker needs to run one leased job. `remote_id` set means: resume polling, never resubmit."""

    id: str
    token: str
    attempt: int
    max_attempts: int
    input_json: str
    output_key: str
    backend: str | None
    remote_id: str | None
    cancel_requested: bool
    redelivered: bool = False  # claimed before (a retry or a crashed lease)
    submission: int = 0  # the number of its latest submit intent (0: never submitted)
    intent_open: bool = False  # that intent has no recorded remote id: it may have reached the provider
    begun: bool = False  # the claim opened this lease's intent for `submission` (claim.lua's `begin`)
    max_cost: float | None = None  # USD: the most one submission may cost (worker/budget.py)
    deadline: int | None = None  # epoch ms on the store's clock: the latest start; routes by expected finish

    @property
    def input(self) -> Any:
        return orjson.loads(self.input_json)


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """Jobs the worker must act on: leases it lost (stop touching them) and cancels to carry out."""

    lost: list[str] = field(default_factory=list)
    cancel_requested: list[str] = field(default_factory=list)
    seq: int = 0  # the queue's lease sequence number when the heartbeat ran: `since` for the next one
    released: int = 0  # leases the worker did not list, handed back
    stepped_back_ms: int = 0  # the store's clock stepped back this far, and this call moved its times back with it


#: The kinds of capacity a job runs on: a dispatch worker at a serverless API, or a GPU worker of the fleet.
CapacityKind = Literal["serverless", "fleet"]
#: The lines of a queue's spend: each kind, and the fleet's rental its jobs did not use (autoscale/fleet_idle.py).
SPEND_KINDS = ("serverless", "fleet", "fleet_idle")


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Counts per state plus the age of the oldest ready job, for `offload queues` and autoscaling."""

    queue: str
    paused: bool
    counts: dict[str, int]
    oldest_ready_age_ms: int | None
    workers: int
    totals: dict[str, int]
    capped: CapKind | None = None  # the daily cap reached in the store's window, from the config (caps.py)
    spend: dict[str, float] = field(default_factory=dict)  # USD per SPEND_KINDS line, the store's UTC day
    spend_total: dict[str, float] = field(default_factory=dict)  # USD per SPEND_KINDS line, since the queue began

    @property
    def status(self) -> QueueStatus:
        return queue_status(self.paused, self.capped)

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "status": self.status,
            "capped": self.capped,
            "paused": self.paused,
            "counts": self.counts,
            "oldest_ready_age_ms": self.oldest_ready_age_ms,
            "workers": self.workers,
            "totals": self.totals,
            "spend": self.spend,
            "spend_total": self.spend_total,
        }


#: How an attempt ended (lua/includes/attempts.lua): `failed` was retried; `released` handed back uncounted (a
#: drain, a pre-empted machine); `lease lost` taken back from a worker that stopped heartbeating; `held` over a cap.
AttemptOutcome = Literal["succeeded", "failed", "dead", "cancelled", "held", "released", "lease lost"]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One lease of a job (offload/queue/attempts.py): who claimed it, what it submitted or resumed, how its end
    was learnt and how it ended. Times are epoch ms on the store's clock; `outcome` None: still running."""

    number: int  # 1, 2, ...: every lease, also those a lease loss or a release gave back to max_attempts
    claimed_at: int
    claimed_by: str  # a dispatch worker's host:pid, or a GPU worker's r-... id
    token: str  # the lease token (a fencing token: shown once the attempt ended, when it fences nothing)
    backend: str | None = None
    remote_id: str | None = None
    submission: int | None = None  # the submission number (the Idempotency-Key's run): equal on a resumed attempt
    submitted_at: int | None = None
    resumed: bool = False  # polled an earlier attempt's remote job: nothing was sent
    adopted: bool = False  # the remote id came from the provider's webhook or a stale worker's answer, not the call
    learned_by: str | None = None  # response, poll, webhook or worker
    finished_at: int | None = None
    outcome: AttemptOutcome | None = None
    error: str | None = None
    cost: float | None = None
    kind: str | None = None  # the capacity it ran on (CapacityKind)

    @property
    def duration_ms(self) -> int | None:
        return None if self.finished_at is None else self.finished_at - self.claimed_at

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view; the token of a lease still running is left out, as it authorises writes."""
        out = {name: getattr(self, name) for name in self.__slots__}
        out["duration_ms"] = self.duration_ms
        if self.outcome is None:
            out["token"] = None
        return out
