"""Key layout, queue-name rules and job ids: every Redis key offload uses outside the autoscaler (whose keys
are in offload.autoscale.keyspace) is named here, and nowhere else in Python (tests/project/test_keys_layout.py greps).

Every key of a queue carries the queue's name as a Redis Cluster hash tag (`offload:{gpu}:ready`), so all
of a queue's atomic scripts run on one node of a cluster. The scripts get the prefix as KEYS[1] and append the
suffixes listed in QUEUE_SUFFIXES themselves (a script may only touch keys derived from the ones it is given).
Job ids embed their queue (`gpu:0192ab...`) so a job can be found from its id alone without a cross-slot index.
Keys of one backend share a `{backend:<name>}` tag (its rate limiter's script touches two of them at once).
"""

from __future__ import annotations

import hashlib
import os
import re
import time

from offload.errors import InvalidJob, InvalidQueueName

NAMESPACE = "offload"
QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
QUEUES_KEY = f"{NAMESPACE}:queues"  # every queue ever used (set)

#: The suffixes of a queue's keys after `prefix(queue)`, with what each holds: the whole per-queue layout, the
#: Lua scripts included (a test checks every `P .. '<suffix>'` of offload/queue/lua is listed here).
QUEUE_SUFFIXES: dict[str, str] = {
    "job:": "job:<id>, a job's hash",
    "att:": "att:<id>, a job's ended attempts (failed, dead, cancelled, held, released, lease lost), one JSON record "
    "per attempt number and `n`; the running or succeeded one is the job's record itself (the first 5 and the last "
    "45; deleted with the job)",
    "ready": "jobs waiting to be claimed, by priority then age (zset)",
    "delayed": "jobs waiting for their run_at (zset, ms)",
    "retry": "jobs waiting out a retry backoff (zset, ms)",
    "active": "claimed jobs by lease expiry (zset, ms)",
    "held": "jobs held over a cap (zset)",
    "succeeded": "finished jobs kept for their retention (zset)",
    "dead": "dead-lettered jobs (zset)",
    "cancelled": "cancelled jobs (zset)",
    "cancelreq": "active jobs asked to cancel (set)",
    "submitted": "active jobs already submitted to a remote API (set)",
    "owned:": "owned:<worker>, the jobs a worker holds (zset)",
    "workers": "workers by last sign of life (zset, ms)",
    "lastclaim:": "lastclaim:<worker>, when a worker last claimed",
    "lost:": "lost:<worker>, jobs whose lease a worker lost, with counts (hash, 1 day)",
    "excused": "workers whose silence was excused as a job-store outage (set)",
    "tok": "lease-token counter (the fencing tokens)",
    "seq": "enqueue sequence counter (ready-set ordering)",
    "seen": "the latest clock reading a script saw (a clock running behind keeps the later one; one more than a "
    "second behind is a step back), and the steps back not yet logged",
    "enq:": "enq:<nonce>, an enqueue already applied (a retried enqueue adds nothing twice; 10 min)",
    "idem:": "idem:<key>, the job an idempotency key created",
    "idem:tutorial:": "idem:tutorial:<id>, jobs ingested from the tutorial's list",
    "stats": "per-queue counters (hash)",
    "hist": "wait and run histograms (hash)",
    "history:m:": "history:m:<unix s>, the history of one UTC minute: counts by outcome, the wait and run histograms "
    "(`wait:<i>`, `run:<i>`: /metrics' buckets), spend in nano-USD by kind (`spend:<kind>`) and backend "
    "(`sb:<backend>`), provider calls and errors, the gauges' peak (`g:<name>`) (hash, expires: history.lua)",
    "history:h:": "history:h:<unix s>, the same for one UTC hour (hash, expires)",
    "history:d:": "history:d:<unix s>, the same for one UTC day (hash, expires)",
    "history:cfg": "the history's settings from offload.yaml: on, and how long each resolution is kept (ms); kept a "
    "day past the longest (hash)",
    "dups": "duplicate-delivery counters (hash)",
    "cap:": "cap:<window>:jobs|spend, the spend cap's counters",
    "spend:": "spend:<window>, the day's spend per kind of capacity: serverless, fleet (hash, 40 days)",
    "spent": "the spend per kind of capacity since the queue began (hash)",
    "paused": "present while the queue is paused",
    "flow": "a queue with overflow: the fleet's reach, written by the autoscaler each evaluation for the overflow "
    "worker's claims (hash: skip, idle, per_ms, run_ms, after_ms; expires)",
    "events": "job state changes (stream, capped)",
    "hooks:": "hooks:<worker id>, pub/sub: webhooks kept for the jobs that dispatch worker holds (hook.lua)",
    "idle": "present while a claim found the ready set empty: the next job made ready PUBLISHes on `wake`",
    "wake": "pub/sub: jobs became ready after a claim found none (ready.lua's `wake`): idle workers claim at once",
    "alert:dlg": "the dead-letter alert's last snapshot",
    "synced": "written before each WAIT of a durable write, so the WAIT covers a resent one (sync_mark.lua)",
    "uploads:": "uploads:<job id>[/<run>], the HTTP uploads issued for a job's input (or one run's output): object "
    "key -> bytes (hash, expires)",
    "cb:url": "present while the queue has a callback_url of its own (the server writes it from offload.yaml)",
    "cb:due": "the completion webhooks owed, job ids by when the next try is due, a claimed one by its claim's end "
    "(zset, ms)",
    "cb:info": "per owed or dead-lettered completion webhook, its tries, last error and claim token (hash of JSON)",
    "cb:failed": "dead-lettered completion webhooks, job ids by when (zset, ms)",
    "cb:tok": "completion-webhook claim counter (the claims' tokens)",
    "cb:stats": "completion-webhook totals since the queue began: delivered, failed_try (every try that failed), "
    "dead_lettered, requeued (hash; /metrics)",
    "cb:secret": "the queue's completion-webhook signing secrets, sealed by the vault: current, previous and when "
    "the previous stops (hash)",
}

