"""OpenAI's Batch API and the Files API it reads and writes (point `OpenAI(base_url=f"{sim}/v1")` at it).

`POST /v1/files` takes a JSONL file (multipart, purpose `batch`) of `{custom_id, method, url, body}` lines;
`POST /v1/batches` runs one against `/v1/chat/completions`. Each line is answered as the chat-completions route
would answer its body (openai_api.check_chat, completion); once the batch ends, the answered lines are written
to its output file and the failed, expired or cancelled ones to its error file, in OpenAI's line format. A file
that breaks the rules (bad JSON, a missing or repeated custom_id, another URL, more lines than
`batches.openai_max_requests`) fails the batch with `errors`, as OpenAI's validation does. Timelines, partial
failure and expiry come from the `batches` config block (batches.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from offload.testing.sim.batches import ENDED, Batch, Line, StoredFile, line_job, page, timeline
from offload.testing.sim.config import Op
from offload.testing.sim.engine import Call, ErrorReply, Handler, Reply, Sim
from offload.testing.sim.openai_api import DIALECT, check_chat, completion, server_error

ENDPOINT = "/v1/chat/completions"  # the one batch endpoint the simulator answers
ENDPOINTS = frozenset(  # what OpenAI's batch create accepts (openai.types.batch_create_params)
    {ENDPOINT, "/v1/responses", "/v1/embeddings", "/v1/completions", "/v1/moderations", "/v1/images/generations"}
)
PURPOSES = frozenset({"assistants", "batch", "fine-tune", "vision", "user_data", "evals"})
EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window ended."}
CANCELLED = {"code": "batch_cancelled", "message": "This request was not executed because the batch was cancelled."}
LIST_LIMIT = 20


def _reject(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorReply:
    return ErrorReply(DIALECT.error(status, message, param=param, code=code))


async def upload(call: Call) -> Reply:
    form = await call.request.form()
    purpose, upload_ = form.get("purpose"), form.get("file")
    if not isinstance(purpose, str) or purpose not in PURPOSES:
        raise _reject(400, f"'{purpose}' is not a valid purpose", "purpose")
    if not isinstance(upload_, UploadFile):
        raise _reject(400, "'file' is a required property", "file")
    data = await upload_.read()
    limit = call.sim.config.batches.openai_max_file_bytes
    if purpose == "batch" and len(data) > limit:
        raise _reject(400, f"File is too large: {len(data)} bytes, the limit for batch files is {limit}.", "file")
    stored = StoredFile("file-" + call.sim.token(24), purpose, upload_.filename or "upload", data, call.now)
    call.sim.batches.files[stored.id] = stored
    return Reply(stored.view())


def _file(call: Call) -> StoredFile:
    file_id = call.request.path_params["file_id"]
    found = call.sim.batches.files.get(file_id)
    if found is None:
        raise _reject(404, f"No such File object: {file_id}", "id")
    return found


async def get_file(call: Call) -> Reply:
    return Reply(_file(call).view())


async def file_content(call: Call) -> Reply:
    return Reply(None, media_type="application/octet-stream", raw=_file(call).data)


def _parse(data: bytes, limit: int) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """The file's lines as (custom_id, body), and the validation errors that fail the batch (OpenAI's
    `errors.data` entries: code, message, param, line)."""
    rows: list[tuple[str, dict[str, Any]]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = _line_problem(raw, seen)
        if isinstance(problem, dict):
            errors.append({**problem, "line": number})
        else:
            rows.append(problem)
    if not rows and not errors:
        errors.append({"code": "empty_file", "message": "The batch input file is empty.", "param": None, "line": None})
    if len(rows) > limit:
        message = f"The batch input file has {len(rows)} requests; a batch may have at most {limit}."
        errors.append({"code": "too_many_requests", "message": message, "param": None, "line": None})
    return rows, errors


def _line_problem(raw: bytes, seen: set[str]) -> tuple[str, dict[str, Any]] | dict[str, Any]:
    """One line as (custom_id, body), or the error it fails validation with."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"code": "invalid_json_line", "message": "This line is not parseable as valid JSON.", "param": None}
    if not isinstance(line, dict):
        return {"code": "invalid_json_line", "message": "Each line must be a JSON object.", "param": None}
    custom_id, body = line.get("custom_id"), line.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return {"code": "missing_required_parameter", "message": "Missing custom_id.", "param": "custom_id"}
    if custom_id in seen:
        message = f"The custom_id {custom_id!r} is used by more than one request."
        return {"code": "duplicate_custom_id", "message": message, "param": "custom_id"}
    seen.add(custom_id)
    if line.get("method") != "POST":
        return {"code": "invalid_method", "message": "The method must be POST.", "param": "method"}
    if line.get("url") != ENDPOINT:
        message = f"The url must match the batch's endpoint, {ENDPOINT}."
        return {"code": "mismatched_endpoint", "message": message, "param": "url"}
    if not isinstance(body, dict):
        return {"code": "missing_required_parameter", "message": "Missing body.", "param": "body"}
    return custom_id, body


