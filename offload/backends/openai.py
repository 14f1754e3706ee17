"""`openai`: OpenAI chat completions, or any synchronous JSON POST (an OpenAI-compatible server, a model server).

Synchronous: `POST {base}{path}` with the job input as the body does all the work, so `submit` returns the result
at once (the full response is the output) and there is never anything to poll or cancel. `base_url` follows the
OpenAI SDK (`https://api.openai.com/v1`; the simulator's is `{sim}/v1`); `path` defaults to `/chat/completions`.
A `model` setting fills in inputs that lack one. With `price_per_million_input_tokens` /
`price_per_million_output_tokens` set, cost (USD) is computed from `usage`.

OpenAI reports a server-side failure as HTTP 5xx (Transient), not as a failed job, so this backend never returns
a `failed` result. A 429 with code `insufficient_quota` is Fatal, not Throttled: it means the account is out of
credit, and waiting will not fix that.

Remote id: the response's `id`, or a generated `offload-<uuid>` when a generic endpoint gives none. `poll` of an
id raises NotFound: a worker that crashed before storing a synchronous result must submit again.
Tagging: none (chat completions only keep metadata with `store: true`), so `find` returns None.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from offload.backends.base import Fatal, NotFound, RemoteResult, Submission, Throttled
from offload.backends.http import HttpBackend
from offload.backends.settings import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_RESPONSE_BYTES,
    OPENAI_BASE,
    OPENAI_PATH,
    OPENAI_TIMEOUT,
    OpenAISettings,
)

DEFAULT_BASE, DEFAULT_PATH, DEFAULT_TIMEOUT = OPENAI_BASE, OPENAI_PATH, OPENAI_TIMEOUT
PER = 1_000_000


class OpenAIBackend(HttpBackend):
    """A synchronous JSON API. Responses on the chat path must carry `choices`; other paths any JSON."""

    kind = "openai"
    synchronous = True

    def __init__(
        self,
        name: str,
        *,
        base_url: str = DEFAULT_BASE,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        path: str = DEFAULT_PATH,
        model: str | None = None,
        price_per_million_input_tokens: float | None = None,
        price_per_million_output_tokens: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            name,
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_connections=max_connections,
            max_response_bytes=max_response_bytes,
            client=client,
        )
        self._url = f"{self.base_url}/{path.lstrip('/')}"
        self._chat = path.rstrip("/").endswith("chat/completions")
        self._model = model
        self._prices = (price_per_million_input_tokens, price_per_million_output_tokens)

    @classmethod
    def from_settings(cls, name: str, s: OpenAISettings, client: httpx.AsyncClient | None) -> OpenAIBackend:
        return cls(
            name,
            **s.http(),
            path=s.path,
            model=s.model,
            price_per_million_input_tokens=s.price_per_million_input_tokens,
            price_per_million_output_tokens=s.price_per_million_output_tokens,
            client=client,
        )

    def cost(self, usage: Any) -> float | None:
        """USD from token counts; None when prices are not configured or usage is missing."""
        price_in, price_out = self._prices
        if not isinstance(usage, dict) or (price_in is None and price_out is None):
            return None
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None
        return (prompt * (price_in or 0.0) + completion * (price_out or 0.0)) / PER

    async def submit(self, job_input: Any, *, tag: str, idempotency_key: str | None = None) -> Submission:
        if not isinstance(job_input, dict):
            raise Fatal(
                f"openai backend {self.name!r}: the job input must be a JSON object (the request body), "
                f"got {type(job_input).__name__}"
            )
        body = dict(job_input)
        if self._model and "model" not in body:
            body["model"] = self._model
        started = time.monotonic()
        try:
            answer = await self._call("POST", self._url, json=body, has_body=True, idempotency_key=idempotency_key)
        except Throttled as exc:
            if "insufficient_quota" in exc.excerpt:
                raise Fatal(f"{exc} (the account is out of quota)", status=exc.status, excerpt=exc.excerpt) from None
            raise
        if self._chat:
            self._require(answer, "choices", list, "submit")
        elapsed = time.monotonic() - started
        remote_id = answer.get("id") if isinstance(answer, dict) else None
        if not isinstance(remote_id, str) or not remote_id:
            remote_id = f"offload-{uuid.uuid4().hex}"
        usage = answer.get("usage") if isinstance(answer, dict) else None
        metrics: dict[str, Any] = {"latency_s": round(elapsed, 6)}
        if isinstance(usage, dict):
            metrics["usage"] = usage
        result = RemoteResult("succeeded", output=answer, cost=self.cost(usage), metrics=metrics)
        return Submission(remote_id, result=result)

    async def poll(self, remote_id: str) -> RemoteResult:
        raise NotFound(
            f"openai backend {self.name!r}: {remote_id} was a synchronous call; its result is only "
            "returned by submit, so it must be submitted again"
        )

    async def cancel(self, remote_id: str) -> bool:
        """Nothing runs remotely after submit returns."""
        return True
