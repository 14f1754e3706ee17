"""`offload worker`: the dispatch worker, or with --handler the GPU worker that runs the jobs itself.

Which queues a worker serves, first match wins:
  1. `--queue` (repeatable, or comma-separated);
  2. OFFLOAD_QUEUE (comma-separated), which is what a rented machine or an env file names;
  3. dispatch worker only: every queue the configuration gives a backend, which covers offload.yaml's queues and
     the one the tutorial's env file implies (QUEUE_KEY `gpu:jobs` -> queue `gpu-jobs`).
So `offload worker` under the tutorial's env file, a systemd unit's env file or an offload.yaml starts with no
flag at all. Several queues are served by one process: one event loop, one drain on SIGTERM.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer

from offload import eventloop
from offload.cli.errors import errors, fail
from offload.cli.logs import configure as configure_logging
from offload.cli.options import ConfigOpt, LogLevel, LogLevelOpt
from offload.cli.session import settings
from offload.config import Settings, config_file
from offload.env import env_str
from offload.queue.keyspace import validate_queue

QueuesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--queue",
        "-q",
        show_default=False,
        help="Queue to serve (repeatable, or comma-separated). Default: OFFLOAD_QUEUE, else every queue the "
        "configuration gives a backend.",
    ),
]


def queue_names(values: Iterable[str | None]) -> list[str]:
    """'a,b', 'c' -> ['a', 'b', 'c']: commas split (no queue name has one), blanks and repeats dropped."""
    names = (name.strip() for value in values if value for name in value.split(","))
    return list(dict.fromkeys(name for name in names if name))


def _given(queue: list[str] | None) -> list[str]:
    """--queue, else OFFLOAD_QUEUE; every name checked before anything connects."""
    names = queue_names(queue or []) or queue_names([env_str("OFFLOAD_QUEUE")])
    with errors():
        for name in names:
            validate_queue(name)
    return names


def dispatch_queues(given: list[str], loaded: Settings, config: Path | None) -> list[str]:
    """The queues to dispatch: the ones named, else every configured queue with a backend, else a clear error."""
    if given:
        return given
    if named := [name for name, q in loaded.queues.items() if q.served_backends]:
        return named
    with errors():
        file = config_file(config)
    if file is None:
        fail(
            "no queue to serve: pass --queue, set OFFLOAD_QUEUE, or configure one: an offload.yaml (--config, "
            "OFFLOAD_CONFIG or ./offload.yaml) with queues.<name>.backend, or the tutorial's QUEUE_KEY and "
            "GPU_API_BASE"
        )
    handler_only = ", ".join(loaded.queues)
    fail(
        f"no queue to serve: {file} gives no queue a backend"
        + (f" ({handler_only}: served by `offload worker --handler`)" if handler_only else "")
        + "; pass --queue or set OFFLOAD_QUEUE"
    )


def worker(
    queue: QueuesOpt = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            min=1, help="Remote jobs in flight per queue (default: the queue's); with --handler, handlers at once."
        ),
    ] = None,
    config: ConfigOpt = None,
    grace: Annotated[
        float,
        typer.Option(
            help="Seconds to keep polling after SIGTERM before releasing (submit calls out are awaited up to the "
            "backend's timeout anyway; a second SIGTERM cuts)."
        ),
    ] = 30.0,
    log_level: LogLevelOpt = LogLevel.INFO,
    handler: Annotated[
        str | None, typer.Option(help="GPU worker: run module:function on each job here, talking only to --server.")
    ] = None,
    server: Annotated[str | None, typer.Option(envvar="OFFLOAD_SERVER", help="With --handler: the server URL.")] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="OFFLOAD_TOKEN", show_default=False, help="With --handler: a worker key (prefer OFFLOAD_TOKEN)."
        ),
    ] = None,
    load: Annotated[str | None, typer.Option(help="With --handler: module:function run once before claiming.")] = None,
) -> None:
    """Dispatch worker: claim, submit to the queue's backend, poll, store the output, complete. With --handler:
    a GPU worker that runs the handler itself and talks only to the server over HTTP."""
    configure_logging(log_level)
    given = _given(queue)
    if handler is not None:
        run_handler_worker(given, handler, server, token, load, concurrency or 1, grace)
        return
    from offload.heap import freeze_startup
    from offload.worker.run import run_workers

    loaded = settings(config)
    queues = dispatch_queues(given, loaded, config)
    with errors():
        # on_ready: set up, about to claim; freeze what start-up built (offload/heap.py)
        eventloop.run(
            run_workers(loaded, queues, concurrency=concurrency, grace_s=grace, on_ready=lambda _: freeze_startup())
        )


def run_handler_worker(
    queues: list[str],
    handler: str,
    server_url: str | None,
    token: str | None,
    load: str | None,
    concurrency: int,
    grace: float,
) -> None:
    """`offload worker --handler`: needs only the server URL and a worker key, never Redis or storage."""
    from offload.gpu_worker.loop import GpuWorkerOptions, run_gpu_worker

    if not server_url:
        fail("--handler needs --server URL (or OFFLOAD_SERVER)")
    if not token:
        fail("--handler needs a worker key: OFFLOAD_TOKEN (or --token)")
    if not queues:
        fail("--handler needs a queue to serve: --queue, or OFFLOAD_QUEUE (comma-separated for several)")
    options = GpuWorkerOptions(server=server_url, token=token, queues=queues, concurrency=concurrency, grace_s=grace)
    with errors():
        try:
            eventloop.run(run_gpu_worker(options, handler, load))
        except (ImportError, AttributeError, ValueError) as exc:
            fail(f"cannot load the handler: {exc}")


def register(app: typer.Typer) -> None:
    app.command()(worker)
