"""RunPod serverless queue endpoints under `/v2/{endpoint_id}` (point `RUNPOD_ENDPOINT_BASE_URL` at
`{sim}/v2`).

As RunPod documents it: `/run` → `{"id", "status": "IN_QUEUE"}`; `/status/{id}` with `delayTime` and
`executionTime` in ms; `FAILED` carries `error`; `/runsync?wait=ms` holds the request and falls back to a
non-final status; `policy.executionTimeout` ends a job `TIMED_OUT`, `policy.ttl` removes it (404) even while
running; auth is `Bearer <key>` or the bare key. The error body shape is UNVERIFIED upstream; `{"error": msg}` is
what the SDK and curl users can read.
"""

from __future__ import annotations

import hashlib
from typing import Any

from starlette.routing import Route

from offload.testing.sim.engine import Call, Dialect, Reply, Sim
from offload.testing.sim.store import Job

STATUS = {
    "queued": "IN_QUEUE",
    "running": "IN_PROGRESS",
    "succeeded": "COMPLETED",
    "failed": "FAILED",
    "timed_out": "TIMED_OUT",
    "cancelled": "CANCELLED",
    "aborted": "CANCELLED",
}
SYNC_WAIT_DEFAULT_MS = 90_000
SYNC_WAIT_RANGE_MS = (1_000, 300_000)


class RunPodDialect(Dialect):
    family = "runpod"
    bare_key_ok = True
    required = ("status", "output")

    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        return Reply({"error": message}, status)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _worker(job: Job) -> str:
    return "sim" + hashlib.sha1(job.id.encode()).hexdigest()[:11]


def _view(call: Call, job: Job) -> dict[str, Any]:
    phase = job.phase(call.now)
    body: dict[str, Any] = {"id": job.id, "status": STATUS[phase]}
    if call.now >= job.started and phase != "aborted":
        body["delayTime"] = _ms(job.started - job.created)
        body["workerId"] = _worker(job)
        if phase != "running":
            body["executionTime"] = _ms(job.ran_for(call.now))
    if phase == "succeeded":
        body["output"] = call.output(job)
    elif phase == "failed":
        body["error"] = job.error
    return body


def _find(call: Call) -> Job:
    job = call.lookup(call.request.path_params["job_id"])
    if job is None or job.target != call.request.path_params["endpoint_id"]:
        call.reject(404, "request does not exist")
    return job


def _ms_field(call: Call, policy: dict[str, Any], name: str) -> float | None:
    value = policy.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        call.reject(400, f"policy.{name} must be a positive number of milliseconds")
    return float(value) / 1000


async def _create(call: Call, sync: bool) -> Job:
    body = await call.json_object()
    if "input" not in body or body["input"] is None:
        call.reject(400, "input is required")
    policy = body.get("policy") or {}
    if not isinstance(policy, dict):
        call.reject(400, "policy must be an object")
    run_timeout = _ms_field(call, policy, "executionTimeout")
    ttl = _ms_field(call, policy, "ttl")
    meta: dict[str, Any] = {k: body[k] for k in ("webhook", "policy", "s3Config") if k in body}
    job_id = ("sync-" if sync else "") + call.sim.uuid() + "-u1"
    return call.submit(
        call.request.path_params["endpoint_id"],
        body["input"],
        job_id=job_id,
        meta=meta,
        run_timeout=run_timeout,
        hard_ttl=ttl,
    )


async def run(call: Call) -> Reply:
    job = await _create(call, sync=False)
    call.webhook(job, job.meta.get("webhook"), _view)
    return Reply({"id": job.id, "status": "IN_QUEUE"})


async def runsync(call: Call) -> Reply:
    raw = call.request.query_params.get("wait")
    try:
        wait_ms = SYNC_WAIT_DEFAULT_MS if raw is None else int(raw)
    except ValueError:
        call.reject(400, "wait must be an integer number of milliseconds")
    low, high = SYNC_WAIT_RANGE_MS
    job = await _create(call, sync=True)
    await call.hold(job, min(max(wait_ms, low), high) / 1000)
    return Reply(_view(call, job))