API_KEYS = f"{NAMESPACE}:apikeys"  # ids of the HTTP server's API keys (set)
# This job store's identity: a random id, written once (the file sweep's first start), named by a marker object in
# the bucket (offload.storage.namespace.STORE_MARKER). The sweep deletes files only while the two agree.
STORE_ID = f"{NAMESPACE}:store-id"
GPU_WORKERS = f"{NAMESPACE}:rworkers"  # HTTP-registered workers by heartbeat deadline (zset, ms)
GPU_WORKER_ID_PREFIX = "r-"  # a GPU worker's id (the server's registry gives it); a dispatch worker's is host:pid

#: Sets a job can be listed from, by the state name users see.
STATE_SETS: dict[str, str] = {
    "queued": "ready",
    "delayed": "delayed",
    "retrying": "retry",
    "active": "active",
    "held": "held",
    "succeeded": "succeeded",
    "dead": "dead",
    "cancelled": "cancelled",
}


def validate_queue(name: str) -> str:
    """Reject names that would break key tags, URLs or S3 keys, naming the rule that failed."""
    if not isinstance(name, str) or not QUEUE_NAME_RE.match(name):
        raise InvalidQueueName(
            f"invalid queue name {name!r}: use 1-100 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit"
        )
    return name


def prefix(queue: str) -> str:
    """The key prefix every script receives as KEYS[1]."""
    return f"{NAMESPACE}:{{{queue}}}:"


def job(queue: str, job_id: str) -> str:
    """A job's hash (`job_id` is the full id, queue included)."""
    return prefix(queue) + "job:" + job_id


def attempts(queue: str, job_id: str) -> str:
    """A job's attempts (a hash beside its record, in its slot: offload/queue/attempts.py, includes/attempts.lua)."""
    return prefix(queue) + "att:" + job_id


def state_set(queue: str, state: str) -> str:
    """The set a job in `state` (a key of STATE_SETS, as users name states) is listed from."""
    return prefix(queue) + STATE_SETS[state]


def submitted(queue: str) -> str:
    """The active jobs already submitted to a remote API (a set; `offload jobs --state submitted` lists it)."""
    return prefix(queue) + "submitted"


def events(queue: str) -> str:
    return prefix(queue) + "events"


def paused(queue: str) -> str:
    return prefix(queue) + "paused"


def overflow_reach(queue: str) -> str:
    """What the fleet of a queue with overflow starts in time (the autoscaler's estimate; see pick.lua)."""
    return prefix(queue) + "flow"


def histograms(queue: str) -> str:
    return prefix(queue) + "hist"


#: The history's resolutions: the letter its bucket keys carry, by bucket length in seconds.
HISTORY_RESOLUTIONS: dict[int, str] = {60: "m", 3600: "h", 86400: "d"}


def history_bucket(queue: str, step_s: int, start_s: int) -> str:
    """The history hash of the bucket of `step_s` seconds (60, 3600, 86400) that starts at `start_s` (unix s)."""
    return prefix(queue) + f"history:{HISTORY_RESOLUTIONS[step_s]}:{start_s}"


def history_sampled(step_s: int, start_s: int) -> str:
    """Set (expiring with the buckets) once a server sampled the gauges in that bucket: a queue with no gauge there
    was idle (all zero: the sampler writes nothing for it), where no marker means nobody sampled (unknown)."""
    return f"{NAMESPACE}:history:sampled:{HISTORY_RESOLUTIONS[step_s]}:{start_s}"


