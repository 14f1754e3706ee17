"""Commands on the job store: enqueue, status, jobs, queues, dead, held, pause, resume, cancel, purge, ingest, result.

Every command connects, does one thing through `QueueStore` and closes the connection. Output is meant for
two readers: people get rich tables, scripts get `--json` (one document on stdout) or a bare id/count.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import orjson
import typer
from rich import box
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from offload.caps import CAPPED_WAIT, CapKind, CapLimits, cap_reached
from offload.cli.attach import enqueue_attached
from offload.cli.errors import errors, fail
from offload.cli.options import (
    AllOpt,
    ConfigOpt,
    CursorOpt,
    IdsArg,
    JobArg,
    JsonOpt,
    LimitOpt,
    QueueArg,
    QueueOpt,
    UrlOpt,
)
from offload.cli.output import err, out, print_json
from offload.cli.results import result, wait
from offload.cli.session import configured_caps, run_redis
from offload.errors import InvalidJob, OffloadError, StoreFull
from offload.models import Enqueued, Job, QueueStats
from offload.queue.keys import STATE_SETS, queue_of, validate_queue
from offload.queue.memory import store_full
from offload.queue.specs import DEFAULT_MAX_ATTEMPTS, JobSpec, max_payload_limit, validate_spec
from offload.queue.store import QueueStore

T = TypeVar("T")

BULK_CHUNK = 10_000  # jobs per enqueue_many call: bounds memory per round trip and paces the progress bar
MOVE_BATCH = 1_000
INGEST_BATCH = 1_000
LINE_OPTIONS = ("priority", "delay", "max_attempts", "output_key", "idempotency_key")
TIME_FIELDS = ("created_at", "run_at", "started_at", "finished_at", "lease_deadline", "intent_at")
COUNT_COLUMNS = ("queued", "delayed", "active", "submitted", "retrying", "held", "succeeded", "dead", "cancelled")

dead_app = typer.Typer(no_args_is_help=True, help="Dead-lettered jobs: list, requeue, purge.")
held_app = typer.Typer(no_args_is_help=True, help="Jobs held over a cap: list, release.")


def _run(
    url: str | None,
    fn: Callable[[QueueStore], Awaitable[T]],
    *,
    queues: Sequence[str] = (),
    jobs: Sequence[str] = (),
    config: Path | None = None,
    makes_work: bool = False,
) -> T:
    """Validate names first (a typo should not wait out a connect timeout), then connect, run, close. A command
    that adds or restarts jobs (`makes_work`) refuses a store that may evict."""
    with errors():
        for queue in queues:
            validate_queue(queue)
        for job_id in jobs:
            queue_of(job_id)
    return run_redis(url, lambda redis: fn(QueueStore(redis)), config=config, makes_work=makes_work)


def _when(ms: int | None) -> str:
    return "-" if ms is None else datetime.fromtimestamp(ms / 1000).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _age(ms: int | None) -> str:
    if ms is None:
        return "-"
    s = ms // 1000
    if s < 60:
        return f"{ms / 1000:.1f}s"
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def _short(value: Any, width: int = 80) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text if len(text) <= width else text[: width - 1] + "…"


def _parse_lines(lines: Iterator[bytes], defaults: dict[str, Any]) -> list[JobSpec]:
    """A line is a bare JSON input, or {"input": ..., <JobSpec options>} to set options per job. Every line
    is checked by the store's own validation before anything is enqueued."""
    specs: list[JobSpec] = []
    limit = max_payload_limit()  # read once, before any line: a bad OFFLOAD_MAX_PAYLOAD is not a line's fault
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidJob(f"line {n}: not valid JSON: {exc}") from None
        opts = dict(defaults)
        if isinstance(item, dict) and "input" in item:
            unknown = sorted(set(item) - {"input", *LINE_OPTIONS})
            if unknown:
                raise InvalidJob(
                    f"line {n}: unknown key(s) {', '.join(unknown)}; allowed: input, {', '.join(LINE_OPTIONS)}"
                )
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


