"""fal's queue API (the `queue.fal.run` host), optionally under `fal_prefix`.

As fal documents it: submit is `POST /{owner}/{app}[/{subpath}]` with the raw input as the body and
answers `{request_id, response_url, status_url, cancel_url, queue_position}`; the three URLs point at this server
and keep only `{owner}/{app}` (the subpath is dropped; `workflows/` and `comfy/` namespaces are kept); status is
202 while `IN_QUEUE`/`IN_PROGRESS` and 200 when `COMPLETED`, always with `queue_position` and `logs` keys (the
SDK indexes them); `COMPLETED` covers failure and cancellation too, told apart by `error`/`error_type` and by
the result's HTTP code; cancel is `PUT`; auth is `Key <key>`.

fal's paths are generic, so these routes are registered last, or mounted under `fal_prefix` (e.g. `/fal`) so
they cannot shadow anything. The fal SDK builds `https://{FAL_QUEUE_RUN_HOST}/{app}`, so to drive it at the
simulator serve TLS and set `FAL_QUEUE_RUN_HOST=127.0.0.1:PORT` (with a prefix: `127.0.0.1:PORT/fal`); it then
follows the URLs returned at submit.
Unverified upstream and chosen here: the result of an unfinished request is 400, of a failed one 500, of a
cancelled one 400 with `error_type: request_cancelled`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from starlette.routing import Route

from offload.testing.sim.config import Behaviour
from offload.testing.sim.engine import Call, Dialect, Reply, Sim
from offload.testing.sim.store import Job

NAMESPACES = ("workflows", "comfy")
RESERVED = ("_sim", "v1", "v2", "jobs")  # first path segments owned by other families when the prefix is empty
NGINX_503 = (
    b"<html>\r\n<head><title>503 Service Temporarily Unavailable</title></head>\r\n<body>\r\n<center>"
    b"<h1>503 Service Temporarily Unavailable</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n"
    b"</html>\r\n"
)
RUNNING = ("queued", "running")


class FalDialect(Dialect):
    family = "fal"
    schemes = ("Key",)
    required = ("status", "request_id", "status_url", "response_url")

    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        body: dict[str, Any] = {"detail": message}
        if code:
            body["error_type"] = code
        return Reply(body, status, headers={"X-Fal-Error-Type": code} if code else {})

    def unauthorized(self) -> Reply:
        return self.error(401, "Authentication is required to access this application.")

    def throttled(self, behaviour: Behaviour, headers: dict[str, str]) -> Reply:
        return Reply({"detail": "Rate limit exceeded"}, 429, headers=dict(headers))

    def unavailable(self) -> Reply:
        """What an ingress outage looks like: nginx HTML without x-fal-request-id (the SDK retries exactly that)."""
        return Reply(None, 503, raw=NGINX_503, media_type="text/html")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def _app(call: Call) -> str:
    p = call.request.path_params
    ns = p.get("ns")
    if ns is not None and ns not in NAMESPACES:
        call.reject(404, "Application not found")
    return f"{ns}/{p['owner']}/{p['app']}" if ns else f"{p['owner']}/{p['app']}"


def _urls(call: Call, app: str, request_id: str) -> dict[str, str]:
    base = f"{call.base_url}{call.sim.config.fal_prefix}/{app}/requests/{request_id}"
    return {"response_url": base, "status_url": f"{base}/status", "cancel_url": f"{base}/cancel"}


def _find(call: Call) -> Job:
    app = _app(call)
    job = call.lookup(call.request.path_params["request_id"])
    if job is None or job.target != app:
        call.reject(404, "Request not found")
    return job


def _position(job: Job, now: float) -> int:
    """An estimate, not a count (counting would cost O(jobs) per poll): whole seconds until the job starts."""
    return max(0, int(job.started - now))


def _logs(job: Job, phase: str) -> list[dict[str, Any]]:
    lines = [(job.started, "simulated: processing")]
    if phase not in RUNNING:
        lines.append((job.ended_at(), "simulated: done"))
    return [{"message": m, "level": "INFO", "source": "user", "timestamp": _iso(t)} for t, m in lines]


def _error(job: Job, phase: str) -> tuple[int, str, str] | None:
    """(result HTTP code, message, error_type) of a job that did not succeed."""
    if phase == "failed":
        return 500, job.error or "Internal Server Error", "internal_server_error"
    if phase == "timed_out":
        return 504, "Request timed out", "request_timeout"
    if phase in ("cancelled", "aborted"):
        return 400, "Request was cancelled", "request_cancelled"
    return None


def _hook_body(call: Call, job: Job) -> dict[str, Any]:
    """fal's webhook body: `status` OK with the output as `payload`, or ERROR with `error` (documented shape)."""
    phase = job.phase(call.now)
    body: dict[str, Any] = {"request_id": job.id, "gateway_request_id": job.id, "status": "OK", "payload": None}
    if phase in RUNNING:  # fal sends no progress events; a stale copy is the final one without its payload
        body["payload_error"] = "payload not ready"
        return body
    if failure := _error(job, phase):
        body.update(status="ERROR", error=failure[1], payload={"detail": failure[1], "error_type": failure[2]})
    else:
        body["payload"] = call.output(job)
        body["error"] = None
    return body


