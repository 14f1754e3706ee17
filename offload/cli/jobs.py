"""Commands that add and read jobs: enqueue, status, jobs, queues, ingest, result (the listing is in `listing`;
dead, held, pause, resume, cancel and purge are in `operate`).

Every command connects, does one thing through `QueueStore` and closes the connection. Output is meant for
two readers: people get rich tables, scripts get `--json` (one document on stdout) or a bare id/count.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from offload import exactjson
from offload.autoscale.fleet_idle import with_fleet_idle
from offload.caps import CAPPED_WAIT, CapKind, CapLimits, cap_reached
from offload.cli.attach import enqueue_attached
from offload.cli.attempts import show_attempts
from offload.cli.errors import errors, fail
from offload.cli.listing import jobs_cmd
from offload.cli.options import (
    ConfigOpt,
    JobArg,
    JsonOpt,
    QueueOpt,
    UrlOpt,
)
from offload.cli.output import age, err, listing, number_column, out, print_json, short, show, text_column, when
from offload.cli.results import result, wait
from offload.cli.session import configured_caps, run_store
from offload.cli.spend import SPEND_COLUMNS, cost_unknown, spend_cells
from offload.errors import InvalidJob, OffloadError, StoreFull
from offload.models import DEFAULT_MAX_ATTEMPTS, Attempt, Enqueued, Job, QueueStats
from offload.queue.keyspace import validate_queue
from offload.queue.memory import store_full
from offload.queue.specs import JobSpec, deadline_options, max_payload_limit, validate_spec
from offload.queue.store import QueueStore
from offload.schema import parse_duration

BULK_CHUNK = 10_000  # jobs per enqueue_many call: bounds memory per round trip and paces the progress bar
INGEST_BATCH = 1_000
LINE_OPTIONS = (
    "priority",
    "delay",
    "max_attempts",
    "output_key",
    "idempotency_key",
    "deadline",
    "deadline_in",
    "max_cost",
    "callback_url",
)
TIME_FIELDS = ("created_at", "run_at", "started_at", "finished_at", "lease_deadline", "intent_at", "deadline")
COUNT_COLUMNS = ("queued", "delayed", "active", "submitted", "retrying", "held", "succeeded", "dead", "cancelled")


def parse_deadline(text: str) -> tuple[float | None, float | None]:
    """--deadline as JobSpec's (deadline, deadline_in): a duration is counted from enqueue, a time is absolute."""
    try:
        return None, parse_duration(text)
    except ValueError:
        pass
    try:
        return deadline_options(datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00")))
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is neither a duration (2h, 90m, 1h30m, seconds) nor an ISO 8601 time", param_hint="--deadline"
        ) from None


def _parse_lines(lines: Iterator[bytes], defaults: dict[str, Any]) -> list[JobSpec]:
    """A line is a bare JSON input, or {"input": ..., <JobSpec options>} to set options per job. Every line
    is checked by the store's own validation before anything is enqueued."""
    specs: list[JobSpec] = []
    limit = max_payload_limit()  # read once, before any line: a bad OFFLOAD_MAX_PAYLOAD is not a line's fault
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            item = exactjson.loads(raw)  # an integer beyond 64 bits stays one, and enqueue refuses it by name
        except ValueError as exc:
            raise InvalidJob(f"line {n}: not valid JSON: {exc}") from None
        opts = dict(defaults)
        if isinstance(item, dict) and "input" in item:
            unknown = sorted(set(item) - {"input", *LINE_OPTIONS})
            if unknown:
                raise InvalidJob(
                    f"line {n}: unknown key(s) {', '.join(unknown)}; allowed: input, {', '.join(LINE_OPTIONS)}"
                )
            if "deadline" in item or "deadline_in" in item:  # a line's own deadline replaces --deadline
                opts.pop("deadline", None), opts.pop("deadline_in", None)
            opts.update({k: v for k, v in item.items() if k != "input"})
            item = item["input"]
        try:
            spec = JobSpec(input=item, **opts)
            validate_spec(spec, limit)
        except (OffloadError, TypeError) as exc:
            raise InvalidJob(f"line {n}: {exc}") from None
        specs.append(spec)
    return specs