def enqueue(
    queue: QueueOpt,
    input: Annotated[str | None, typer.Option("--input", "-i", metavar="JSON", help="Job input.")] = None,
    file: Annotated[
        typer.FileBinaryRead | None,
        typer.Option(
            "--file",
            "-f",
            metavar="PATH",
            help="JSON Lines ('-' for stdin): per line one input, or "
            '{"input": ..., options}. The options below become per-line defaults.',
        ),
    ] = None,
    priority: Annotated[int, typer.Option(min=-1000, max=1000, help="Higher runs first.")] = 0,
    delay: Annotated[float | None, typer.Option(min=0, help="Seconds before the job is ready.")] = None,
    max_attempts: Annotated[int, typer.Option(min=1)] = DEFAULT_MAX_ATTEMPTS,
    output_key: Annotated[str | None, typer.Option(help="Result key (default results/<id>.json).")] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Enqueueing the same key again returns the first job's id.")
    ] = None,
    attach: Annotated[
        list[str] | None,
        typer.Option(
            "--attach",
            "-a",
            metavar="NAME=PATH",
            help="Upload a file to storage and put its reference in the input under NAME (repeatable).",
        ),
    ] = None,
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
    }
    if input is not None:
        try:
            value = orjson.loads(input)
        except orjson.JSONDecodeError as exc:
            fail(f"--input is not valid JSON: {exc}")
        if attach:
            done = Enqueued(enqueue_attached(url, config, queue, value, attach, defaults))
        else:
            spec = JobSpec(input=value, **defaults)
            (done,) = _run(url, lambda store: store.enqueue_results(queue, [spec]), queues=[queue], makes_work=True)
        if json_out:
            print_json({"id": done.id, "record_gone": done.record_gone})
            return
        _record_gone_note([done.id] if done.record_gone else [])
        typer.echo(done.id)
        return
    assert file is not None
    with errors():
        validate_queue(queue)
        specs = _parse_lines(iter(file), defaults)
    results = _run(url, lambda store: _enqueue_bulk(store, queue, specs), makes_work=True)
    ids, gone = [d.id for d in results], [d.id for d in results if d.record_gone]
    if json_out:
        print_json({"count": len(ids), "ids": ids, "record_gone": gone})
        return
    _record_gone_note(gone)
    typer.echo(len(ids))


def status(job_id: JobArg, json_out: JsonOpt = False, url: UrlOpt = None) -> None:
    """Show one job's record (the lease token is never shown: it authorises writes)."""
    caps = configured_caps()
    job, workers, capped = _run(url, lambda store: _job_and_workers(store, job_id, caps), jobs=[job_id])
    record = job.to_dict()
    if json_out:
        print_json(record)
        return
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in record.items():
        shown = _when(value) if key in TIME_FIELDS else "-" if value is None else _short(value, 2000)
        table.add_row(key, Text(shown))
    out().print(table)
    if workers is not None:
        who = f"{workers} worker(s) of the queue are alive" if workers else "no worker of the queue is alive"
        remote = f"remote job {job.remote_id}" if job.remote_id else "a submission whose outcome is unknown"
        wait = f"until a dispatch worker of queue {job.queue} claims this job, first in line, and cancels it"
        out().print(Text(f"cancel requested: {remote} may still run (and be paid) {wait}; {who}"))
    if capped:
        out().print(Text(f"queue {job.queue} is capped: its daily {capped} cap is reached; {CAPPED_WAIT}"))


async def _job_and_workers(
    store: QueueStore, job_id: str, caps: dict[str, CapLimits]
) -> tuple[Job, int | None, CapKind | None]:
    """The job; for a waiting job whose cancel waits for a dispatch worker (cancel.lua) the live workers; for a
    waiting job, the cap its queue has reached."""
    job = await store.get(job_id)
    waiting = not job.state.terminal and job.state.value not in ("active", "submitted")
    capped = await cap_reached(store, job.queue, caps.get(job.queue)) if waiting else None
    if not job.cancel_requested or not waiting:
        return job, None, capped
    return job, (await store.stats(job.queue)).workers, capped