async def create(call: Call) -> Reply:
    body = await call.json_object()
    if body.get("completion_window") != "24h":
        raise _reject(400, "completion_window must be '24h'", "completion_window")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise _reject(400, f"Invalid endpoint {endpoint!r}", "endpoint")
    if endpoint != ENDPOINT:
        raise _reject(400, f"The simulator answers batches of {ENDPOINT} only", "endpoint")
    file_id = body.get("input_file_id")
    source = call.sim.batches.files.get(file_id) if isinstance(file_id, str) else None
    if source is None:
        raise _reject(404, f"No such File object: {file_id}", "input_file_id")
    if source.purpose != "batch":
        raise _reject(400, f"File {file_id} was not uploaded with purpose 'batch'", "input_file_id")
    config = call.sim.config.batches
    rows, errors = _parse(source.data, config.openai_max_requests)
    start, done = timeline(call.now, len(rows), config, validating=True)
    pairs = [] if errors else zip(rows, done, strict=True)
    lines = [_line(call, custom_id, line, start, at) for (custom_id, line), at in pairs]
    batch = Batch(
        id="batch_" + call.sim.token(24),
        family="openai",
        created=call.now,
        lines=lines,
        in_progress_at=start,
        run_end=max(done, default=start),
        expires_at=call.now + config.expire_after,
        finalize_seconds=config.finalize_seconds,
        cancel_seconds=config.cancel_seconds,
        cancel_at=None if config.cancel_after is None else call.now + config.cancel_after,
        meta={"endpoint": endpoint, "input_file_id": file_id, "metadata": body.get("metadata")},
        errors=errors or None,
    )
    call.sim.batches.add(batch)
    return Reply(view(call, batch))


def _line(call: Call, custom_id: str, body: dict[str, Any], started: float, done_at: float) -> Line:
    """A line answered by a job, or (a body the endpoint would refuse) by that 400."""
    try:
        check_chat(body)
    except ErrorReply as refused:
        return Line(custom_id, body, done_at, error={"status_code": refused.reply.status, "body": refused.reply.body})
    return Line(custom_id, body, done_at, job=line_job(call, str(body["model"]), body, custom_id, started, done_at))


def _batch(call: Call) -> Batch:
    batch_id = call.request.path_params["batch_id"]
    found = call.sim.batches.get(batch_id, "openai")
    if found is None:
        raise _reject(404, f"No batch found with id '{batch_id}'.", "batch_id", "batch_not_found")
    return found


async def get_batch(call: Call) -> Reply:
    return Reply(view(call, _batch(call)))


async def cancel(call: Call) -> Reply:
    batch = _batch(call)
    ended = batch.stage(call.now) in ENDED  # a batch still cancelling answers a second cancel as the first
    if ended or (batch.cancel_asked(call.now) is None and not _cancel(call, batch)):
        status = batch.stage(call.now)
        raise _reject(409, f"Cannot cancel a batch with status '{status}'.", None, "batch_not_cancellable")
    return Reply(view(call, batch))


def _cancel(call: Call, batch: Batch) -> bool:
    """Cancel the batch and the jobs of its unfinished lines; False when it could not be cancelled."""
    stopped = batch.cancel(call.now)
    for job in stopped:
        call.sim.store.cancel(job, call.now)
    if batch.cancel_asked(call.now) is None:
        return False
    call.sim.stats.cancelled(batch.family)
    return True


async def list_batches(call: Call) -> Reply:
    q = call.request.query_params
    try:
        limit = int(q.get("limit", LIST_LIMIT))
    except ValueError:
        raise _reject(400, "limit must be an integer", "limit") from None
    if not 1 <= limit <= 100:
        raise _reject(400, "limit must be between 1 and 100", "limit")
    items, more = page(call.sim.batches.newest_first("openai"), q.get("after"), None, limit)
    data = [view(call, b) for b in items]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return Reply({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})