async def status(call: Call) -> Reply:
    return Reply(_view(call, _find(call)))


async def stream(call: Call) -> Reply:
    """The SDK's `Job.stream()` reads `{"status", "stream": [{"output"}]}`; a simulated job yields one chunk."""
    job = _find(call)
    view = _view(call, job)
    chunks = [{"output": view["output"]}] if "output" in view else []
    return Reply({"status": view["status"], "stream": chunks})


async def cancel(call: Call) -> Reply:
    job = _find(call)
    if call.sim.store.cancel(job, call.now):
        call.sim.stats.cancelled("runpod")
    return Reply({"id": job.id, "status": STATUS[job.phase(call.now)]})


async def retry(call: Call) -> Reply:
    """Only FAILED / TIMED_OUT jobs; the same id runs again, which is a second GPU spend and is counted."""
    job = _find(call)
    if job.phase(call.now) not in ("failed", "timed_out"):
        call.reject(400, "only FAILED or TIMED_OUT jobs can be retried")
    sim, b = call.sim, call.behaviour
    job.started = call.now + b.queue_delay.sample(sim.rng)
    job.finished = job.started + b.latency.sample(sim.rng)
    job.outcome = "failed" if sim.chance(b.fail_rate) else "succeeded"
    job.error = b.error_message if job.outcome == "failed" else None
    job.stopped = None
    job.meta["retried"] = int(job.meta.get("retried", 0)) + 1
    sim.store.rescheduled(job)
    sim.stats.submitted("runpod", job.input_key)
    call.created = job  # logged as a submission, like a create
    return Reply({"id": job.id, "status": "IN_QUEUE"})


async def purge_queue(call: Call) -> Reply:
    endpoint_id = call.request.path_params["endpoint_id"]
    store = call.sim.store
    queued = [j for j in store if j.family == "runpod" and j.target == endpoint_id and j.phase(call.now) == "queued"]
    for job in queued:
        store.remove(job.id)
    return Reply({"removed": len(queued), "status": "completed"})


async def health(call: Call) -> Reply:
    endpoint_id = call.request.path_params["endpoint_id"]
    counts = {"completed": 0, "failed": 0, "inProgress": 0, "inQueue": 0, "retried": 0}
    key = {
        "succeeded": "completed",
        "failed": "failed",
        "timed_out": "failed",
        "running": "inProgress",
        "queued": "inQueue",
    }
    for job in call.sim.store:
        if job.family != "runpod" or job.target != endpoint_id or job.expired(call.now):
            continue
        name = key.get(job.phase(call.now))
        if name:
            counts[name] += 1
        counts["retried"] += int(job.meta.get("retried", 0))
    running = counts["inProgress"]
    return Reply({"jobs": counts, "workers": {"idle": 0 if running else 1, "running": running}})


def routes(sim: Sim) -> list[Route]:
    d = RunPodDialect()
    base = "/v2/{endpoint_id}"
    return [
        Route(f"{base}/run", sim.endpoint(d, "runpod.run", "submit", run), methods=["POST"]),
        Route(f"{base}/runsync", sim.endpoint(d, "runpod.runsync", "submit", runsync), methods=["POST"]),
        Route(f"{base}/status/{{job_id}}", sim.endpoint(d, "runpod.status", "status", status), methods=["GET"]),
        Route(f"{base}/stream/{{job_id}}", sim.endpoint(d, "runpod.stream", "status", stream), methods=["GET"]),
        Route(f"{base}/cancel/{{job_id}}", sim.endpoint(d, "runpod.cancel", "cancel", cancel), methods=["POST"]),
        Route(f"{base}/retry/{{job_id}}", sim.endpoint(d, "runpod.retry", "submit", retry), methods=["POST"]),
        Route(f"{base}/purge-queue", sim.endpoint(d, "runpod.purge", "cancel", purge_queue), methods=["POST"]),
        Route(f"{base}/health", sim.endpoint(d, "runpod.health", "status", health), methods=["GET"]),
    ]