def _jobs_table(jobs: list[Job]) -> Table:
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("id", no_wrap=True, min_width=max((len(j.id) for j in jobs), default=2))  # never cut ids
    for name in ("state", "tries", "prio", "finished/created", "error"):
        table.add_column(name)
    for j in jobs:
        table.add_row(
            Text(j.id),
            j.state.value,
            f"{j.attempts}/{j.max_attempts}",
            str(j.priority),
            _when(j.finished_at or j.created_at),
            Text(_short(j.error or "", 60)),
        )
    return table


def _list(url: str | None, queue: str, state: str, limit: int, cursor: int, json_out: bool) -> None:
    jobs, next_cursor = _run(
        url, lambda store: store.list_jobs(queue, state, cursor=cursor, limit=limit), queues=[queue]
    )
    if json_out:
        print_json({"jobs": [j.to_dict() for j in jobs], "next_cursor": next_cursor})
        return
    out().print(_jobs_table(jobs))
    if next_cursor is not None:
        err.print(f"more: --cursor {next_cursor}")


def jobs_cmd(
    queue: QueueArg,
    state: Annotated[str, typer.Option(help=f"One of: {', '.join(STATE_SETS)}.", show_default=False)],
    limit: LimitOpt = 50,
    cursor: CursorOpt = 0,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
) -> None:
    """List a queue's jobs in one state (waiting states oldest first, finished ones newest first)."""
    if state not in STATE_SETS:
        raise typer.BadParameter(f"unknown state {state!r}; choose one of: {', '.join(STATE_SETS)}")
    _list(url, queue, state, limit, cursor, json_out)


async def _stats(store: QueueStore, queue: str, caps: dict[str, CapLimits]) -> QueueStats:
    stats = await store.stats(queue)
    return dataclasses.replace(stats, capped=await cap_reached(store, queue, caps.get(queue)))


async def _snapshot(store: QueueStore, caps: dict[str, CapLimits]) -> list[QueueStats]:
    names = await store.queues()
    return list(await asyncio.gather(*(_stats(store, q, caps) for q in names)))


def _queues_table(stats: list[QueueStats]) -> Table:
    table = Table(box=box.SIMPLE_HEAD)
    names = [Text(f"{s.queue} ({s.status})", style="yellow") if s.status != "running" else Text(s.queue) for s in stats]
    table.add_column("queue", no_wrap=True, min_width=max((len(n) for n in names), default=5))
    for column in (*COUNT_COLUMNS, "workers", "oldest"):
        table.add_column(column, justify="right")
    for name, s in zip(names, stats, strict=True):
        table.add_row(
            name, *(str(s.counts.get(c, 0)) for c in COUNT_COLUMNS), str(s.workers), _age(s.oldest_ready_age_ms)
        )
    return table


def queues(
    json_out: JsonOpt = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 1.0,
    url: UrlOpt = None,
) -> None:
    """Counts per state for every queue, and which are paused or capped (a daily cap of offload.yaml reached).
    With --watch and --json, one JSON document per line per refresh."""
    caps = configured_caps()

    def show(stats: list[QueueStats]) -> None:
        print_json([s.to_dict() for s in stats]) if json_out else out().print(_queues_table(stats))

    if not watch:
        show(_run(url, lambda store: _snapshot(store, caps)))
        return

    async def loop(store: QueueStore) -> None:
        console = out()
        try:
            if json_out or not console.is_terminal:  # a pipe gets a stream of snapshots, not cursor tricks
                while True:
                    show(await _snapshot(store, caps))
                    await asyncio.sleep(interval)
            with Live(console=console, auto_refresh=False) as live:
                while True:
                    live.update(_queues_table(await _snapshot(store, caps)), refresh=True)
                    await asyncio.sleep(interval)
        except asyncio.CancelledError:  # Ctrl-C is how a watch ends: leave quietly with status 0
            return

    _run(url, loop)


