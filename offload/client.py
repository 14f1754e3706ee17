"""Producer clients: `AsyncClient` for asyncio code and `Client` for everything else, over one core.

`Client` runs an `AsyncClient` on a private event loop in a background thread, so it works the same
from scripts, threads and inside frameworks that already run an event loop.

`offload.File(...)` values anywhere in an input are uploaded to the job's storage first (`offload.storage.inputs`)
and replaced by references; the job gets its id before the upload, so its files live under its own key. A failed
upload enqueues nothing; a failed enqueue (or one that found an earlier job with the same idempotency key) deletes
the files it uploaded. The storage is the `storage:` block of offload.yaml unless one is passed.

The store is found as every `offload` command finds it (`offload.config.store_url`): the URL given, else
OFFLOAD_REDIS_URL, else REDIS_URL, else offload.yaml's redis_url (`config`, else OFFLOAD_CONFIG, else
./offload.yaml, else the local stack's), else the embedded default. One that does not answer is retried for a few
seconds (OFFLOAD_REDIS_CONNECT_TIMEOUT), then `ConnectionFailed` names it, its password masked.

`result(id)` reads a succeeded job's output from storage and returns it (its files stay references, `{"$file":
key, ...}`); `download(id, directory)` saves the output and every file of the job it refers to.

`durability` (or OFFLOAD_DURABILITY_REPLICAS / _TIMEOUT_MS / _FSYNC) makes an enqueue return only once replicas
have the job (offload/queue/durability.py); one that they did not confirm in time raises `NotReplicated`, and is
sent again with the same idempotency key. Its uploaded files are kept then: the job may exist.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from offload.connection import CALLER_RETRY_S, at_start, connect, connect_timeout
from offload.env import process_env
from offload.errors import StoreError
from offload.files import DEFAULT_MAX_FILE_BYTES, files_in
from offload.models import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETENTION_S, Attempt, Job, QueueStats
from offload.queue import durability as durable
from offload.queue.durability import Durability, NotReplicated
from offload.queue.history import HistoryPoint
from offload.queue.keyspace import QUEUES_KEY, new_job_id
from offload.queue.memory import require_noeviction
from offload.queue.specs import JobSpec, deadline_options
from offload.queue.store import QueueStore

if TYPE_CHECKING:  # storage (boto3) loads on the first File, not with `import offload`
    from offload.storage import Storage
    from offload.storage.results import Downloaded


T = TypeVar("T")


class NoResult(StoreError):
    """A result was asked of a job that has none: it failed, went dead, was cancelled, or has not finished.
    `job` is the job as it was read, so a caller can tell which (and read its error)."""

    def __init__(self, message: str, job: Job) -> None:
        super().__init__(message)
        self.job = job


def _durability(given: Durability | Mapping[str, Any] | None) -> Durability | None:
    """The `durability` argument, else the environment's, checked now (a bad value names the field)."""
    if isinstance(given, Durability):
        return given
    fields = dict(given) if given is not None else durable.from_env(process_env())
    if not fields:
        return None
    from offload.schema import parse  # pydantic: loaded only by a producer that asks for durability

    return parse(Durability, fields, "durability")


def _spec(item: Any) -> JobSpec:
    if isinstance(item, JobSpec):
        return item
    if isinstance(item, Mapping) and "input" in item:
        return JobSpec(**item)
    return JobSpec(input=item)


