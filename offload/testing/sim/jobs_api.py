"""The tutorial's job API (offload's `http-job` backend): `POST /jobs` with the input as the body → `{"id"}`,
`GET /jobs/{id}` → `{"status": queued|running|succeeded|failed, "output"}`, Bearer auth.

`POST /jobs/{id}/cancel` and the `cancelled` status are our extension: the tutorial has no cancel, but a control
plane that promises no double GPU spend needs one to test against.
"""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

from offload.testing.sim.engine import Call, Dialect, Reply, Sim
from offload.testing.sim.store import Job

STATUS = {
    "queued": "queued",
    "running": "running",
    "succeeded": "succeeded",
    "failed": "failed",
    "timed_out": "failed",
    "cancelled": "cancelled",
    "aborted": "cancelled",
}


class JobsDialect(Dialect):
    family = "jobs"
    required = ("id", "status")

    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        return Reply({"error": message, "code": code or str(status)}, status)


def _view(call: Call, job: Job) -> dict[str, Any]:
    phase = job.phase(call.now)
    body: dict[str, Any] = {"id": job.id, "status": STATUS[phase], "output": None}
    if phase == "succeeded":
        body["output"] = call.output(job)
    elif phase in ("failed", "timed_out"):
        body["error"] = job.error or "timed out"
    return body


def _find(call: Call) -> Job:
    job = call.lookup(call.request.path_params["job_id"])
    if job is None:
        call.reject(404, "job not found", code="not_found")
    return job


async def submit(call: Call) -> Reply:
    payload = await call.json()
    if payload is None:
        call.reject(400, "the request body (the job input) is required", code="invalid_input")
    meta = {k: payload[k] for k in ("metadata", "webhook", "tags") if isinstance(payload, dict) and k in payload}
    job = call.submit("jobs", payload, meta=meta)
    return Reply({"id": job.id, "status": "queued"})


async def status(call: Call) -> Reply:
    return Reply(_view(call, _find(call)))


async def cancel(call: Call) -> Reply:
    job = _find(call)
    if call.sim.store.cancel(job, call.now):
        call.sim.stats.cancelled("jobs")
    return Reply(_view(call, job))


def routes(sim: Sim) -> list[Route]:
    d = JobsDialect()
    return [
        Route("/jobs", sim.endpoint(d, "jobs.submit", "submit", submit), methods=["POST"]),
        Route("/jobs/{job_id}", sim.endpoint(d, "jobs.status", "status", status), methods=["GET"]),
        Route("/jobs/{job_id}/cancel", sim.endpoint(d, "jobs.cancel", "cancel", cancel), methods=["POST"]),
    ]
