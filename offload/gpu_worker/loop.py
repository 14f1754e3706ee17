"""`offload worker --handler module:function`: a GPU machine runs the work itself and talks only to the server.

The handler takes the job input (and optionally a `JobContext`) and returns a JSON value, which the server
stores at the job's output key. Sync handlers run in a thread so heartbeats keep flowing while the GPU works;
async handlers run on the loop. An exception is a failed attempt, retried with backoff per the job's
`max_attempts`; raise `PermanentError` for input that can never work (dead at once). A load hook
(`--load module:function`) runs once per process before the first claim, for model loading; what it returns
is `context.loaded`.

SIGTERM/SIGINT: stop claiming, let running handlers finish for `grace` seconds, then deregister, which hands
every remaining lease back to the queue at once. A SIGKILLed worker's leases run out instead and the store's
reaper re-delivers its jobs to another worker. A run past its queue's `timeout` is ended by the server (the attempt
fails with the reason), and the heartbeat reply tells the worker to abandon it (`_abandon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from offload.env import env_str
from offload.errors import StaleLease, WorkerError
from offload.eventloop import first_of
from offload.gpu_worker.job_files import FileTransferError, JobFiles
from offload.gpu_worker.server_api import ServerApi, ServerRejected, Unregistered

log = logging.getLogger("offload.gpu_worker")


class PermanentError(WorkerError):
    """Raise from a handler when retrying cannot help: the job goes dead at once with this message."""


@dataclass
class JobContext:
    """What a handler may want besides the input."""

    id: str
    queue: str
    attempt: int
    max_attempts: int
    output_key: str
    loaded: Any = None
    cancelled: threading.Event = field(default_factory=threading.Event)  # set when a cancel was requested
    files: JobFiles | None = None  # input downloads and output uploads through URLs the server signs

    def _files(self) -> JobFiles:
        if self.files is None:
            raise RuntimeError("this context has no server connection for files")
        return self.files

    def open(self, ref: Any) -> IO[bytes]:
        """An input file (a `{"$file": ...}` reference) as a readable binary file; blocks (sync handlers)."""
        return self._files().open(ref)

    def download(self, ref: Any, path: str | os.PathLike[str]) -> Path:
        """Save an input file at `path`, size and SHA-256 checked; blocks (sync handlers)."""
        return self._files().download(ref, path)

    async def aopen(self, ref: Any) -> IO[bytes]:
        return await self._files().aopen(ref)

    async def adownload(self, ref: Any, path: str | os.PathLike[str]) -> Path:
        return await self._files().adownload(ref, path)


MULTI_QUEUE_WAIT_S = 1.0  # the long-poll per claim when serving several queues (see GpuWorker._next_queue)


@dataclass
class GpuWorkerOptions:
    server: str
    token: str
    queues: list[str]
    concurrency: int = 1  # across all queues: one GPU runs `concurrency` handlers at once, whichever queue
    grace_s: float = 30.0
    poll_wait_s: float = 20.0
    instance_id: str | None = None
    instance_token: str | None = field(default=None, repr=False)  # proves the machine is that instance
    protected: bool = False


def resolve(spec: str) -> Callable[..., Any]:
    """`package.module:function` -> the function. The working directory is importable, as with uvicorn."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected module:function, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


def gpu_info() -> list[dict[str, Any]]:
    """GPUs from nvidia-smi when the machine has one; an empty list otherwise (or if it misbehaves)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"index": parts[0], "name": parts[1], "memory_mb": parts[2], "uuid": parts[3]})
    return gpus


def _wants_context(fn: Callable[..., Any]) -> bool:
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Async functions on the loop; sync ones in a thread, so a long GPU call never stalls heartbeats."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await _in_daemon_thread(fn, *args)
    if inspect.isawaitable(result):
        return await result
    return result


async def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """A daemon thread per call rather than asyncio's executor, whose threads the interpreter joins at exit: a
    handler stuck past the drain grace must not keep a stopping worker alive (its lease is handed back)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="offload-handler", daemon=True).start()
    return await future


