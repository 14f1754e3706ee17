"""Replicate predictions under `/v1` (point `replicate.Client(base_url=...)` or `REPLICATE_BASE_URL` at the sim).

As Replicate documents it: creates answer 201 with the prediction object (`urls.get/cancel`), statuses
starting/processing/succeeded/failed/canceled (and `aborted` when a `Cancel-After` deadline passes before the
prediction starts), `metrics.predict_time` once terminal, `Prefer: wait[=N]` holds the create, a failed model run
is HTTP 200 with `status: "failed"`, API errors are RFC 7807 problem JSON, and a 429 says
`{"detail": "Request was throttled. Expected available in N second(s)."}`. With `expiry_mode: data_removed`
an expired prediction keeps answering with `output: null, data_removed: true`, as Replicate does after an hour.
"""

from __future__ import annotations

import functools
import math
import re
from datetime import UTC, datetime
from typing import Any, NoReturn

from starlette.routing import Route

from offload.testing.sim.config import Behaviour
from offload.testing.sim.engine import Call, Dialect, ErrorReply, Reply, Sim
from offload.testing.sim.store import Job

STATUS = {
    "queued": "starting",
    "running": "processing",
    "succeeded": "succeeded",
    "failed": "failed",
    "timed_out": "failed",
    "cancelled": "canceled",
    "aborted": "aborted",
}
TITLES = {
    400: "Bad request",
    401: "Unauthenticated",
    404: "Not found",
    422: "Input validation failed",
    429: "Too many requests",
    500: "Internal server error",
    503: "Service unavailable",
}
PROBLEM = "application/problem+json"
PAGE = 100
MIN_CANCEL_AFTER = 5.0
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")


class ReplicateDialect(Dialect):
    family = "replicate"
    schemes = ("Bearer", "Token")
    required = ("status", "id", "output")

    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        body = {"title": TITLES.get(status, "Error"), "detail": message, "status": status}
        return Reply(body, status, media_type=PROBLEM)

    def unauthorized(self) -> Reply:
        return self.error(401, "You did not pass a valid authentication token")

    def throttled(self, behaviour: Behaviour, headers: dict[str, str]) -> Reply:
        n = max(1, math.ceil(behaviour.retry_after_seconds))
        detail = f"Request was throttled. Expected available in {n} second{'s' if n != 1 else ''}."
        return Reply({"detail": detail}, 429, headers=dict(headers), media_type=PROBLEM)


@functools.lru_cache(maxsize=8192)
def _iso(ts: float) -> str:
    """Cached: a prediction's few timestamps are formatted again for its answer and each of its webhooks
    (docs/explanation/performance.md, *The simulator*)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _view(call: Call, job: Job) -> dict[str, Any]:
    phase = job.phase(call.now)
    base = call.base_url
    removed = job.keep_after_expiry and job.expired(call.now)
    body: dict[str, Any] = {
        "id": job.id,
        "model": job.meta.get("model", "simulated/model"),
        "version": job.meta.get("version", "hidden"),
        "input": {} if removed else job.input,
        "output": None,
        "logs": "",
        "error": None,
        "status": STATUS[phase],
        "created_at": _iso(job.created),
        "data_removed": removed,
        "source": "api",
        "urls": {
            "get": f"{base}/v1/predictions/{job.id}",
            "cancel": f"{base}/v1/predictions/{job.id}/cancel",
            "web": f"{base}/_sim/jobs/{job.id}",
        },
    }
    for key in ("webhook", "webhook_events_filter", "deployment"):
        if key in job.meta:
            body[key] = job.meta[key]
    if "cancel_after" in job.meta:
        body["deadline"] = _iso(job.created + float(job.meta.get("cancel_after", 0)))
    if phase != "queued" and phase != "aborted":
        body["started_at"] = _iso(job.started)
        body["logs"] = "" if removed else "simulated: processing\n"
    if phase in ("succeeded", "failed", "timed_out", "cancelled", "aborted"):
        body["completed_at"] = _iso(job.ended_at())
        body["metrics"] = {
            "predict_time": round(job.ran_for(call.now), 6),
            "total_time": round(job.ended_at() - job.created, 6),
        }
        if not removed and phase != "aborted":
            body["logs"] += "simulated: done\n"
    if phase == "succeeded" and not removed:
        body["output"] = call.output(job)
    elif phase in ("failed", "timed_out"):
        body["error"] = job.error or "Prediction timed out"
    return body


def _find(call: Call) -> Job:
    job = call.lookup(call.request.path_params["prediction_id"])
    if job is None:
        call.reject(404, "The requested resource could not be found.")
    return job


def _duration(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    m = _DURATION.match(text)
    if not m or not any(m.groups()):
        return None
    return int(m[1] or 0) * 3600 + int(m[2] or 0) * 60 + float(m[3] or 0)


def _prefer_wait(call: Call) -> float | None:
    for part in call.request.headers.get("prefer", "").split(","):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "wait":
            try:
                return min(max(float(value), 1.0), 60.0) if value else 60.0
            except ValueError:
                call.reject(400, f"invalid Prefer header value {value!r}")
    return None


async def _create(call: Call, meta: dict[str, Any]) -> Reply:
    body = await call.json_object()
    payload = body.get("input")
    if not isinstance(payload, dict):
        raise_invalid(call, "input", "input is required and must be an object")
    for key in ("webhook", "webhook_events_filter", "webhook_completed", "stream"):
        if key in body:
            meta[key] = body[key]
    wait = _prefer_wait(call)
    cancel_after = call.request.headers.get("cancel-after")
    deadline = None
    if cancel_after is not None:
        deadline = _duration(cancel_after)
        if deadline is None:
            call.reject(400, f"invalid Cancel-After header value {cancel_after!r}")
        deadline = max(deadline, MIN_CANCEL_AFTER)
        meta["cancel_after"] = deadline
    job = call.submit(meta.get("model", "simulated/model"), payload, job_id=call.sim.token(26), meta=meta)
    if deadline is not None and job.created + deadline < job.finished:
        job.stopped = job.created + deadline
        job.stop_phase = "aborted" if job.stopped < job.started else "cancelled"
        call.sim.store.rescheduled(job)
    events = meta.get("webhook_events_filter")
    if isinstance(events, list) and "start" in events:  # sent the moment the prediction exists
        call.webhook(job, meta.get("webhook"), _view, "start")
    if not isinstance(events, list) or "completed" in events:
        call.webhook(job, meta.get("webhook"), _view)
    if wait is not None:
        await call.hold(job, wait)
    view = _view(call, job)
    return Reply(view, 201, headers={"Location": view["urls"]["get"]})


def raise_invalid(call: Call, field: str, description: str) -> NoReturn:
    """Replicate's 422: problem JSON plus `invalid_fields`."""
    reply = call.dialect.error(422, f"- {field}: {description}")
    reply.body["invalid_fields"] = [{"type": "required", "field": field, "description": description}]
    raise ErrorReply(reply)