class AsyncClient:
    """Enqueue jobs and follow them. Connects lazily on first use; use `async with` or `aclose()`."""

    def __init__(
        self,
        url: str | None = None,
        *,
        max_payload: int | None = None,
        storage: Storage | Mapping[str, Any] | None = None,
        max_file_bytes: int | None = None,
        durability: Durability | Mapping[str, Any] | None = None,
        config: str | os.PathLike[str] | None = None,
    ) -> None:
        self._url = url
        self._config = config
        self._durability = _durability(durability)
        self._max_payload = max_payload
        self._store: QueueStore | None = None
        self._lock = asyncio.Lock()
        self._storage_arg = storage
        self._storage: Storage | None = None if storage is None or isinstance(storage, Mapping) else storage
        self._owns_storage = False
        self._max_file_bytes = max_file_bytes

    async def store(self) -> QueueStore:
        """The underlying job store (connecting on first call). A store that may evict (its maxmemory-policy is
        not noeviction) is refused with `UnsafeEvictionPolicy`: a job acknowledged there can vanish."""
        if self._store is None:
            async with self._lock:
                if self._store is None:
                    from offload.config import store_url  # the settings models load only when they are needed

                    redis = await connect(store_url(self._url, self._config), retry_for=connect_timeout(CALLER_RETRY_S))
                    try:
                        await at_start(lambda: require_noeviction(redis))
                    except BaseException:
                        await redis.aclose()
                        raise
                    self._store = QueueStore(redis, max_payload=self._max_payload, durability=self._durability)
        return self._store

    async def _files_storage(self) -> tuple[Storage, int]:
        """The storage for input files: the one given, else offload.yaml's (built on first need)."""
        from offload.storage import create_storage

        if self._storage is None:
            from offload.storage.settings import LocalStorageSettings, S3StorageSettings, StorageSettings

            block: LocalStorageSettings | S3StorageSettings
            if isinstance(self._storage_arg, Mapping):
                from offload.schema import parse

                block = parse(StorageSettings, dict(self._storage_arg), "storage")
            else:
                from offload.config import load_settings

                block = load_settings(self._config).storage
            self._storage = create_storage(block)
            self._owns_storage = True
            if self._max_file_bytes is None:
                self._max_file_bytes = block.max_input_file_bytes
        return self._storage, self._max_file_bytes or DEFAULT_MAX_FILE_BYTES

    async def _upload(self, queue: str, spec: JobSpec) -> tuple[JobSpec, list[str]]:
        """The spec with its files uploaded and replaced by references (its id fixed first), and their keys."""
        if not files_in(spec.input):
            return spec, []
        from offload.storage.inputs import upload_input_files

        storage, limit = await self._files_storage()
        job_id = spec.job_id or new_job_id(queue)
        store = await self.store()
        store.validate(dataclasses.replace(spec, input=None))  # bad options: fail before uploading
        await store.redis.sadd(QUEUES_KEY, queue)  # known before its first file lands, so the sweep finds orphans
        value, keys = await upload_input_files(storage, job_id, spec.input, max_bytes=limit)
        return dataclasses.replace(spec, input=value, job_id=job_id), keys

    async def _enqueue_specs(self, queue: str, specs: list[JobSpec]) -> list[str]:
        """Upload files, then enqueue; on any failure (or a duplicate that kept an earlier job) delete what this
        call uploaded, so no file is left that no job refers to."""
        from offload.storage.inputs import delete_keys

        uploads: list[tuple[str | None, list[str]]] = []  # (job id, its file keys) per spec
        ready: list[JobSpec] = []
        try:
            for spec in specs:
                done, keys = await self._upload(queue, spec)
                ready.append(done)
                uploads.append((done.job_id, keys))
            ids = await (await self.store()).enqueue_many(queue, ready)
        except BaseException as exc:
            if self._storage is not None and not isinstance(exc, NotReplicated):  # (that job may well exist)
                await delete_keys(self._storage, [k for _, keys in uploads for k in keys])
            raise
        if self._storage is not None:  # an idempotent repeat returned an earlier job: these files are no one's
            orphans = [k for (job_id, keys), got in zip(uploads, ids, strict=True) if got != job_id for k in keys]
            await delete_keys(self._storage, orphans)
        return ids

    async def enqueue(
        self,
        queue: str,
        input: Any,
        *,
        priority: int = 0,
        delay: float | None = None,
        run_at: float | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        output_key: str | None = None,
        retention: int = DEFAULT_RETENTION_S,
        idempotency_key: str | None = None,
        deadline: float | datetime | timedelta | None = None,
        max_cost: float | None = None,
        callback_url: str | None = None,
    ) -> str:
        """Enqueue one job and return its id (the existing id when `idempotency_key` was seen before).
        `deadline`: the latest the job may start, as epoch seconds, a datetime, or a timedelta from enqueue (the
        store's clock); `max_cost`: the most one submission may cost, USD (docs/how-to/enqueue.md);
        `callback_url`: where the server POSTs the job's signed completion webhook (docs/how-to/
        completion-webhooks.md; its host must be one the server's callbacks.hosts allows)."""
        at, within = deadline_options(deadline)
        spec = JobSpec(
            input=input,
            priority=priority,
            delay=delay,
            run_at=run_at,
            max_attempts=max_attempts,
            output_key=output_key,
            retention=retention,
            idempotency_key=idempotency_key,
            deadline=at,
            deadline_in=within,
            max_cost=max_cost,
            callback_url=callback_url,
        )
        return (await self._enqueue_specs(queue, [spec]))[0]

    async def enqueue_many(self, queue: str, items: Iterable[Any]) -> list[str]:
        """Enqueue many jobs in pipelined batches. Each item is a JobSpec, a dict with an "input" key and
        JobSpec options, or a bare input."""
        specs = [_spec(i) for i in items]
        if not any(files_in(s.input) for s in specs):
            return await (await self.store()).enqueue_many(queue, specs)
        return await self._enqueue_specs(queue, specs)

    async def get(self, job_id: str) -> Job:
        return await (await self.store()).get(job_id)

    async def attempts(self, job_id: str) -> tuple[list[Attempt], int]:
        """The job's attempts, oldest first (the first 5 and the last 45 of a longer history), and how many it made."""
        return await (await self.store()).attempts(job_id)

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

    async def _succeeded(self, job_id: str, timeout: float | None) -> Job:
        job = await (self.wait(job_id, timeout) if timeout is not None else self.get(job_id))
        if job.state.value != "succeeded":
            why = f": {job.error}" if job.error else ""
            raise NoResult(f"job {job_id} is {job.state.value}, it has no result{why}", job)
        return job

    async def result(self, job_id: str, timeout: float | None = None) -> Any:
        """A succeeded job's output, read from storage and decoded. Files it holds stay references
        (`{"$file": key, ...}`; `download` fetches them). `timeout`: wait that long for the job to finish first.
        A job that did not succeed raises `NoResult` (its `job` says how it ended); one still running after
        `timeout` raises TimeoutError."""
        job = await self._succeeded(job_id, timeout)
        storage, _ = await self._files_storage()
        return orjson.loads(await storage.get_bytes(job.output_key))

    async def download(
        self, job_id: str, directory: str | os.PathLike[str], timeout: float | None = None
    ) -> Downloaded:
        """Save a succeeded job's output as `output.json` in `directory` (made if missing) and every file of the
        job it refers to beside it, each checked against its reference (as `offload result --download DIR/`)."""
        from offload.storage.results import download_result

        job = await self._succeeded(job_id, timeout)
        storage, _ = await self._files_storage()
        return await download_result(storage, job_id, job.output_key, Path(directory))

    async def cancel(self, job_id: str) -> str:
        return await (await self.store()).cancel(job_id)

    async def stats(self, queue: str) -> QueueStats:
        return await (await self.store()).stats(queue)

    async def history(self, queue: str, range: str = "hour") -> list[HistoryPoint]:
        """The queue's history over the last `range` (hour: 60 one-minute points; day: 24 hourly; week: 168),
        oldest first, every bucket present."""
        return (await (await self.store()).history(queue, range))[1]

    async def aclose(self) -> None:
        if self._store is not None:
            await self._store.redis.aclose()
            self._store = None
        if self._storage is not None and self._owns_storage:
            await self._storage.aclose()
            self._storage = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client:
    """The blocking face of `AsyncClient`; same methods, same arguments."""

    def __init__(
        self,
        url: str | None = None,
        *,
        max_payload: int | None = None,
        storage: Storage | Mapping[str, Any] | None = None,
        max_file_bytes: int | None = None,
        durability: Durability | Mapping[str, Any] | None = None,
        config: str | os.PathLike[str] | None = None,
    ) -> None:
        durability = _durability(durability)  # a bad value fails here, before a thread is started
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="offload-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(
            url,
            max_payload=max_payload,
            storage=storage,
            max_file_bytes=max_file_bytes,
            durability=durability,
            config=config,
        )

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def enqueue(self, queue: str, input: Any, **options: Any) -> str:
        return self._call(self._async.enqueue(queue, input, **options))

    def enqueue_many(self, queue: str, items: Sequence[Any]) -> list[str]:
        return self._call(self._async.enqueue_many(queue, items))

    def get(self, job_id: str) -> Job:
        return self._call(self._async.get(job_id))

    def attempts(self, job_id: str) -> tuple[list[Attempt], int]:
        return self._call(self._async.attempts(job_id))

    def wait(self, job_id: str, timeout: float = 60.0) -> Job:
        return self._call(self._async.wait(job_id, timeout))

    def result(self, job_id: str, timeout: float | None = None) -> Any:
        return self._call(self._async.result(job_id, timeout))

    def download(self, job_id: str, directory: str | os.PathLike[str], timeout: float | None = None) -> Downloaded:
        return self._call(self._async.download(job_id, directory, timeout))

    def cancel(self, job_id: str) -> str:
        return self._call(self._async.cancel(job_id))

    def stats(self, queue: str) -> QueueStats:
        return self._call(self._async.stats(queue))

    def history(self, queue: str, range: str = "hour") -> list[HistoryPoint]:
        return self._call(self._async.history(queue, range))

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