class GpuWorker:
    def __init__(
        self,
        options: GpuWorkerOptions,
        handler: Callable[..., Any],
        load: Callable[[], Any] | None = None,
        api: ServerApi | None = None,
    ) -> None:
        self.o = options
        self.handler = handler
        self.load = load
        self.api = api or ServerApi(options.server, options.token)
        self.with_context = _wants_context(handler)
        self.worker_id = ""
        self.heartbeat_s = 10.0
        self.loaded: Any = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.tokens: dict[str, str] = {}  # the lease each running job was delivered under
        self.contexts: dict[str, JobContext] = {}
        self.lost: set[str] = set()
        self._slot = asyncio.Event()
        self._turn = 0

    async def _register(self, retry_for: float = 300.0) -> None:
        info = {
            "queues": self.o.queues,
            "host": socket.gethostname(),
            "version": _version(),
            "pid": os.getpid(),
            "concurrency": self.o.concurrency,
            "instance_id": self.o.instance_id,
            **({"instance_token": self.o.instance_token} if self.o.instance_token else {}),
            "protected": self.o.protected,
            "gpus": await asyncio.to_thread(gpu_info),
        }
        reply = await self.api.register(info, retry_for)
        self.worker_id = reply["worker_id"]
        self.heartbeat_s = float(reply["heartbeat_interval_s"])
        self.o.poll_wait_s = min(self.o.poll_wait_s, float(reply.get("max_wait_s", self.o.poll_wait_s)))
        log.info(
            "registered as %s on %s (queue %s, up to %d at once)",
            self.worker_id,
            self.o.server,
            ",".join(self.o.queues),
            self.o.concurrency,
        )

    def _next_queue(self) -> tuple[str, float]:
        """The queue to claim from and how long to long-poll it. One queue: the full wait. Several: in turn, a
        short wait each, so a job on any of N queues waits about N * MULTI_QUEUE_WAIT_S at most; the turn moves
        on after every claim, so a busy queue cannot starve the others."""
        queues = self.o.queues
        queue = queues[self._turn % len(queues)]
        self._turn += 1
        return queue, self.o.poll_wait_s if len(queues) == 1 else min(self.o.poll_wait_s, MULTI_QUEUE_WAIT_S)

    async def run(self, stop: asyncio.Event) -> None:
        if self.load is not None:
            log.info("running the load hook")
            self.loaded = await _call(self.load)
        await self._register()
        beat = asyncio.create_task(self._heartbeat_loop())
        try:
            while not stop.is_set():
                free = self.o.concurrency - len(self.tasks)
                if free <= 0:
                    self._slot.clear()
                    await first_of(self._slot.wait(), stop.wait())
                    continue
                queue, wait = self._next_queue()
                claim = asyncio.create_task(self.api.claim(self.worker_id, queue, free, wait))
                await first_of(claim, stop.wait())
                if not claim.done():  # stopping: the server sees the disconnect and hands back what it claimed
                    claim.cancel()
                    with contextlib.suppress(BaseException):
                        await claim
                    break
                try:
                    jobs = claim.result()
                except Unregistered:
                    await self._register()
                    continue
                except ServerRejected as exc:
                    if exc.status in (401, 403):  # the key was revoked or never fit: retrying cannot help
                        raise
                    log.warning("claim failed: %s", exc)
                    await first_of(asyncio.sleep(1.0), stop.wait())
                    continue
                except ConnectionError as exc:
                    log.warning("claim failed: %s", exc)
                    await first_of(asyncio.sleep(1.0), stop.wait())
                    continue
                for job in jobs:
                    if old := self.tasks.get(job["id"]):  # our earlier lease of it was lost and it came back to us
                        self._drop(job["id"], "leased to this worker again; the earlier run is abandoned")
                    self.tokens[job["id"]] = job["token"]
                    self.tasks[job["id"]] = asyncio.create_task(self._run_job(job, old))
        finally:
            await self._drain(beat)

    async def _drain(self, beat: asyncio.Task[None]) -> None:
        if self.tasks:
            log.info("draining: waiting up to %.0fs for %d running job(s)", self.o.grace_s, len(self.tasks))
            await asyncio.wait(list(self.tasks.values()), timeout=self.o.grace_s)
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        if self.worker_id:
            with contextlib.suppress(Exception):
                await self.api.deregister(self.worker_id)
        log.info("stopped")

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                ids = list(self.tokens)
                reply = await self.api.heartbeat(
                    self.worker_id, ids, self.o.protected, self.o.instance_id, [self.tokens[i] for i in ids]
                )
            except Unregistered:
                log.warning("the server forgot this worker (silent too long): registering again")
                with contextlib.suppress(Exception):
                    await self._register(retry_for=0)
                continue
            except Exception as exc:  # the next beat retries; the lease outlives a few misses
                log.warning("heartbeat failed: %s", exc)
                continue
            timed_out = set(reply.get("timed_out", []))
            for job_id in timed_out:
                self._abandon(job_id)
            for job_id in reply.get("lost", []):
                if job_id not in timed_out:
                    self._drop(job_id, "lease lost: another worker owns it now")
            for job_id in reply.get("cancel_requested", []):
                ctx = self.contexts.get(job_id)
                if ctx is not None and not ctx.cancelled.is_set():
                    ctx.cancelled.set()
                    if inspect.iscoroutinefunction(self.handler) and (task := self.tasks.get(job_id)):
                        task.cancel()

    def _drop(self, job_id: str, why: str) -> None:
        if job_id in self.tasks:
            log.warning("job %s: %s", job_id, why)
            self.lost.add(job_id)
            if inspect.iscoroutinefunction(self.handler):
                self.tasks[job_id].cancel()

    def _abandon(self, job_id: str) -> None:
        """The server ended this run: it passed its queue's `timeout` (the attempt failed with that reason). The
        worker stops waiting for it and its slot serves the next job. An async handler is cancelled; a thread cannot
        be stopped, so a sync handler is told (`ctx.cancelled`) and left to end on its own: whatever it returns is
        dropped (the server would refuse it), and what it holds (GPU memory) stays held until it does."""
        task = self.tasks.get(job_id)
        if task is None or task.done():
            return
        self.lost.add(job_id)
        if ctx := self.contexts.get(job_id):
            ctx.cancelled.set()
        task.cancel()
        kind = "cancelled" if inspect.iscoroutinefunction(self.handler) else "its thread runs on until it returns"
        log.warning("job %s: timed out (the queue's timeout): abandoned, the handler %s", job_id, kind)

    async def _run_job(self, job: dict[str, Any], after: asyncio.Task[None] | None = None) -> None:
        job_id, token = job["id"], job["token"]
        ctx = JobContext(job_id, job["queue"], job["attempt"], job["max_attempts"], job["output_key"], self.loaded)
        files = ctx.files = JobFiles(self.api, asyncio.get_running_loop(), self.worker_id, job_id, token)
        me = asyncio.current_task()
        try:
            await self._attend(job, ctx, files, after)
        except StaleLease as exc:
            log.info("job %s: %s", job_id, exc)
        except (ServerRejected, ConnectionError, Unregistered) as exc:
            log.warning(
                "job %s: reporting the result failed: %s (its lease is handed back and it is re-run)", job_id, exc
            )
        finally:
            if self.tasks.get(job_id) is me:  # not a newer lease of the same job that took this one's place
                del self.tasks[job_id]
                self.tokens.pop(job_id, None)
                self.contexts.pop(job_id, None)
                self.lost.discard(job_id)
            self._slot.set()

    async def _attend(
        self, job: dict[str, Any], ctx: JobContext, files: JobFiles, after: asyncio.Task[None] | None
    ) -> None:
        """Run the handler on one lease and report how it ended: complete, failed or cancelled."""
        job_id, token = job["id"], job["token"]
        if after is not None:  # an async handler stops; a sync one runs on in its thread, reporting stale
            await asyncio.wait([after])
        self.contexts[job_id] = ctx
        self.lost.discard(job_id)
        if job.get("cancel_requested"):
            await self.api.cancelled(self.worker_id, job_id, token)
            return
        ended, output = await self._handle(job, ctx)
        if ended or job_id in self.lost:
            return
        if ctx.cancelled.is_set():
            await self.api.cancelled(self.worker_id, job_id, token)
            return
        ended, output = await self._upload_outputs(job_id, token, files, output)
        if ended or not await self._is_json(job_id, token, output):
            return
        await self.api.complete(self.worker_id, job_id, token, output)
        log.debug("job %s succeeded", job_id)  # one a job: the server's events and metrics count them

    async def _handle(self, job: dict[str, Any], ctx: JobContext) -> tuple[bool, Any]:
        """The handler's output, or `(True, None)` once a raise was reported as a failure or a cancel."""
        job_id, token = job["id"], job["token"]
        try:
            args = (job["input"], ctx) if self.with_context else (job["input"],)
            return False, await _call(self.handler, *args)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if ctx.cancelled.is_set() and job_id not in self.lost and task is not None:
                task.uncancel()  # the job's cancel, handled: later timeouts of this task are not taken for one
                await self.api.cancelled(self.worker_id, job_id, token)
                return True, None
            raise
        except PermanentError as exc:
            await self._fail(job_id, token, f"PermanentError: {exc}", retryable=False)
        except Exception as exc:
            log.warning("job %s attempt %d: handler raised %s", job_id, ctx.attempt, _describe(exc))
            await self._fail(job_id, token, _describe(exc, with_trace=True), retryable=True)
        return True, None

    async def _upload_outputs(self, job_id: str, token: str, files: JobFiles, output: Any) -> tuple[bool, Any]:
        """`output` with its `File` values uploaded and replaced by references, or `(True, None)` once failed."""
        try:
            return False, await files.upload_outputs(output)
        except (FileTransferError, OSError, ValueError) as exc:
            await self._fail(job_id, token, f"uploading output files failed: {_describe(exc)}", retryable=True)
        except ServerRejected as exc:
            await self._fail(job_id, token, f"uploading output files refused: {exc}", retryable=exc.status != 413)
        return True, None

    async def _is_json(self, job_id: str, token: str, output: Any) -> bool:
        """Whether the output serialises; if not the attempt fails for good (a retry returns the same)."""
        try:
            orjson.dumps(output)
        except TypeError as exc:
            await self._fail(job_id, token, f"handler output is not JSON: {exc}", retryable=False)
            return False
        return True

    async def _fail(self, job_id: str, token: str, error: str, *, retryable: bool) -> None:
        state = await self.api.fail(self.worker_id, job_id, token, error, retryable)
        log.info("job %s -> %s", job_id, state)


def _describe(exc: BaseException, with_trace: bool = False) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if with_trace:
        tail = "".join(traceback.format_exception(exc)[-3:])
        text = f"{text}\n{tail}"
    return text[:4000]


def _version() -> str:
    from offload import __version__

    return __version__


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


async def run_gpu_worker(
    options: GpuWorkerOptions, handler_spec: str, load_spec: str | None = None, *, install_signals: bool = True
) -> None:
    """Entry point of `offload worker --handler`: resolve the functions, serve until a signal, drain."""
    handler = resolve(handler_spec)
    load = resolve(load_spec) if load_spec else None
    if not log.isEnabledFor(logging.DEBUG):  # one line per heartbeat and claim would drown the job lines
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if options.instance_id is None:
        options.instance_id = env_str("OFFLOAD_INSTANCE_ID") or None
    if options.instance_token is None:
        options.instance_token = env_str("OFFLOAD_INSTANCE_TOKEN") or None
    options.protected = options.protected or _truthy(env_str("OFFLOAD_PROTECTED"))
    stop = asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    worker = GpuWorker(options, handler, load)
    try:
        await worker.run(stop)
    finally:
        await worker.api.aclose()
