"""Request and response bodies. Requests forbid unknown fields, so a misspelt option is a 422 naming it
instead of a silently ignored setting."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Annotated, Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from offload.caps import CapKind, QueueStatus
from offload.models import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETENTION_S
from offload.queue.specs import JobSpec

DEFAULT_MAX_BATCH = 1000
# The answering server's --max-batch, set per request by GuardedRoute (auth.py) before the body is validated.
BATCH_LIMIT: ContextVar[int] = ContextVar("offload_batch_limit", default=DEFAULT_MAX_BATCH)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


CENTURY_S = 100 * 365 * 86_400
LAST_EPOCH_S = 253_402_300_799  # 9999-12-31: times past it overflow Redis scores and Python dates alike


class JobOptions(_Request):
    """Per-job options, as in `Client.enqueue`. Upper bounds keep values inside what Redis can store."""

    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first; FIFO within a priority.")
    delay: float | None = Field(None, ge=0, le=CENTURY_S, description="Seconds before the job is ready.")
    run_at: float | None = Field(None, ge=0, le=LAST_EPOCH_S, description="Epoch seconds when the job is ready.")
    max_attempts: int = Field(DEFAULT_MAX_ATTEMPTS, ge=1, le=1000)
    output_key: str | None = Field(None, min_length=1, max_length=1024, description="Default results/<id>.json.")
    retention: int = Field(
        DEFAULT_RETENTION_S, ge=0, le=CENTURY_S, description="Seconds a finished record is kept (0: a century)."
    )
    idempotency_key: str | None = Field(None, min_length=1, max_length=1024)
    deadline: float | None = Field(
        None,
        gt=0,
        le=LAST_EPOCH_S,
        description="Epoch seconds: the latest the job may start; past it (the store's clock) it fails "
        "`deadline passed` instead of running late. A job already running then is not stopped.",
    )
    deadline_in: float | None = Field(
        None, gt=0, le=CENTURY_S, description="Seconds from enqueue (the store's clock): `deadline`, relative."
    )
    max_cost: float | None = Field(
        None,
        ge=0,
        le=1e12,
        description="USD: the most one submission may cost by the backend's price model; a dearer one fails "
        "`over max_cost` without being sent.",
    )
    callback_url: str | None = Field(
        None,
        max_length=2048,
        description="http(s) URL on a host the operator allows (callbacks.hosts): a signed completion webhook is "
        "POSTed there when the job succeeds, goes dead or is cancelled.",
    )


class EnqueueRequest(JobOptions):
    input: Any = Field(..., description="The job input: any JSON value (at most 1 MiB by default).")

    def spec(self, idempotency_key: str | None = None, job_id: str | None = None) -> JobSpec:
        return JobSpec(
            input=self.input,
            priority=self.priority,
            delay=self.delay,
            run_at=self.run_at,
            max_attempts=self.max_attempts,
            output_key=self.output_key,
            retention=self.retention,
            idempotency_key=self.idempotency_key or idempotency_key,
            job_id=job_id,
            deadline=self.deadline,
            deadline_in=self.deadline_in,
            max_cost=self.max_cost,
            callback_url=self.callback_url,
        )


class BatchEnqueueRequest(_Request):
    jobs: list[EnqueueRequest] = Field(
        ...,
        min_length=1,
        description="At most the server's --max-batch jobs (its OpenAPI description states the number as maxItems).",
    )

    @field_validator("jobs", mode="before")
    @classmethod
    def _at_most_max_batch(cls, v: Any) -> Any:
        """Before the items are validated (pydantic checks max_length only after validating every item, which
        for a million `{}` is a million error records). An HTTPException passes through pydantic: 413."""
        limit = BATCH_LIMIT.get()
        if isinstance(v, list) and len(v) > limit:
            raise HTTPException(413, f"batch of {len(v)} jobs is over the limit of {limit}")
        return v


class EnqueueReply(BaseModel):
    id: str
    duplicate: bool = Field(False, description="True when the idempotency key was seen before.")
    record_gone: bool = Field(
        False,
        description="True when the key's job finished and its record was trimmed since (the key outlives it): "
        "nothing runs again, and GET of the id answers 404.",
    )


class BatchEnqueueReply(BaseModel):
    ids: list[str]
    record_gone: list[str] = Field(
        default_factory=list,
        description="The ids among `ids` whose idempotency key answered with a finished job whose record was "
        "trimmed since: nothing runs again, and GET of such an id answers 404.",
    )


class AttemptView(BaseModel):
    """One attempt of a job: one lease, from its claim to how it ended (docs/how-to/dashboard.md, "A job's story")."""

    number: int = Field(description="1, 2, ...: every lease, also one a lease loss or a release gave back.")
    claimed_at: int = Field(description="Epoch ms, the job store's clock.")
    claimed_by: str = Field(description="The worker: a dispatch worker's host:pid, or a GPU worker's r-... id.")
    token: str | None = Field(None, description="The lease token, once the attempt ended (while it runs it fences).")
    backend: str | None = None
    remote_id: str | None = None
    submission: int | None = Field(None, description="The submission number: a resumed attempt keeps its own.")
    submitted_at: int | None = None
    resumed: bool = Field(False, description="It polled an earlier attempt's remote job: nothing was submitted.")
    adopted: bool = Field(False, description="Its remote id came from the provider's webhook, not the submit call.")
    learned_by: str | None = Field(None, description="How its end was learnt: response, poll, webhook or worker.")
    finished_at: int | None = None
    duration_ms: int | None = None
    outcome: str | None = Field(
        None, description="succeeded, failed (retried), dead, cancelled, held, released or lease lost; null: running."
    )
    error: str | None = Field(None, description="Its error, redacted as the job's last error is (1,000 characters).")
    cost: float | None = Field(None, description="USD: what this run cost, where known.")
    kind: str | None = None
    console_url: str | None = Field(None, description="The remote job's page in the provider's web console, if any.")


class JobEvent(BaseModel):
    """One entry of the queue's event stream that names the job."""

    at: int = Field(description="Epoch ms (the stream entry's id).")
    state: str = Field(description="The state entered (queued, active, submitted, ...) or what happened (routed, ...).")
    detail: dict[str, str] = Field(
        default_factory=dict, description="The entry's other fields (a route's backend, why)."
    )


