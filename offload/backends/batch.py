"""What the provider batch clients share (openai_batch, anthropic_batch): the providers' limits, the shapes their
answers are reduced to, a pack's checks, and one request path whose failures go through the backend error tree.

A batch client turns a pack of jobs into one provider batch and the batch's results back into one result per
job. It is not a `Backend` (offload.backends.base): a batch holds many jobs and lives for hours, so whatever
packs jobs, polls batches and completes each job on its own drives these clients directly.

Errors: transport failures and non-2xx answers map as for every backend (offload.backends.http: 429 Throttled,
5xx/408/409 Transient, a 404 on a batch we created NotFound, other 4xx Fatal); a pack over the provider's limits
is refused before anything is sent (`PackTooLarge`, a Fatal: the packer must split it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson

from offload.backends.base import Fatal, Transient
from offload.backends.http import decode, error_for_exception, error_for_response, user_agent
from offload.backends.settings import BATCH_MAX_BYTES, BATCH_MAX_REQUESTS, DEFAULT_TIMEOUT
from offload.http_client import make_client


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """How much one batch may hold: requests, and bytes (OpenAI: the input file; Anthropic: the create body)."""

    max_requests: int
    max_bytes: int


# The providers' documented limits (their one home: offload.backends.settings, which reads no HTTP stack).
LIMITS: dict[str, BatchLimits] = {
    provider: BatchLimits(max_requests=BATCH_MAX_REQUESTS[provider], max_bytes=BATCH_MAX_BYTES[provider])
    for provider in BATCH_MAX_REQUESTS
}

BatchState = Literal["running", "cancelling", "ended"]
LineKind = Literal["succeeded", "errored", "canceled", "expired"]


class PackTooLarge(Fatal):
    """A pack over the provider's request-count or size limit (or a job id the provider cannot carry), refused
    before anything was sent: split it."""


@dataclass(frozen=True, slots=True)
class BatchStatus:
    """A batch as its provider reports it: `state` in offload's words (`ended` once no line will change),
    `provider_status` in the provider's, and its per-outcome counts (the provider's names)."""

    state: BatchState
    provider_status: str
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.state == "ended"


@dataclass(frozen=True, slots=True)
class LineResult:
    """One job's outcome in an ended batch. `succeeded`: `output` is the provider's answer (OpenAI: the
    chat.completion; Anthropic: the Message). `errored`: the request failed (`error` says why), and only its job
    fails. `canceled` / `expired`: the job never ran in this batch, so it may go out again."""

    kind: LineKind
    output: Any = None
    error: str | None = None
    status: int | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "succeeded"


@dataclass(frozen=True, slots=True)
class Listed:
    """A batch as the provider's listing shows it: what adopting a lost create compares (its tag, when the provider
    carries one; when it was created, epoch seconds; how many requests it holds)."""

    batch_id: str
    created: float
    total: int
    tag: str | None = None


LIST_PAGES = 20  # a listing for a lost create reads at most this many pages (newest first) before it gives up


def check_pack(provider: str, count: int, size: int) -> None:
    """Refuse an empty pack, or one over the provider's limits."""
    limits = LIMITS[provider]
    if count == 0:
        raise PackTooLarge(f"{provider} batch: an empty pack")
    if count > limits.max_requests:
        raise PackTooLarge(f"{provider} batch: {count} requests, the limit is {limits.max_requests}")
    if size > limits.max_bytes:
        raise PackTooLarge(f"{provider} batch: {size} bytes, the limit is {limits.max_bytes}")


def jsonl(rows: Iterable[Any]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def parse_jsonl(data: bytes, *, what: str) -> list[dict[str, Any]]:
    """A result file's lines; a line that is not a JSON object is a malformed answer (Transient: read again)."""
    rows: list[dict[str, Any]] = []
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise Transient(f"{what}: a result line is not valid JSON") from None
        if not isinstance(row, dict):
            raise Transient(f"{what}: a result line is not a JSON object")
        rows.append(row)
    return rows


class BatchClient:
    """One provider's batch API over one httpx client (made by `make_client`, or passed in and then not
    closed by `aclose`). Subclasses set the auth headers and speak the provider's paths."""

    provider: str = ""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._owns_client = client is None
        self._client = client or make_client("backend", timeout=timeout, headers={"User-Agent": user_agent()})

    def __repr__(self) -> str:  # never the key
        return f"{type(self).__name__}(base_url={self.base_url!r})"

    def _headers(self) -> dict[str, str]:
        raise NotImplementedError

    async def submit(self, pack: list[tuple[str, Any]]) -> str:
        """Start one batch of `pack` ((job id, request body) pairs); its id."""
        raise NotImplementedError

    async def status(self, batch_id: str) -> BatchStatus:
        raise NotImplementedError

    async def results(self, batch_id: str) -> dict[str, LineResult]:
        """Each job's result by job id, once the batch has ended (Transient before)."""
        raise NotImplementedError

    async def cancel(self, batch_id: str) -> BatchStatus:
        """Ask the provider to stop the batch (an ended one is no error); its status after."""
        raise NotImplementedError

    list_path: str = ""  # the listing's path, and the query parameter of its next page
    list_after: str = "after"

    async def listing(self, since: float) -> list[Listed]:
        """The account's batches created at or after `since` (epoch seconds), newest first. Raises Transient when
        the listing goes back further than LIST_PAGES pages (nothing can be proven absent then)."""
        out: list[Listed] = []
        after: str | None = None
        for _ in range(LIST_PAGES):
            params: dict[str, str | int] = {"limit": 100, **({self.list_after: after} if after else {})}
            page = await self._json("GET", self.list_path, params=params)
            rows = [r for r in page.get("data") or [] if isinstance(r, dict)]
            for row in rows:
                listed = self._listed(row)
                if listed.created < since:
                    return out
                out.append(listed)
            if not page.get("has_more") or not rows:
                return out
            after = str(rows[-1].get("id"))
        raise Transient(f"{self.provider} batch: the listing goes back more than {LIST_PAGES} pages")

    def _listed(self, row: dict[str, Any]) -> Listed:
        """One row of the provider's listing."""
        raise NotImplementedError

    async def _request(self, method: str, path_or_url: str, *, known: bool = False, **kwargs: Any) -> httpx.Response:
        """A 2xx response, or the mapped BackendError. `known`: the URL names a batch or file we created, so a 404
        means it is gone (NotFound) rather than a wrong URL (Fatal)."""
        url = path_or_url if "://" in path_or_url else self.base_url + path_or_url
        what = f"{self.provider} batch: {method} {httpx.URL(url).copy_with(query=None)}"
        try:
            headers = {**self._headers(), **kwargs.pop("headers", {})}
            response = await self._client.request(method, url, headers=headers, **kwargs)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise error_for_exception(exc, what=what, secrets=[self._api_key]) from None
        if not response.is_success:
            raise error_for_response(response, what=what, known=known, secrets=[self._api_key])
        return response

    async def _json(self, method: str, path: str, *, known: bool = False, **kwargs: Any) -> dict[str, Any]:
        response = await self._request(method, path, known=known, **kwargs)
        what = f"{self.provider} batch: {method} {path}"
        body = decode(response, what=what, secrets=[self._api_key])
        if not isinstance(body, dict):
            raise Transient(f"{what}: expected a JSON object", maybe_accepted=True)
        return body

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
