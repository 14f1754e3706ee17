"""`offload result ID [--download PATH | DIR/]`: where a job's output is, and bringing it (and its files) home;
`offload wait ID`: the output itself, once the job is done."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from offload.cli.errors import error_line, errors, fail
from offload.cli.options import ConfigOpt, JobArg, JsonOpt, UrlOpt
from offload.cli.output import print_json
from offload.cli.session import redis_url, run_redis, settings
from offload.models import Job
from offload.queue.keyspace import queue_of
from offload.queue.store import QueueStore


def result(
    job_id: JobArg,
    download: Annotated[
        str | None,  # not a Path, which would drop the trailing / that asks for a directory
        typer.Option(
            "--download",
            help="A directory (existing, or ending in /): the output as output.json and every file it refers "
            "to beside it. A file path: the output JSON only, as before.",
        ),
    ] = None,
    config: ConfigOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Where a succeeded job's output is, a presigned URL to it, and optionally the output and its files."""
    from offload.storage import create_storage
    from offload.storage.results import download_result, result_key

    config_settings = settings(config)
    with errors():
        queue_of(job_id)  # a malformed id fails before any connection is made
    job = run_redis(None, lambda redis: QueueStore(redis).get(job_id), config=config)
    if job.state.value != "succeeded":
        fail(f"job {job_id} is {job.state.value}, it has no result yet" + (f": {job.error}" if job.error else ""))
    target = Path(download) if download is not None else None
    into_dir = target is not None and (target.is_dir() or str(download).endswith("/"))

    async def fetch() -> tuple[str, list[str]]:
        storage = create_storage(config_settings.storage)
        saved: list[str] = []
        try:
            stored = result_key(storage, job_id, job.output_key, job.result) or job.output_key
            if not await storage.exists(stored):  # else a URL to nothing, and a script thinks it has one
                fail(_not_stored(job_id, stored, job.result, "storage" in config_settings.model_fields_set))
            presigned = await storage.presigned_url(stored)
            if target is not None and into_dir:
                done = await download_result(storage, job_id, job.output_key, target, stored)
                saved = [str(done.output), *(str(p) for p in done.files)]
                for key in done.skipped:
                    typer.echo(f"warning: skipped {key[:200]!r}: not an object of job {job_id}", err=True)
            elif target is not None:
                target.write_bytes(await storage.get_bytes(stored))
                saved = [str(target)]
        finally:
            await storage.aclose()
        return presigned, saved

    with errors():
        presigned, saved = asyncio.run(fetch())
    info: dict[str, Any] = {"job": job_id, "location": job.result or "", "presigned_url": presigned}
    if saved:
        info["saved"] = saved
    if json_out:
        print_json(info)
    else:
        typer.echo(f"{info['location']}\n{info['presigned_url']}")
        for path in saved:
            typer.echo(f"saved to {path}", err=True)


def _not_stored(job_id: str, key: str, location: str | None, configured: bool) -> str:
    where = "the configured storage" if configured else "the default local storage (no storage is configured)"
    hint = "" if configured else "; set storage in offload.yaml (or OFFLOAD_RESULT_BUCKET) to where the workers write"
    return f"the output of job {job_id} ({key}) is not in {where}; the job recorded it at {location or '-'}{hint}"


TIMED_OUT = 124  # as timeout(1): scripts tell "still running" from "it failed" (1)


def wait(
    job_id: JobArg,
    timeout: Annotated[float, typer.Option(min=0, help="Seconds to wait for the job to finish.")] = 60.0,
    config: ConfigOpt = None,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Wait for a job to finish and print its output. Exit 0 if it succeeded, 1 if it failed, went dead or was
    cancelled, 124 if it is still running after --timeout."""
    from offload.client import AsyncClient

    with errors():
        queue_of(job_id)  # a malformed id fails before any connection is made
    target = redis_url(url, config)

    async def go() -> tuple[Job, Any]:
        async with AsyncClient(target, config=config) as client:
            job = await client.wait(job_id, timeout)
            return job, (await client.result(job_id) if job.state.value == "succeeded" else None)

    with errors():
        try:
            job, output = asyncio.run(go())
        except TimeoutError as exc:  # (an OSError too: caught here, before errors() would make it exit 1)
            typer.echo(error_line(str(exc)), err=True)
            raise typer.Exit(TIMED_OUT) from None
    if json_out:
        print_json({"job": job_id, "state": job.state.value, "error": job.error, "output": output})
    elif job.state.value == "succeeded":
        typer.echo(orjson.dumps(output, option=orjson.OPT_INDENT_2).decode())
    if job.state.value != "succeeded":
        fail(f"job {job_id} is {job.state.value}" + (f": {job.error}" if job.error else ""))