class AttemptsReply(BaseModel):
    """A job's attempts, oldest first: all of them, or the first 5 and the last 45 of a job that made more."""

    id: str
    made: int = Field(description="How many attempts the job made; more than listed when some were dropped.")
    attempts: list[AttemptView]
    events: list[JobEvent] = Field(
        default_factory=list, description="Its entries among the latest 1,000 of its queue's event stream."
    )


class JobView(BaseModel):
    """A job record. The lease token is never included: it authorises writes."""

    id: str
    queue: str
    state: str
    input: Any = None
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
    lease_deadline: int | None = None
    backend: str | None = None
    remote_id: str | None = None
    result: str | None = None
    result_url: str | None = Field(None, description="Presigned GET of the stored output (succeeded jobs).")
    file_urls: dict[str, str] | None = Field(
        None, description="Presigned GETs of the files the job's input and output refer to, by object key."
    )
    cost: float | None = Field(
        None,
        description="USD: what the run that succeeded cost; null: unknown (an API without a price, or a GPU worker "
        "that is no rented machine)",
    )
    kind: str | None = Field(
        None, description="The capacity that ran it: serverless (a dispatch worker) or fleet (a GPU worker)."
    )
    error: str | None = None
    cancel_requested: bool = False
    idempotency_key: str | None = None
    raw: str | None = None
    submission: int | None = Field(None, description="The number of its latest submission to the provider.")
    possible_duplicates: int = Field(
        0,
        description="Submissions sent again after a worker was lost inside "
        "the submit call (the provider may have run the job twice).",
    )
    deadline: int | None = Field(None, description="Epoch ms: the latest the job may start.")
    max_cost: float | None = Field(None, description="USD: the most one submission may cost.")
    routed: str | None = Field(
        None,
        description="A queue with several backends: why its latest submission went to `backend` "
        "(e.g. `fallback: replicate cooling down until 12:04:05Z, sent to fal`).",
    )
    callback_url: str | None = Field(None, description="Where the job's own completion webhook goes.")


class WaitReply(JobView):
    timed_out: bool = Field(False, description="True when the wait ended before the job finished.")


class JobPage(BaseModel):
    jobs: list[JobView]
    next_cursor: str | None = Field(None, description="Pass as ?cursor= for the next page; null at the end.")


