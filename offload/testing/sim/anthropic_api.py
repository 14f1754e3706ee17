"""Anthropic's Message Batches, `/v1/messages/batches` (point `Anthropic(base_url=sim)` at it).

A create carries the requests themselves (`[{custom_id, params}]`, params as for `POST /v1/messages`); each is
answered by one simulator job, whose output (the JSON text of `{"echo": ..., "files": [...]}`) becomes the text
of the result's message. `processing_status` goes `in_progress` (or `canceling`) to `ended`; the counts stay at
`processing` until then, and `results_url` appears, as Anthropic documents. Auth is the `x-api-key` header (or
`Authorization: Bearer`, which the anthropic SDK 2.x sends); a request without a dated `anthropic-version` is
refused, as the real API does; errors are Anthropic's `{"type": "error", "error": {type, message}}`. Limits:
`batches.anthropic_max_requests` (400) and `batches.anthropic_max_bytes` (413, `request_too_large`). Timelines,
partial failure and expiry come from the `batches` config block (batches.py).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from offload.testing.sim.batches import ENDED, Batch, Line, line_job, page, timeline
from offload.testing.sim.config import Behaviour, Op
from offload.testing.sim.engine import Call, Dialect, ErrorReply, Handler, Reply, Sim

VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}$")  # a dated API version; which dates exist is not simulated
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
LIST_LIMIT = 20


class AnthropicDialect(Dialect):
    family = "anthropic"
    required = ("id", "processing_status")

    def credential(self, request: Request) -> str | None:
        """`x-api-key` (the documented header, older SDKs), else `Authorization: Bearer` (what SDK 2.x sends)."""
        key = request.headers.get("x-api-key")
        return f"Bearer {key}" if key else request.headers.get("authorization")

    def error(self, status: int, message: str, *, code: str | None = None) -> Reply:
        kind = ERROR_TYPES.get(status, "api_error")
        return Reply({"type": "error", "error": {"type": kind, "message": message}}, status)

    def unauthorized(self) -> Reply:
        return self.error(401, "invalid x-api-key")

    def throttled(self, behaviour: Behaviour, headers: dict[str, str]) -> Reply:
        reply = self.error(429, "Number of requests has exceeded your rate limit (simulated).")
        reply.headers["anthropic-ratelimit-requests-limit"] = "50"
        reply.headers["anthropic-ratelimit-requests-remaining"] = "0"
        reply.headers.update(headers)
        return reply

    def unavailable(self) -> Reply:
        return self.error(529, "Overloaded")

    def precheck(self, request: Request) -> Reply | None:
        version = request.headers.get("anthropic-version")
        if version is None:
            return self.error(400, "anthropic-version: header is required")
        if not VERSION.match(version):
            return self.error(400, f"anthropic-version: invalid version {version!r}")
        return None


DIALECT = AnthropicDialect()


def _reject(status: int, message: str) -> ErrorReply:
    return ErrorReply(DIALECT.error(status, message))


def _params_problem(params: dict[str, Any]) -> str | None:
    """Why `POST /v1/messages` would refuse these params (the line then errors), or None."""
    if not isinstance(params.get("model"), str) or not params["model"]:
        return "model: Field required"
    tokens = params.get("max_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        return "max_tokens: must be an integer of at least 1"
    messages = params.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        return "messages: must be a non-empty list of objects with a 'role'"
    if params.get("stream"):
        return "stream: streaming is not supported in batches"
    return None


async def create(call: Call) -> Reply:
    config = call.sim.config.batches
    raw = await call.request.body()
    if len(raw) > config.anthropic_max_bytes:
        raise _reject(413, "Request exceeds the maximum allowed number of bytes.")
    body = await call.json_object()
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise _reject(400, "requests: must be a non-empty list")
    if len(requests) > config.anthropic_max_requests:
        raise _reject(400, f"requests: a batch may have at most {config.anthropic_max_requests} requests")
    rows = _checked(requests)
    start, done = timeline(call.now, len(rows), config, validating=False)
    batch = Batch(
        id="msgbatch_" + call.sim.token(24, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"),
        family="anthropic",
        created=call.now,
        lines=[_line(call, custom_id, params, start, at) for (custom_id, params), at in zip(rows, done, strict=True)],
        in_progress_at=start,
        run_end=max(done),
        expires_at=call.now + config.expire_after,
        finalize_seconds=config.finalize_seconds,
        cancel_seconds=config.cancel_seconds,
        cancel_at=None if config.cancel_after is None else call.now + config.cancel_after,
    )
    call.sim.batches.add(batch)
    return Reply(view(call, batch))


def _checked(requests: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """The requests as (custom_id, params); a malformed envelope refuses the whole create (400)."""
    rows: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for index, item in enumerate(requests):
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        params = item.get("params") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
            raise _reject(400, f"requests.{index}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$")
        if custom_id in seen:
            raise _reject(400, f"requests.{index}.custom_id: duplicate custom_id {custom_id!r}")
        if not isinstance(params, dict):
            raise _reject(400, f"requests.{index}.params: Field required")
        seen.add(custom_id)
        rows.append((custom_id, params))
    return rows


def _line(call: Call, custom_id: str, params: dict[str, Any], started: float, done_at: float) -> Line:
    problem = _params_problem(params)
    if problem is not None:
        return Line(custom_id, params, done_at, error={"type": "invalid_request_error", "message": problem})
    job = line_job(call, str(params["model"]), params, custom_id, started, done_at)
    return Line(custom_id, params, done_at, job=job)


def _batch(call: Call) -> Batch:
    batch_id = call.request.path_params["batch_id"]
    found = call.sim.batches.get(batch_id, "anthropic")
    if found is None:
        raise _reject(404, f"No message batch found with id '{batch_id}'")
    return found


async def get_batch(call: Call) -> Reply:
    return Reply(view(call, _batch(call)))


async def cancel(call: Call) -> Reply:
    """Anthropic answers a cancel of an ended batch with the batch as it is."""
    batch = _batch(call)
    if batch.cancel_asked(call.now) is None:
        for job in batch.cancel(call.now):
            call.sim.store.cancel(job, call.now)
        if batch.cancel_asked(call.now) is not None:
            call.sim.stats.cancelled("anthropic")
    return Reply(view(call, batch))


async def list_batches(call: Call) -> Reply:
    q = call.request.query_params
    try:
        limit = int(q.get("limit", LIST_LIMIT))
    except ValueError:
        raise _reject(400, "limit: must be an integer") from None
    if not 1 <= limit <= 1000:
        raise _reject(400, "limit: must be between 1 and 1000")
    items, more = page(call.sim.batches.newest_first("anthropic"), q.get("after_id"), q.get("before_id"), limit)
    data = [view(call, b) for b in items]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return Reply({"data": data, "has_more": more, "first_id": first, "last_id": last})


async def results(call: Call) -> Reply:
    batch = _batch(call)
    if batch.stage(call.now) not in ENDED:
        raise _reject(400, f"Message batch {batch.id} is still processing; its results are not available yet")
    end = batch.ended_at()
    rows = [orjson.dumps({"custom_id": ln.custom_id, "result": _result(call, batch, ln, end)}) for ln in batch.lines]
    return Reply(None, media_type="application/binary", raw=b"\n".join(rows) + b"\n")


def _result(call: Call, batch: Batch, line: Line, end: float) -> dict[str, Any]:
    state = batch.line_state(line, end)
    if state == "succeeded":
        assert line.job is not None
        return {"type": "succeeded", "message": _message(call, line)}
    if state == "errored":
        error = line.error or {"type": "api_error", "message": "Internal server error"}
        return {"type": "errored", "error": {"type": "error", "error": error}}
    return {"type": state}


def _message(call: Call, line: Line) -> dict[str, Any]:
    """The Message `POST /v1/messages` would have answered: the simulator's output as its text."""
    assert line.job is not None
    text = orjson.dumps(call.output(line.job)).decode()
    prompt = sum(max(1, len(str(m.get("content", ""))) // 4) + 4 for m in line.body["messages"])
    return {
        "id": "msg_" + line.job.id.replace("-", ""),
        "type": "message",
        "role": "assistant",
        "model": line.body["model"],
        "content": [{"type": "text", "text": text, "citations": None}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": prompt,
            "output_tokens": max(1, len(text) // 4),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "service_tier": "batch",
        },
    }


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def view(call: Call, batch: Batch) -> dict[str, Any]:
    """The MessageBatch as `GET /v1/messages/batches/{id}` shows it now."""
    now = call.now
    stage = batch.stage(now)
    ended = stage in ENDED
    processing = "ended" if ended else "canceling" if stage == "cancelling" else "in_progress"
    counts = batch.counts(now)
    shown = {k: counts[k] for k in ("succeeded", "errored", "canceled", "expired")} if ended else {}
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": processing,
        "request_counts": {
            "processing": 0 if ended else len(batch.lines),
            "succeeded": shown.get("succeeded", 0),
            "errored": shown.get("errored", 0),
            "canceled": shown.get("canceled", 0),
            "expired": shown.get("expired", 0),
        },
        "ended_at": _iso(batch.ended_at()) if ended else None,
        "created_at": _iso(batch.created),
        "expires_at": _iso(batch.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _iso(batch.cancel_asked(now)),
        "results_url": f"{call.base_url}/v1/messages/batches/{batch.id}/results" if ended else None,
    }


def _endpoint(sim: Sim, route: str, op: Op, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    return sim.endpoint(DIALECT, route, op, handler)


def routes(sim: Sim) -> list[Route]:
    base = "/v1/messages/batches"
    return [
        Route(base, _endpoint(sim, "anthropic.batches", "submit", create), methods=["POST"]),
        Route(base, _endpoint(sim, "anthropic.batches", "status", list_batches), methods=["GET"]),
        Route(base + "/{batch_id}", _endpoint(sim, "anthropic.batches", "status", get_batch), methods=["GET"]),
        Route(base + "/{batch_id}/cancel", _endpoint(sim, "anthropic.batches", "cancel", cancel), methods=["POST"]),
        Route(base + "/{batch_id}/results", _endpoint(sim, "anthropic.batches", "result", results), methods=["GET"]),
    ]