def history_config(queue: str) -> str:
    return prefix(queue) + "history:cfg"


def duplicates(queue: str) -> str:
    return prefix(queue) + "dups"


def packs(queue: str) -> str:
    """Which provider-batch pack each job of the queue last went out in (a hash: job id -> pack record)."""
    return prefix(queue) + "packs"


def workers(queue: str) -> str:
    return prefix(queue) + "workers"


def owned(queue: str, worker_id: str) -> str:
    return prefix(queue) + f"owned:{worker_id}"


def cap(queue: str, window: str, counter: str) -> str:
    """A spend cap's counter for one window: `counter` is "jobs" or "spend"."""
    return prefix(queue) + f"cap:{window}:{counter}"


def dead_letter_alert(queue: str) -> str:
    return prefix(queue) + "alert:dlg"


def uploads(queue: str, job_id: str, run: int | None = None) -> str:
    """The HTTP uploads issued for a job's input, or for one run's output (routes_files.py's per-job limits)."""
    return prefix(queue) + f"uploads:{job_id}" + ("" if run is None else f"/{run}")


def callback_flag(queue: str) -> str:
    """Present while the queue has a callback_url of its own: every job it ends then owes a webhook (outbox.lua)."""
    return prefix(queue) + "cb:url"


def callback_failed(queue: str) -> str:
    return prefix(queue) + "cb:failed"


def callback_info(queue: str) -> str:
    return prefix(queue) + "cb:info"


def callback_due(queue: str) -> str:
    return prefix(queue) + "cb:due"


def callback_stats(queue: str) -> str:
    """The queue's completion-webhook totals (callback_done.lua, callback_requeue.lua count them)."""
    return prefix(queue) + "cb:stats"


def callback_secret(queue: str) -> str:
    return prefix(queue) + "cb:secret"


def api_key(key_id: str) -> str:
    return f"{NAMESPACE}:apikey:{key_id}"


def auth_failures(address: str) -> str:
    """Failed-authentication counter of one client address (an IPv4 address or an IPv6 /64; a fixed window)."""
    return f"{NAMESPACE}:authfail:ip:{address}"


def auth_key_failures(key_id: str) -> str:
    """Failed-authentication counter of one existing API key id: wrong secrets presented for it (a fixed window)."""
    return f"{NAMESPACE}:authfail:key:{key_id}"


def gpu_worker(worker_id: str) -> str:
    """An HTTP-registered worker's record (hash, expires with its heartbeats)."""
    return f"{NAMESPACE}:rworker:{worker_id}"


def backend_prefix(backend: str) -> str:
    return f"{NAMESPACE}:{{backend:{backend}}}:"


def backend_rate(backend: str) -> str:
    """The backend's GCRA rate-limiter state (theoretical arrival time, ms)."""
    return backend_prefix(backend) + "gcra"


def backend_cooldown(backend: str) -> str:
    """Present while the provider asked every worker to back off (429 / Retry-After)."""
    return backend_prefix(backend) + "cooldown"


def backend_health(backend: str) -> str:
    """A routed backend's health (hash): its state, recent errors, openings in a row, the probe's lease, the mean
    run time and queue delay (offload/queue/backend_health.py)."""
    return backend_prefix(backend) + "health"


def backend_counts(backend: str) -> str:
    """Per-outcome call counters of a backend (hash)."""
    return backend_prefix(backend) + "counts"


def queue_of(job_id: str) -> str:
    """The queue a job id belongs to; raises InvalidJob for ids offload never issued."""
    queue, sep, rest = job_id.partition(":")
    if not sep or not rest or not QUEUE_NAME_RE.match(queue):
        raise InvalidJob(f"invalid job id {job_id!r}: expected '<queue>:<id>'")
    return queue


def new_job_id(queue: str) -> str:
    """Time-ordered, collision-resistant id: 48-bit ms timestamp + 64 random bits, hex."""
    return f"{queue}:{int(time.time() * 1000):012x}{os.urandom(8).hex()}"


def hooks_channel(queue: str, worker_id: str) -> str:
    """The pub/sub channel on which a dispatch worker hears of webhooks for the jobs it holds (hook.lua)."""
    return f"{prefix(queue)}hooks:{worker_id}"


def wake_channel(queue: str) -> str:
    """The pub/sub channel on which idle dispatch workers hear that jobs became ready (ready.lua's `wake`)."""
    return f"{prefix(queue)}wake"


def hook_digest(backend: str, secret: str) -> str:
    """What a job record keeps of a webhook URL's secret (begin.lua), and what the server compares it with. It binds
    the secret to the backend the submission went to: under another backend's path (one that checks another
    signature, or none) the same secret matches nothing."""
    return hashlib.sha256(f"{len(backend)}:{backend}/{secret}".encode()).hexdigest()