class CancelReply(BaseModel):
    id: str
    result: str = Field(
        ...,
        description="cancelled (it was waiting, nothing remote) or requested: a remote job may still run, and the "
        "worker holding the job (or, for a waiting one, the next dispatch worker to claim it) cancels it first; "
        "a repeat answers requested until then",
    )


class QueueView(BaseModel):
    queue: str
    status: QueueStatus = Field(
        description="running; paused (no claims); capped (a daily cap is reached: queued jobs wait for the next "
        "cap window, the job store's UTC day)"
    )
    capped: CapKind | None = Field(None, description='The cap reached: "jobs" or "spend"; null when not capped.')
    paused: bool
    counts: dict[str, int]
    oldest_ready_age_ms: int | None
    workers: int
    totals: dict[str, int]
    spend: dict[str, float] = Field(
        default_factory=dict,
        description="USD per kind of capacity on the job store's UTC day: serverless (dispatch workers' API runs), "
        "fleet (GPU workers' runs: run time x their machine's price), fleet_idle (the rented machines' cost the "
        "fleet's jobs did not use; only for a queue with rented machines). A GPU worker that is no rented machine "
        "has no price: its runs are counted in totals.fleet_unpriced, not here.",
    )
    spend_total: dict[str, float] = Field(
        default_factory=dict, description="The same lines as `spend`, since the queue began."
    )
    rates: dict[str, float | None] = Field(default_factory=dict, description="Per second, over rate_window_s.")
    rate_window_s: float | None = None


class MoveRequest(_Request):
    ids: list[str] = Field(default_factory=list, max_length=10_000)
    all: bool = Field(False, description="Every job in the set (bounded by its size at the start).")


class MoveReply(BaseModel):
    moved: list[str]


class PurgeRequest(_Request):
    state: str


class CountReply(BaseModel):
    count: int


class KeyCreateRequest(_Request):
    scope: str
    queues: list[str] = Field(default_factory=list)
    name: str = Field("", max_length=200)


class KeyView(BaseModel):
    id: str
    scope: str
    queues: list[str]
    name: str
    created_at: int


class KeyCreated(KeyView):
    token: str = Field(..., description="Shown once; only its hash is stored.")


INSTANCE_ID = r"^[A-Za-z0-9._:-]{1,128}$"
Short = Annotated[str, Field(max_length=128)]


class GpuInfo(_Request):
    """One GPU as `nvidia-smi` reports it (what a worker may say about itself, bounded)."""

    index: Annotated[str, Field(max_length=16)] | int | None = None
    name: Short = ""
    memory_mb: Annotated[str, Field(max_length=16)] | int | None = None
    uuid: Short = ""


class RegisterRequest(_Request):
    """A worker's self-report: shown to operators and read by the autoscaler, so every field is bounded."""

    queues: list[str] = Field(..., min_length=1, max_length=100)
    host: str = Field("", max_length=255)
    version: str = Field("", max_length=64)
    pid: int | None = Field(None, ge=0, le=2**31)
    concurrency: int = Field(1, ge=1, le=10_000)
    instance_id: str | None = Field(None, pattern=INSTANCE_ID)
    instance_token: str | None = Field(
        None,
        max_length=128,
        description="The machine's OFFLOAD_INSTANCE_TOKEN: required to register as an autoscaler instance (`as-…`).",
    )
    protected: bool = Field(
        False,
        description="Honoured by the autoscaler only where the instance's provider config sets allow_worker_protect.",
    )
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=16)


class RegisterReply(BaseModel):
    worker_id: str
    lease_ms: int
    heartbeat_interval_s: float
    max_wait_s: float


class ClaimRequest(_Request):
    queue: str
    max: int = Field(1, ge=1, le=1000)
    wait: float = Field(0, ge=0, description="Seconds to long-poll when nothing is ready.")


class ClaimedView(BaseModel):
    id: str
    token: str
    queue: str
    attempt: int
    max_attempts: int
    input: Any
    output_key: str
    cancel_requested: bool


class ClaimReply(BaseModel):
    jobs: list[ClaimedView]


