"""Commands that run the pipeline: `offload worker`, `offload result`, `offload config check`."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Annotated

import orjson
import typer

from offload.cli_errors import _errors, _fail
from offload.config import Settings, load_settings
from offload.connection import connect
from offload.queue.store import QueueStore

config_app = typer.Typer(help="Validate offload.yaml and the environment.", no_args_is_help=True)
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="offload.yaml (default: ./offload.yaml).")]


def _settings(config: Path | None) -> Settings:
    """--config, else ./offload.yaml, else the local stack's generated config (with its S3 secret)."""
    from offload import stack

    with _errors():
        if config is None and not Path("offload.yaml").exists() and stack.config_path().exists():
            return load_settings(stack.config_path(), env={**os.environ, **stack.secret_env()})
        return load_settings(config)
    raise AssertionError("unreachable")


def worker(
    queue: Annotated[str, typer.Option("--queue", "-q", envvar="OFFLOAD_QUEUE", show_default=False,
                                       help="Queue to serve (default: OFFLOAD_QUEUE, which rented machines get).")],
    concurrency: Annotated[int | None, typer.Option(min=1, help="Remote jobs in flight (default: queue's).")] = None,
    config: ConfigOpt = None,
    grace: Annotated[float, typer.Option(help="Seconds to keep polling after SIGTERM before releasing.")] = 30.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning.")] = "info",
    handler: Annotated[str | None, typer.Option(
        help="GPU worker: run module:function on each job here, talking only to --server.")] = None,
    server: Annotated[str | None, typer.Option(envvar="OFFLOAD_SERVER", help="With --handler: the server URL.")] = None,
    token: Annotated[str | None, typer.Option(envvar="OFFLOAD_TOKEN", show_default=False,
                                              help="With --handler: a worker key (prefer OFFLOAD_TOKEN).")] = None,
    load: Annotated[str | None, typer.Option(help="With --handler: module:function run once before claiming.")] = None,
) -> None:
    """Dispatch worker: claim, submit to the queue's backend, poll, store the output, complete. With --handler:
    a GPU worker that runs the handler itself and talks only to the server over HTTP."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level.lower() != "debug":  # httpx logs every request at INFO: thousands of lines a second at scale
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if handler is not None:
        from offload.server_cli import run_handler_worker

        run_handler_worker(queue, handler, server, token, load, concurrency or 1, grace)
        return
    from offload.worker.run import run_worker

    settings = _settings(config)
    with _errors():
        settings.queue(queue)
        asyncio.run(run_worker(settings, queue, concurrency=concurrency, grace_s=grace))


def result(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    download: Annotated[Path | None, typer.Option("--download", help="Save the stored output here.")] = None,
    config: ConfigOpt = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Where a succeeded job's output is, a presigned URL to it, and optionally the output itself."""
    from offload.storage import create_storage
    from offload.worker.run import storage_settings

    settings = _settings(config)

    async def go() -> dict[str, str]:
        redis = await connect(settings.redis_url)
        try:
            job = await QueueStore(redis).get(job_id)
        finally:
            await redis.aclose()
        if job.state.value != "succeeded":
            _fail(f"job {job_id} is {job.state.value}, it has no result yet" + (f": {job.error}" if job.error else ""))
        storage = create_storage(storage_settings(settings))
        try:
            url = await storage.presigned_url(job.output_key)
            if download:
                download.write_bytes(await storage.get_bytes(job.output_key))
        finally:
            await storage.aclose()
        return {"job": job_id, "location": job.result or "", "presigned_url": url}

    with _errors():
        info = asyncio.run(go())
        if json_out:
            typer.echo(orjson.dumps(info).decode())
        else:
            typer.echo(f"{info['location']}\n{info['presigned_url']}")
            if download:
                typer.echo(f"saved to {download}", err=True)


@config_app.command("check")
def config_check(config: ConfigOpt = None) -> None:
    """Load offload.yaml plus the environment; name the offending field if anything is wrong."""
    settings = _settings(config)
    queues = ", ".join(f"{n} -> {q.backend}" for n, q in settings.queues.items()) or "none"
    typer.echo(f"ok: storage {settings.storage.kind}, backends {', '.join(settings.backends) or 'none'}, "
               f"queues {queues}")


def register(app: typer.Typer) -> None:
    app.command()(worker)
    app.command()(result)
    app.add_typer(config_app, name="config")