async def _enqueue_bulk(store: QueueStore, queue: str, specs: list[JobSpec]) -> list[Enqueued]:
    columns = (TextColumn("enqueue"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    done: list[Enqueued] = []
    with Progress(*columns, console=err, disable=not err.is_terminal) as progress:
        task = progress.add_task("enqueue", total=len(specs))
        for i in range(0, len(specs), BULK_CHUNK):
            try:
                done += await store.enqueue_results(queue, specs[i : i + BULK_CHUNK])
            except StoreFull as exc:  # the count of the whole file, not of the chunk refused
                raise store_full(len(specs), [d.id for d in done] + exc.enqueued) from None
            progress.update(task, completed=len(done))
    return done


def _record_gone_note(ids: list[str]) -> None:
    """An idempotency key answered with a job that finished and whose record was trimmed: said on stderr, so a
    script reading the id from stdout is not confused, and a person is not surprised by `status` finding nothing."""
    if ids:
        err.print(
            f"{len(ids)} job(s) already ran under their idempotency key and their records were trimmed: "
            f"not enqueued again ({', '.join(ids[:3])}{' ...' if len(ids) > 3 else ''})"
        )


LinesFile = Annotated[
    typer.FileBinaryRead | None,
    typer.Option(
        "--file",
        "-f",
        metavar="PATH",
        help="JSON Lines ('-' for stdin): per line one input, or "
        '{"input": ..., options}. The options below become per-line defaults.',
    ),
]
Attach = Annotated[
    list[str] | None,
    typer.Option(
        "--attach",
        "-a",
        metavar="NAME=PATH",
        help="Upload a file to storage and put its reference in the input under NAME (repeatable).",
    ),
]


def enqueue(
    queue: QueueOpt,
    input: Annotated[str | None, typer.Option("--input", "-i", metavar="JSON", help="Job input.")] = None,
    file: LinesFile = None,
    priority: Annotated[int, typer.Option(min=-1000, max=1000, help="Higher runs first.")] = 0,
    delay: Annotated[float | None, typer.Option(min=0, help="Seconds before the job is ready.")] = None,
    max_attempts: Annotated[int, typer.Option(min=1)] = DEFAULT_MAX_ATTEMPTS,
    output_key: Annotated[str | None, typer.Option(help="Result key (default results/<id>.json).")] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Enqueueing the same key again returns the first job's id.")
    ] = None,
    deadline: Annotated[
        str | None,
        typer.Option(
            metavar="WHEN",
            help="The latest the job may start: a duration from now on the store's clock (2h, 90m, 1h30m, "
            "seconds) or an ISO 8601 time (2026-12-07T18:00Z). Past it the job fails `deadline passed`.",
        ),
    ] = None,
    max_cost: Annotated[
        float | None,
        typer.Option(min=0, help="USD: a submission the backend's price model says may cost more fails unsent."),
    ] = None,
    callback_url: Annotated[
        str | None,
        typer.Option(metavar="URL", help="Where the server POSTs a signed webhook when the job ends."),
    ] = None,
    attach: Attach = None,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Enqueue one job (prints its id) or a JSON Lines file (prints the count)."""
    if attach and input is None and file is None:
        input = "{}"
    if (input is None) == (file is None):
        raise typer.BadParameter("give exactly one of --input or --file")
    if attach and file is not None:
        raise typer.BadParameter("--attach adds files to one job's input: use it with --input")
    if file is not None and (idempotency_key or output_key):  # one value for every line would collide
        raise typer.BadParameter("--output-key and --idempotency-key name one job; set them per line")
    defaults: dict[str, Any] = {
        "priority": priority,
        "delay": delay,
        "max_attempts": max_attempts,
        "output_key": output_key,
        "idempotency_key": idempotency_key,
        "max_cost": max_cost,
        "callback_url": callback_url,
    }
    if deadline is not None:
        defaults["deadline"], defaults["deadline_in"] = parse_deadline(deadline)
    if input is not None:
        _enqueue_one(queue, input, attach, defaults, json_out, url, config)
        return
    assert file is not None
    _enqueue_file(queue, file, defaults, json_out, url)


def _enqueue_one(
    queue: str,
    input: str,
    attach: list[str] | None,
    defaults: dict[str, Any],
    json_out: bool,
    url: str | None,
    config: Path | None,
) -> None:
    try:
        value = exactjson.loads(input)
    except ValueError as exc:
        fail(f"--input is not valid JSON: {exc}")
    if attach:
        done = Enqueued(enqueue_attached(url, config, queue, value, attach, defaults))
    else:
        spec = JobSpec(input=value, **defaults)
        (done,) = run_store(url, lambda store: store.enqueue_results(queue, [spec]), queues=[queue], makes_work=True)
    if json_out:
        print_json({"id": done.id, "record_gone": done.record_gone})
        return
    _record_gone_note([done.id] if done.record_gone else [])
    typer.echo(done.id)


def _enqueue_file(queue: str, file: IO[bytes], defaults: dict[str, Any], json_out: bool, url: str | None) -> None:
    with errors():
        validate_queue(queue)
        specs = _parse_lines(iter(file), defaults)
    results = run_store(url, lambda store: _enqueue_bulk(store, queue, specs), makes_work=True)
    ids, gone = [d.id for d in results], [d.id for d in results if d.record_gone]
    if json_out:
        print_json({"count": len(ids), "ids": ids, "record_gone": gone})
        return
    _record_gone_note(gone)
    typer.echo(len(ids))


def status(job_id: JobArg, json_out: JsonOpt = False, url: UrlOpt = None) -> None:
    """Show one job's record and its attempts (a running lease's token is never shown: it authorises writes)."""
    caps = configured_caps()
    job, workers, capped, (kept, made) = run_store(
        url, lambda store: _job_and_workers(store, job_id, caps), jobs=[job_id]
    )
    record = job.to_dict()
    if json_out:
        print_json({**record, "attempt_history": {"made": made, "attempts": [a.to_dict() for a in kept]}})
        return
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in record.items():
        shown = when(value) if key in TIME_FIELDS else "-" if value is None else short(value, 2000)
        table.add_row(key, Text(cost_unknown(job) or shown if key == "cost" else shown))
    out().print(table)
    if workers is not None:
        who = f"{workers} worker(s) of the queue are alive" if workers else "no worker of the queue is alive"
        remote = f"remote job {job.remote_id}" if job.remote_id else "a submission whose outcome is unknown"
        wait = f"until a dispatch worker of queue {job.queue} claims this job, first in line, and cancels it"
        out().print(Text(f"cancel requested: {remote} may still run (and be paid) {wait}; {who}"))
    if capped:
        out().print(Text(f"queue {job.queue} is capped: its daily {capped} cap is reached; {CAPPED_WAIT}"))
    out().print(Text("attempts", style="bold"))
    show_attempts(kept, made)


async def _job_and_workers(
    store: QueueStore, job_id: str, caps: dict[str, CapLimits]
) -> tuple[Job, int | None, CapKind | None, tuple[list[Attempt], int]]:
    """The job and its attempts; for a waiting job whose cancel waits for a dispatch worker (cancel.lua) the live
    workers; for a waiting job, the cap its queue has reached."""
    job = await store.get(job_id)
    attempts = await store.attempts(job_id)
    waiting = not job.state.terminal and job.state.value not in ("active", "submitted")
    capped = await cap_reached(store, job.queue, caps.get(job.queue)) if waiting else None
    if not job.cancel_requested or not waiting:
        return job, None, capped, attempts
    return job, (await store.stats(job.queue)).workers, capped, attempts


async def _stats(store: QueueStore, queue: str, caps: dict[str, CapLimits]) -> QueueStats:
    stats = await store.stats(queue)
    stats = dataclasses.replace(stats, capped=await cap_reached(store, queue, caps.get(queue)))
    return await with_fleet_idle(store.redis, stats)


async def _snapshot(store: QueueStore, caps: dict[str, CapLimits]) -> list[QueueStats]:
    names = await store.queues()
    return list(await asyncio.gather(*(_stats(store, q, caps) for q in names)))


def _queues_table(stats: list[QueueStats]) -> Table:
    grid = listing()
    text_column(grid, "queue")
    for column in (*COUNT_COLUMNS, "workers", "oldest", *SPEND_COLUMNS):
        number_column(grid, column)
    for s in stats:
        status = f"capped: {s.capped}" if s.status == "capped" else s.status  # which cap: as the dashboard says
        name = Text(f"{s.queue} ({status})", style="yellow") if s.status != "running" else Text(s.queue)
        counts = (str(s.counts.get(c, 0)) for c in COUNT_COLUMNS)
        grid.add_row(name, *counts, str(s.workers), age(s.oldest_ready_age_ms), *spend_cells(s))
    return grid


def queues(
    json_out: JsonOpt = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 1.0,
    url: UrlOpt = None,
) -> None:
    """Counts per state for every queue, which are paused or capped (a daily cap of offload.yaml reached), and
    today's spend (the job store's UTC day) per kind of capacity: serverless, fleet, fleet idle. With --watch and
    --json, one JSON document per line per refresh."""
    caps = configured_caps()

    def emit(stats: list[QueueStats]) -> None:
        print_json([s.to_dict() for s in stats]) if json_out else show(_queues_table(stats))

    if not watch:
        emit(run_store(url, lambda store: _snapshot(store, caps)))
        return

    async def loop(store: QueueStore) -> None:
        console = out()
        try:
            if json_out or not console.is_terminal:  # a pipe gets a stream of snapshots, not cursor tricks
                while True:
                    emit(await _snapshot(store, caps))
                    await asyncio.sleep(interval)
            with Live(console=console, auto_refresh=False) as live:
                while True:
                    live.update(_queues_table(await _snapshot(store, caps)), refresh=True)
                    await asyncio.sleep(interval)
        except asyncio.CancelledError:  # Ctrl-C is how a watch ends: leave quietly with status 0
            return

    run_store(url, loop)


def ingest(
    from_list: Annotated[
        str,
        typer.Option(
            "--from-list",
            envvar="QUEUE_KEY",
            show_default=False,
            help="The tutorial's Redis list (default: $QUEUE_KEY).",
        ),
    ],
    queue: QueueOpt,
    follow: Annotated[bool, typer.Option("--follow", help="Keep draining until Ctrl-C.")] = False,
    max_attempts: Annotated[int, typer.Option(min=1)] = DEFAULT_MAX_ATTEMPTS,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
) -> None:
    """Move tutorial-format jobs (RPUSHed JSON) into the durable queue; malformed ones are dead-lettered."""

    async def drain(store: QueueStore) -> tuple[int, int]:
        ok_total = bad_total = 0
        try:
            while True:
                ok, bad = await store.ingest(from_list, queue, limit=INGEST_BATCH, max_attempts=max_attempts)
                ok_total, bad_total = ok_total + ok, bad_total + bad
                if follow and ok + bad:
                    err.print(f"ingested {ok_total}, malformed {bad_total}")
                if ok + bad < INGEST_BATCH:  # the list is empty (for now)
                    if not follow:
                        break
                    await asyncio.sleep(0.2)
        except asyncio.CancelledError:  # Ctrl-C ends --follow; still report the totals
            if not follow:
                raise
        return ok_total, bad_total

    ok, bad = run_store(url, drain, queues=[queue], makes_work=True)
    if json_out:
        print_json({"ingested": ok, "dead": bad})
    else:
        typer.echo(f"ingested {ok}" + (f", {bad} malformed (dead-lettered)" if bad else ""))


def register(app: typer.Typer) -> None:
    commands: dict[str, Callable[..., None]] = {
        "enqueue": enqueue,
        "status": status,
        "jobs": jobs_cmd,
        "queues": queues,
        "ingest": ingest,
        "result": result,
        "wait": wait,
    }
    for name, command in commands.items():
        app.command(name)(command)