class HeartbeatRequest(_Request):
    jobs: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=10_000)
    tokens: list[Annotated[str, Field(max_length=256)]] | None = Field(
        None, max_length=10_000, description="the lease token of each job in `jobs`, in the same order"
    )
    protected: bool | None = None
    instance_id: str | None = Field(
        None, pattern=INSTANCE_ID, description="Must be the one the worker registered with (or absent)."
    )


class HeartbeatReplyView(BaseModel):
    lost: list[str]
    cancel_requested: list[str]
    timed_out: list[str] = Field(
        default_factory=list,
        description="Runs that passed their queue's `timeout`: the attempt failed with the reason (also listed in "
        "`lost`); abandon the run, its result is refused.",
    )


class CompleteRequest(_Request):
    token: str = Field(..., min_length=1, max_length=512)
    output: Any = Field(None, description="The handler's result: stored as JSON at the job's output key.")


class CompleteReply(BaseModel):
    id: str
    result: str


class FailRequest(_Request):
    token: str = Field(..., min_length=1, max_length=512)
    error: str = Field(..., max_length=4000)
    retryable: bool = True


class FailReply(BaseModel):
    id: str
    state: str


class TokenRequest(_Request):
    token: str = Field(..., min_length=1, max_length=512)


class DeregisterRequest(_Request):
    release: bool = Field(True, description="Hand back every lease still held (remote ids kept).")


class WorkerView(BaseModel):
    id: str
    kind: str = Field(..., description="remote (HTTP, runs a handler) or dispatch (submits to a backend)")
    host: str = ""
    version: str = ""
    queues: list[str]
    in_flight: int
    last_heartbeat: int | None = None
    instance_id: str | None = None
    protected: bool = False
    gpus: list[dict[str, Any]] = Field(default_factory=list)
    concurrency: int | None = None
    registered_at: int | None = None
    lease_deadline: int | None = Field(default=None, description="Dispatch: when the store reaps it if silent.")


class DeadGroupView(BaseModel):
    pattern: str = Field(..., description="The error with its ids and numbers replaced: the group's name.")
    example: str = Field(..., description="The newest error of the group, as it was.")
    count: int
    sample_ids: list[str]


class DeadGroupsReply(BaseModel):
    groups: list[DeadGroupView] = Field(..., description="Largest first.")
    scanned: int = Field(..., description="Dead jobs read (the newest first, at most 10,000).")
    complete: bool = Field(..., description="False when the dead letter has more jobs than were read.")


class GroupRequest(_Request):
    pattern: str | None = Field(None, max_length=1000, description="A group's pattern, as the groups route gives it.")
    ids: list[str] = Field(default_factory=list, max_length=10_000, description="Or these dead jobs.")


class Percentiles(BaseModel):
    p50: float | None
    p95: float | None
    p99: float | None


class HistoryPointView(BaseModel):
    t: int = Field(description="The bucket's start, unix seconds (the job store's clock, UTC).")
    enqueued: int
    succeeded: int
    failed: int = Field(description="Attempts that failed and were retried (a job that died counts in `dead`).")
    dead: int
    cancelled: int
    wait_ms: Percentiles = Field(description="Ready to claimed, from /metrics' histogram buckets; null: none.")
    run_ms: Percentiles = Field(description="Claimed to succeeded, from /metrics' histogram buckets; null: none.")
    spend_usd: dict[str, float] = Field(description="USD by kind of capacity: serverless, fleet.")
    spend_by_backend: dict[str, float] = Field(description="USD by the backend a run was at (fleet runs have none).")
    provider_calls: int = Field(description="Submissions opened to a provider.")
    provider_errors: int = Field(description="Attempts at a provider that failed.")
    backlog: int | None = Field(
        description="Queued and retrying jobs: the bucket's peak sample; null: no sample (no server, or idle)."
    )
    in_flight: int | None = Field(description="Active jobs: the bucket's peak sample; null: no sample.")
    fleet_machines: int | None = Field(description="The queue's rented machines running or starting: peak sample.")
    fleet_usd_per_h: float | None = Field(description="Those machines' price per hour: peak sample.")


class HistoryReply(BaseModel):
    queue: str | None = Field(description="null: summed over every queue the key may read.")
    range: str
    step_s: int = Field(description="Each point's length: 60 (range hour) or 3600 (day, week).")
    points: list[HistoryPointView] = Field(description="Oldest first, the current bucket last; every bucket present.")