async def create(call: Call) -> Reply:
    """`version` is a 64-hex id, `owner/name:id`, or `owner/name` for official models."""
    body = await call.json_object()
    version = body.get("version")
    if not isinstance(version, str) or not version:
        raise_invalid(call, "version", "version is required")
    model, _, version_id = version.rpartition(":") if ":" in version else ("", "", version)
    if "/" in version_id and not model:
        model, version_id = version_id, "hidden"
    return await _create(call, {"model": model or "simulated/model", "version": version_id})


async def create_for_model(call: Call) -> Reply:
    p = call.request.path_params
    return await _create(call, {"model": f"{p['owner']}/{p['name']}", "version": "hidden"})


async def create_for_deployment(call: Call) -> Reply:
    p = call.request.path_params
    return await _create(call, {"deployment": f"{p['owner']}/{p['name']}", "version": "hidden"})


async def get(call: Call) -> Reply:
    return Reply(_view(call, _find(call)))


async def cancel(call: Call) -> Reply:
    job = _find(call)
    if call.sim.store.cancel(job, call.now):
        call.sim.stats.cancelled("replicate")
    return Reply(_view(call, job))


async def list_predictions(call: Call) -> Reply:
    """Newest first, 100 a page; `next` is a full cursor URL, as Replicate's is. Lets clients find orphans."""
    try:
        start = int(call.request.query_params.get("cursor", "0"))
    except ValueError:
        call.reject(400, "invalid cursor")
    jobs = [
        j for j in call.sim.store if j.family == "replicate" and not (j.expired(call.now) and not j.keep_after_expiry)
    ]
    jobs.reverse()
    page = jobs[start : start + PAGE]
    url = f"{call.base_url}/v1/predictions?cursor="
    return Reply(
        {
            "next": f"{url}{start + PAGE}" if start + PAGE < len(jobs) else None,
            "previous": f"{url}{max(0, start - PAGE)}" if start > 0 else None,
            "results": [_view(call, j) for j in page],
        }
    )


async def webhook_secret(call: Call) -> Reply:
    """The signing secret of this account's webhooks, as Replicate serves it."""
    return Reply({"key": call.sim.hooks.replicate_secret})


def routes(sim: Sim) -> list[Route]:
    d = ReplicateDialect()
    return [
        Route(
            "/v1/webhooks/default/secret",
            sim.endpoint(d, "replicate.webhook_secret", "status", webhook_secret),
            methods=["GET"],
        ),
        Route("/v1/predictions", sim.endpoint(d, "replicate.create", "submit", create), methods=["POST"]),
        Route("/v1/predictions", sim.endpoint(d, "replicate.list", "status", list_predictions), methods=["GET"]),
        Route(
            "/v1/models/{owner}/{name}/predictions",
            sim.endpoint(d, "replicate.create_model", "submit", create_for_model),
            methods=["POST"],
        ),
        Route(
            "/v1/deployments/{owner}/{name}/predictions",
            sim.endpoint(d, "replicate.create_deployment", "submit", create_for_deployment),
            methods=["POST"],
        ),
        Route("/v1/predictions/{prediction_id}", sim.endpoint(d, "replicate.get", "status", get), methods=["GET"]),
        Route(
            "/v1/predictions/{prediction_id}/cancel",
            sim.endpoint(d, "replicate.cancel", "cancel", cancel),
            methods=["POST"],
        ),
    ]