def _move(url: str | None, queue: str, state: str, job_ids: list[str] | None, all_: bool, json_out: bool) -> None:
    """Requeue dead or release held jobs. --all is bounded by the count at the start, so jobs that
    fail straight back into the set (e.g. malformed input) cannot keep the command looping."""
    ids = job_ids or []
    if bool(ids) == all_:
        raise typer.BadParameter("give job ids or --all (not both)")

    async def go(store: QueueStore) -> list[str]:
        move = store.requeue_dead if state == "dead" else store.release
        if ids:
            return await move(queue, ids)
        budget = (await store.stats(queue)).counts[state]
        moved: list[str] = []
        while len(moved) < budget:
            batch = await move(queue, limit=min(MOVE_BATCH, budget - len(moved)))
            if not batch:
                break
            moved += batch
        return moved

    moved = _run(url, go, queues=[queue], jobs=ids, makes_work=True)
    verb = "requeued" if state == "dead" else "released"
    print_json({verb: moved}) if json_out else typer.echo(f"{verb} {len(moved)}")
    missing = sorted(set(ids) - set(moved))
    if missing:
        fail(f"{len(missing)} job(s) not {state} in queue {queue}: {', '.join(missing)}")


@dead_app.command("list")
def dead_list(
    queue: QueueArg, limit: LimitOpt = 50, cursor: CursorOpt = 0, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """Dead-lettered jobs, newest first, with the reason they died."""
    _list(url, queue, "dead", limit, cursor, json_out)


@dead_app.command("requeue")
def dead_requeue(
    queue: QueueArg, job_ids: IdsArg = None, all_: AllOpt = False, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """Send dead jobs back to the queue with a fresh attempt budget."""
    _move(url, queue, "dead", job_ids, all_, json_out)


@dead_app.command("purge")
def dead_purge(queue: QueueArg, url: UrlOpt = None) -> None:
    """Delete every dead job of the queue (records included)."""
    typer.echo(f"purged {_run(url, lambda store: store.purge(queue, 'dead'), queues=[queue])}")


@held_app.command("list")
def held_list(
    queue: QueueArg, limit: LimitOpt = 50, cursor: CursorOpt = 0, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """Jobs held because a cap was reached, oldest first."""
    _list(url, queue, "held", limit, cursor, json_out)


@held_app.command("release")
def held_release(
    queue: QueueArg, job_ids: IdsArg = None, all_: AllOpt = False, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """Make held jobs ready now instead of waiting for the cap window to reset."""
    _move(url, queue, "held", job_ids, all_, json_out)


def pause(queue: QueueArg, url: UrlOpt = None) -> None:
    """Stop workers claiming from the queue; enqueueing still works."""
    _run(url, lambda store: store.pause(queue), queues=[queue])
    typer.echo(f"paused {queue}")


def resume(queue: QueueArg, url: UrlOpt = None) -> None:
    """Let workers claim from a paused queue again."""
    _run(url, lambda store: store.resume(queue), queues=[queue], makes_work=True)
    typer.echo(f"resumed {queue}")


def cancel(job_id: JobArg, url: UrlOpt = None) -> None:
    """Cancel a job: at once if it waits with nothing remote, else a worker cancels the remote job first (the
    one holding it, or the next to claim it) and then acknowledges: `offload status` shows it meanwhile."""
    code = _run(url, lambda store: store.cancel(job_id), jobs=[job_id])
    typer.echo("cancelled" if code == "cancelled" else "cancel requested")


def purge(
    queue: QueueArg,
    state: Annotated[str, typer.Option(help="State to delete.", show_default=False)],
    url: UrlOpt = None,
) -> None:
    """Delete every job of the queue in one state (active jobs cannot be purged)."""
    typer.echo(f"purged {_run(url, lambda store: store.purge(queue, state), queues=[queue])}")


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

    ok, bad = _run(url, drain, queues=[queue], makes_work=True)
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
        "pause": pause,
        "resume": resume,
        "cancel": cancel,
        "purge": purge,
        "ingest": ingest,
        "result": result,
        "wait": wait,
    }
    for name, command in commands.items():
        app.command(name)(command)
    app.add_typer(dead_app, name="dead")
    app.add_typer(held_app, name="held")