def _at(t: float | None) -> int | None:
    return None if t is None else int(t)


def view(call: Call, batch: Batch) -> dict[str, Any]:
    """The batch object as `GET /v1/batches/{id}` shows it now."""
    now = call.now
    stage, counts = batch.stage(now), batch.counts(now)
    ended = stage in ENDED
    outputs = _outputs(call, batch) if ended and stage != "failed" else {}
    running = now >= batch.in_progress_at and batch.errors is None
    stop = batch.stop_at()
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.meta["endpoint"],
        "errors": None if batch.errors is None else {"object": "list", "data": batch.errors},
        "input_file_id": batch.meta["input_file_id"],
        "completion_window": "24h",
        "status": stage,
        "output_file_id": outputs.get("output"),
        "error_file_id": outputs.get("error"),
        "created_at": int(batch.created),
        "in_progress_at": _at(batch.in_progress_at) if running else None,
        "expires_at": int(batch.expires_at),
        "finalizing_at": _at(batch.run_end) if stop is None and now >= batch.run_end and running else None,
        "completed_at": _at(batch.ended_at()) if stage == "completed" else None,
        "failed_at": _at(batch.ended_at()) if stage == "failed" else None,
        "expired_at": _at(batch.ended_at()) if stage == "expired" else None,
        "cancelling_at": _at(batch.cancel_asked(now)) if batch.cancelled() else None,
        "cancelled_at": _at(batch.ended_at()) if stage == "cancelled" else None,
        "request_counts": {
            "total": len(batch.lines),
            "completed": counts["succeeded"],
            "failed": counts["errored"] + counts["expired"] + counts["canceled"],
        },
        "metadata": batch.meta["metadata"],
        "model": None,
        "usage": None,
    }


def _outputs(call: Call, batch: Batch) -> dict[str, str | None]:
    """The output and error files of an ended batch, written once (None for an empty one)."""
    if batch.outputs:
        return batch.outputs
    out: list[bytes] = []
    errors: list[bytes] = []
    end = batch.ended_at()
    for line in batch.lines:
        state = batch.line_state(line, end)
        row: dict[str, Any] = {"id": "batch_req_" + call.sim.token(24), "custom_id": line.custom_id}
        row["response"] = row["error"] = None
        if state == "succeeded":
            assert line.job is not None
            row["response"] = _response(call, 200, completion(call, line.job, line.body))
        elif state == "errored":
            failed = line.error or {"status_code": 500, "body": server_error().body}
            row["response"] = _response(call, failed["status_code"], failed["body"])
        else:
            row["error"] = EXPIRED if state == "expired" else CANCELLED
        (out if state == "succeeded" else errors).append(orjson.dumps(row))
    for kind, rows in (("output", out), ("error", errors)):
        batch.outputs[kind] = _store(call, batch, kind, rows, end) if rows else None
    return batch.outputs


def _response(call: Call, status: int, body: Any) -> dict[str, Any]:
    return {"status_code": status, "request_id": "req_" + call.sim.token(24), "body": body}


def _store(call: Call, batch: Batch, kind: str, rows: list[bytes], at: float) -> str:
    stored = StoredFile(
        "file-" + call.sim.token(24), "batch_output", f"{batch.id}_{kind}.jsonl", b"\n".join(rows) + b"\n", at
    )
    call.sim.batches.files[stored.id] = stored
    return stored.id


def _endpoint(sim: Sim, route: str, op: Op, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    return sim.endpoint(DIALECT, route, op, handler)


def routes(sim: Sim) -> list[Route]:
    return [
        Route("/v1/files", _endpoint(sim, "openai.files", "submit", upload), methods=["POST"]),
        Route("/v1/files/{file_id}", _endpoint(sim, "openai.files", "status", get_file), methods=["GET"]),
        Route("/v1/files/{file_id}/content", _endpoint(sim, "openai.files", "result", file_content), methods=["GET"]),
        Route("/v1/batches", _endpoint(sim, "openai.batches", "submit", create), methods=["POST"]),
        Route("/v1/batches", _endpoint(sim, "openai.batches", "status", list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", _endpoint(sim, "openai.batches", "status", get_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", _endpoint(sim, "openai.batches", "cancel", cancel), methods=["POST"]),
    ]
