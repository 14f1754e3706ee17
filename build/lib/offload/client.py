"""Producer clients: `AsyncClient` for asyncio code and `Client` for everything else, over one core.

`Client` runs an `AsyncClient` on a private event loop in a background thread, so it works the same
from scripts, threads and inside frameworks that already run an event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from offload.connection import connect
from offload.models import Job, QueueStats
from offload.queue.store import JobSpec, QueueStore

T = TypeVar("T")


def _spec(item: Any) -> JobSpec:
    if isinstance(item, JobSpec):
        return item
    if isinstance(item, Mapping) and "input" in item:
        return JobSpec(**item)
    return JobSpec(input=item)


class AsyncClient:
    """Enqueue jobs and follow them. Connects lazily on first use; use `async with` or `aclose()`."""

    def __init__(self, url: str | None = None, *, max_payload: int | None = None) -> None:
        self._url = url
        self._max_payload = max_payload
        self._store: QueueStore | None = None
        self._lock = asyncio.Lock()

    async def store(self) -> QueueStore:
        """The underlying job store (connecting on first call)."""
        if self._store is None:
            async with self._lock:
                if self._store is None:
                    self._store = QueueStore(await connect(self._url), max_payload=self._max_payload)
        return self._store

    async def enqueue(
        self,
        queue: str,
        input: Any,
        *,
        priority: int = 0,
        delay: float | None = None,
        run_at: float | None = None,
        max_attempts: int = 3,
        output_key: str | None = None,
        retention: int = 7 * 86_400,
        idempotency_key: str | None = None,
    ) -> str:
        """Enqueue one job and return its id (the existing id when `idempotency_key` was seen before)."""
        spec = JobSpec(
            input=input,
            priority=priority,
            delay=delay,
            run_at=run_at,
            max_attempts=max_attempts,
            output_key=output_key,
            retention=retention,
            idempotency_key=idempotency_key,
        )
        return await (await self.store()).enqueue(queue, spec)

    async def enqueue_many(self, queue: str, items: Iterable[Any]) -> list[str]:
        """Enqueue many jobs in pipelined batches. Each item is a JobSpec, a dict with an "input" key and
        JobSpec options, or a bare input."""
        return await (await self.store()).enqueue_many(queue, [_spec(i) for i in items])

    async def get(self, job_id: str) -> Job:
        return await (await self.store()).get(job_id)

    async def wait(self, job_id: str, timeout: float = 60.0, poll: float = 0.05) -> Job:
        """Wait until the job reaches a terminal state; raises TimeoutError with its last state."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        interval = poll
        while True:
            job = await self.get(job_id)
            if job.state.terminal:
                return job
            if loop.time() >= deadline:
                raise TimeoutError(f"job {job_id} still {job.state.value} after {timeout:g}s")
            await asyncio.sleep(min(interval, max(deadline - loop.time(), 0)))
            interval = min(interval * 1.5, 1.0)

    async def cancel(self, job_id: str) -> str:
        return await (await self.store()).cancel(job_id)

    async def stats(self, queue: str) -> QueueStats:
        return await (await self.store()).stats(queue)

    async def aclose(self) -> None:
        if self._store is not None:
            await self._store.redis.aclose()
            self._store = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client:
    """The blocking face of `AsyncClient`; same methods, same arguments."""

    def __init__(self, url: str | None = None, *, max_payload: int | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="offload-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(url, max_payload=max_payload)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def enqueue(self, queue: str, input: Any, **options: Any) -> str:
        return self._call(self._async.enqueue(queue, input, **options))

    def enqueue_many(self, queue: str, items: Sequence[Any]) -> list[str]:
        return self._call(self._async.enqueue_many(queue, items))

    def get(self, job_id: str) -> Job:
        return self._call(self._async.get(job_id))

    def wait(self, job_id: str, timeout: float = 60.0) -> Job:
        return self._call(self._async.wait(job_id, timeout))

    def cancel(self, job_id: str) -> str:
        return self._call(self._async.cancel(job_id))

    def stats(self, queue: str) -> QueueStats:
        return self._call(self._async.stats(queue))

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._async.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