async def submit(call: Call) -> Reply:
    parts = [p for p in call.request.path_params["path"].split("/") if p]
    if parts and parts[0] in RESERVED and not call.sim.config.fal_prefix:
        call.reject(404, "Not Found")
    size = 3 if parts and parts[0] in NAMESPACES else 2
    if len(parts) < size:
        call.reject(404, "Application not found: use /{owner}/{app}[/{path}]")
    app = "/".join(parts[:size])
    if len(parts) > size and parts[size] == "requests":
        # `…/requests/{id}[/status|/cancel]` with the wrong method: never a new submission (cancel is PUT).
        call.reject(405, "Method Not Allowed")
    payload = await call.json()
    meta: dict[str, Any] = {"path": "/".join(parts[size:])}
    if webhook := call.request.query_params.get("fal_webhook"):
        meta["webhook"] = webhook
    for name, value in call.request.headers.items():
        if name.startswith("x-fal-"):
            meta[name] = value
    job = call.submit(app, payload, job_id=call.sim.uuid(), meta=meta)
    call.webhook(job, meta.get("webhook"), _hook_body)
    return Reply({"request_id": job.id, **_urls(call, app, job.id), "queue_position": _position(job, call.now)})


async def status(call: Call) -> Reply:
    job = _find(call)
    phase = job.phase(call.now)
    want_logs = call.request.query_params.get("logs", "").lower() in ("1", "true")
    body: dict[str, Any] = {
        "status": "IN_QUEUE" if phase == "queued" else "IN_PROGRESS" if phase == "running" else "COMPLETED",
        "request_id": job.id,
        "response_url": _urls(call, job.target, job.id)["response_url"],
        "queue_position": _position(job, call.now) if phase == "queued" else None,
        "logs": _logs(job, phase) if want_logs and phase != "queued" else None,
    }
    if phase in RUNNING:
        return Reply(body, 202)
    body["metrics"] = {"inference_time": round(job.ran_for(call.now), 6)}
    if failure := _error(job, phase):
        body["error"], body["error_type"] = failure[1], failure[2]
    return Reply(body, 200)


async def result(call: Call) -> Reply:
    job = _find(call)
    phase = job.phase(call.now)
    if phase in RUNNING:
        call.reject(400, "Request is still in progress")
    if failure := _error(job, phase):
        call.reject(failure[0], failure[1], code=failure[2])
    return Reply(call.output(job))


async def cancel(call: Call) -> Reply:
    app = _app(call)
    job = call.sim.store.get(call.request.path_params["request_id"], call.now, "fal")
    if job is None or job.target != app:
        return Reply({"status": "NOT_FOUND"}, 404)
    if not call.sim.store.cancel(job, call.now):
        return Reply({"status": "ALREADY_COMPLETED"}, 400)
    call.sim.stats.cancelled("fal")
    return Reply({"status": "CANCELLATION_REQUESTED"}, 202)


def routes(sim: Sim) -> list[Route]:
    """Exact request routes first (plain, then namespaced), the catch-all submit last."""
    d = FalDialect()
    p = sim.config.fal_prefix
    out: list[Route] = []
    for app in ("/{owner}/{app}", "/{ns}/{owner}/{app}"):
        req = f"{p}{app}/requests/{{request_id}}"
        out += [
            Route(f"{req}/status", sim.endpoint(d, "fal.status", "status", status), methods=["GET"]),
            Route(req, sim.endpoint(d, "fal.result", "result", result), methods=["GET"]),
            Route(f"{req}/cancel", sim.endpoint(d, "fal.cancel", "cancel", cancel), methods=["PUT"]),
        ]
    out.append(Route(f"{p}/{{path:path}}", sim.endpoint(d, "fal.submit", "submit", submit), methods=["POST"]))
    return out
