"""OpenAI chat completions, `POST /v1/chat/completions` (point `OpenAI(base_url=f"{sim}/v1")` at it).

Synchronous, as the real endpoint is: the request is held for the job's simulated queue delay plus running time,
then answered with a `chat.completion` whose message content is the JSON text of the usual simulator output
(`{"echo": <request body>, "files": [...]}`), so tests can parse it back. Errors use OpenAI's
`{"error": {message, type, param, code}}`; a 429 carries `retry-after`/`retry-after-ms` only when Retry-After is
enabled, because the SDK honours either. Each completion is recorded as a job, so stats and `/_sim/jobs` see it.
Streaming is not simulated (400).
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

import orjson
from starlette.routing import Route

from offload.testing.sim.config import Behaviour
from offload.testing.sim.engine import Call, Dialect, ErrorReply, Reply, Sim
from offload.testing.sim.store import Job

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    429: "requests",
    500: "server_error",
    503: "server_error",
}


class OpenAIDialect(Dialect):
    family = "openai"
    required = ("choices", "id")

    def error(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> Reply:
        body = {
            "error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param, "code": code}
        }
        return Reply(body, status)

    def unauthorized(self) -> Reply:
        return self.error(
            401,
            "Incorrect API key provided. You can find your API key in your account settings.",
            code="invalid_api_key",
        )

    def throttled(self, behaviour: Behaviour, headers: dict[str, str]) -> Reply:
        reply = self.error(
            429, "Rate limit reached for requests (simulated). Please try again later.", code="rate_limit_exceeded"
        )
        reply.headers.update(
            {
                "x-ratelimit-limit-requests": "60",
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": f"{behaviour.retry_after_seconds:g}s",
            }
        )
        if headers:
            reply.headers.update(headers)
            reply.headers["retry-after-ms"] = str(round(behaviour.retry_after_seconds * 1000))
        return reply

    def unavailable(self) -> Reply:
        return self.error(503, "The server is overloaded or not ready yet.", code=None)


def _tokens(text: str) -> int:
    """~4 characters a token: close enough for usage accounting and cost estimates."""
    return max(1, len(text) // 4)


DIALECT = OpenAIDialect()


def _invalid(message: str, param: str) -> NoReturn:
    raise ErrorReply(DIALECT.error(400, message, param=param))


def check_chat(body: dict[str, Any]) -> None:
    """Refuse a chat-completions body the real endpoint would refuse (raises `ErrorReply`, a 400); the Batch
    API applies the same checks to each line."""
    model = body.get("model")
    messages = body.get("messages")
    if not isinstance(model, str) or not model:
        _invalid("you must provide a model parameter", "model")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        _invalid("'messages' must be a non-empty array of objects with a 'role'", "messages")
    if body.get("stream"):
        _invalid("streaming is not supported by the simulator", "stream")
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 8:
        _invalid("n must be an integer between 1 and 8", "n")


def server_error() -> Reply:
    return DIALECT.error(500, "The server had an error while processing your request. Sorry about that!")


async def chat_completions(call: Call) -> Reply:
    body = await call.json_object()
    check_chat(body)
    meta: dict[str, Any] = {k: body[k] for k in ("metadata", "user", "store") if k in body}
    job = call.submit(str(body["model"]), body, job_id="chatcmpl-" + call.sim.token(29), meta=meta)
    await asyncio.sleep(max(0.0, job.finished - call.now))
    call.now = call.sim.clock()
    if job.outcome != "succeeded":
        return server_error()
    return Reply(
        completion(call, job, body),
        headers={
            "x-request-id": "req_" + call.sim.token(24),
            "openai-processing-ms": str(round((job.finished - job.created) * 1000)),
        },
    )


def completion(call: Call, job: Job, body: dict[str, Any]) -> dict[str, Any]:
    """The `chat.completion` a succeeded job answers `body` (checked by `check_chat`) with."""
    content = orjson.dumps(call.output(job)).decode()
    turns: list[dict[str, Any]] = body["messages"]
    n = body.get("n", 1)
    prompt = sum(_tokens(str(m.get("content", ""))) + 4 for m in turns)
    completed = _tokens(content) * n
    choices: list[dict[str, Any]] = [
        {
            "index": i,
            "message": {"role": "assistant", "content": content, "refusal": None, "annotations": []},
            "finish_reason": "stop",
            "logprobs": None,
        }
        for i in range(n)
    ]
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": int(job.created),
        "model": body["model"],
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completed,
            "total_tokens": prompt + completed,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "system_fingerprint": "fp_offload_sim",
        "service_tier": body.get("service_tier") or "default",
    }


def routes(sim: Sim) -> list[Route]:
    return [
        Route(
            "/v1/chat/completions", sim.endpoint(DIALECT, "openai.chat", "submit", chat_completions), methods=["POST"]
        )
    ]
