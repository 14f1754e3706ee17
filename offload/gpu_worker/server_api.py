"""The HTTP side of a GPU worker: the server's worker protocol, with retries that ride out a server restart.

Only the server URL and a worker key are needed: no Redis URL, no storage credentials. Writes that matter
(complete, fail) are retried until the server answers, because each is idempotent on the server (a repeated complete
answers OK; a repeated fail of a job already moved on is a 409 that we treat as done).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import httpx

from offload.backoff import Backoff
from offload.errors import StaleLease, WorkerError
from offload.http_client import make_client

log = logging.getLogger("offload.gpu_worker")
RETRY_STATUSES = {429, 502, 503, 504}  # 429: the key is at one of the server's caps for a moment (Retry-After)


class ServerUnavailable(WorkerError, ConnectionError):
    """The server did not answer (or answered 502/503/504) for the whole retry period."""


class Unregistered(WorkerError):
    """The server does not know this worker id (it expired): register again."""


class ServerRejected(WorkerError):
    """A 4xx the worker cannot fix by retrying (bad key, wrong queue, invalid output)."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


def _retry_after(response: httpx.Response) -> float:
    """The server's Retry-After in seconds (at most 30), else 0."""
    value = response.headers.get("retry-after", "")
    return min(float(value), 30.0) if value.isdigit() else 0.0


class ServerApi:
    def __init__(
        self, base_url: str, token: str, *, timeout: float = 30.0, client: httpx.AsyncClient | None = None
    ) -> None:
        self.base = base_url.rstrip("/")
        self.http = client or make_client("server_api", timeout=timeout)
        self._headers = {"Authorization": f"Bearer {token}"}

    async def call(
        self, path: str, body: dict[str, Any], *, retry_for: float = 0.0, timeout: float | None = None
    ) -> Any:
        """POST and decode. Connection errors and 429/502/503/504 are retried with backoff (at least the server's
        Retry-After) for `retry_for` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry_for
        waits = Backoff(0.2, 5.0)
        while True:
            delay = waits.next()
            try:
                response = await self.http.post(
                    self.base + path,
                    json=body,
                    headers=self._headers,
                    timeout=timeout if timeout is not None else self.http.timeout,
                )
                if response.status_code not in RETRY_STATUSES:
                    return self._decode(response)
                problem = f"HTTP {response.status_code}"
                pause = max(delay, _retry_after(response))
            except httpx.TransportError as exc:
                problem = type(exc).__name__
                pause = delay
            if loop.time() + pause > deadline:
                raise ServerUnavailable(f"{self.base}{path}: server unavailable ({problem})")
            log.debug("%s: %s, retrying in %.1fs", path, problem, pause)
            await asyncio.sleep(pause)

    @staticmethod
    def _decode(response: httpx.Response) -> Any:
        if response.status_code == 204:
            return None
        try:
            data = response.json()
        except ValueError:
            data = {"detail": response.text[:200]}
        if response.is_success:
            return data
        detail = data.get("detail") if isinstance(data, dict) else data
        if response.status_code == 409:
            raise StaleLease(str(detail))  # 409: another worker owns the job now, or it finished
        if response.status_code == 404 and "worker" in str(detail):
            raise Unregistered(str(detail))
        raise ServerRejected(response.status_code, detail)

    async def register(self, info: dict[str, Any], retry_for: float) -> dict[str, Any]:
        reply: dict[str, Any] = await self.call("/v1/workers/register", info, retry_for=retry_for)
        return reply

    async def claim(self, worker_id: str, queue: str, n: int, wait: float) -> list[dict[str, Any]]:
        reply = await self.call(
            f"/v1/workers/{worker_id}/claim", {"queue": queue, "max": n, "wait": wait}, timeout=wait + 30
        )
        jobs: list[dict[str, Any]] = reply["jobs"]
        return jobs

    async def heartbeat(
        self,
        worker_id: str,
        jobs: list[str],
        protected: bool | None,
        instance_id: str | None,
        tokens: list[str] | None = None,
    ) -> dict[str, list[str]]:
        body: dict[str, Any] = {"jobs": jobs, "protected": protected}
        if tokens is not None:
            body["tokens"] = tokens
        if instance_id is not None:
            body["instance_id"] = instance_id
        reply: dict[str, list[str]] = await self.call(f"/v1/workers/{worker_id}/heartbeat", body)
        return reply

    # A verdict is sent until the server takes it or refuses it (409: the lease moved on), however long the
    # server or its job store is away: giving up would throw away the GPU work and run the job again.

    async def complete(self, worker_id: str, job_id: str, token: str, output: Any) -> None:
        await self.call(
            f"/v1/workers/{worker_id}/jobs/{job_id}/complete", {"token": token, "output": output}, retry_for=math.inf
        )

    async def fail(self, worker_id: str, job_id: str, token: str, error: str, retryable: bool) -> str:
        reply = await self.call(
            f"/v1/workers/{worker_id}/jobs/{job_id}/fail",
            {"token": token, "error": error[:4000], "retryable": retryable},
            retry_for=math.inf,
        )
        return str(reply["state"])

    async def cancelled(self, worker_id: str, job_id: str, token: str) -> None:
        await self.call(f"/v1/workers/{worker_id}/jobs/{job_id}/cancelled", {"token": token}, retry_for=math.inf)

    async def deregister(self, worker_id: str) -> None:
        await self.call(f"/v1/workers/{worker_id}/deregister", {"release": True}, retry_for=10)

    async def aclose(self) -> None:
        await self.http.aclose()
