"""The `offload` command line: enqueue, inspect and operate queues from a shell or a script.

Every command connects, does one thing through `QueueStore` and closes the connection. Output is meant for
two readers: people get rich tables, scripts get `--json` (one document on stdout) or a bare id/count.
Problems an operator can cause (bad input, unknown job, unreachable Redis) end in one `error: ...` line on
stderr and exit code 1, never a traceback; Typer reports usage mistakes itself with exit code 2.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import datetime
from typing import Annotated, Any, TypeVar

import orjson
import typer
from rich import box
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from offload.autoscale_cli import register as register_autoscale
from offload.cli_errors import _errors, _fail
from offload.connection import connect
from offload.embedded import data_dir, ensure_embedded, running_url, stop_embedded
from offload.errors import InvalidJob, OffloadError
from offload.models import Job, QueueStats
from offload.pipeline_cli import register as register_pipeline
from offload.queue.keys import STATE_SETS, queue_of, validate_queue
from offload.queue.store import DEFAULT_MAX_ATTEMPTS, JobSpec, QueueStore
from offload.server_cli import register as register_server
from offload.sim.cli import sim_app

T = TypeVar("T")

BULK_CHUNK = 10_000  # jobs per enqueue_many call: bounds memory per round trip and paces the progress bar
MOVE_BATCH = 1_000
INGEST_BATCH = 1_000
LINE_OPTIONS = ("priority", "delay", "max_attempts", "output_key", "idempotency_key")
TIME_FIELDS = ("created_at", "run_at", "started_at", "finished_at", "lease_deadline", "intent_at")
COUNT_COLUMNS = ("queued", "delayed", "active", "submitted", "retrying", "held", "succeeded", "dead",
                 "cancelled")

# Consoles resolve sys.stdout/sys.stderr at write time, so test runners that swap the streams still work.
err = Console(stderr=True, highlight=False)

app = typer.Typer(
    name="offload", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="A durable GPU job queue on Redis/Valkey.",
)
dead_app = typer.Typer(no_args_is_help=True, help="Dead-lettered jobs: list, requeue, purge.")
held_app = typer.Typer(no_args_is_help=True, help="Jobs held over a cap: list, release.")
embedded_app = typer.Typer(no_args_is_help=True, help="The embedded Valkey under ./.offload (OFFLOAD_HOME).")
app.add_typer(dead_app, name="dead")
app.add_typer(held_app, name="held")
app.add_typer(embedded_app, name="embedded")
app.add_typer(sim_app, name="sim")
register_pipeline(app)
register_server(app)
register_autoscale(app)

UrlOpt = Annotated[str | None, typer.Option(
    "--url", show_default=False,
    help="Redis/Valkey URL. Default: OFFLOAD_REDIS_URL, else REDIS_URL, else the embedded server.",
)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")]
QueueArg = Annotated[str, typer.Argument(help="Queue name.", show_default=False)]
LimitOpt = Annotated[int, typer.Option(min=1, max=1000, help="Jobs per page.")]
CursorOpt = Annotated[int, typer.Option(min=0, help="Page start, from a previous listing's next cursor.")]
IdsArg = Annotated[list[str] | None, typer.Argument(help="Job ids (or use --all).", show_default=False)]
AllOpt = Annotated[bool, typer.Option("--all", help="Every job in the set.")]


def _run(
    url: str | None, fn: Callable[[QueueStore], Awaitable[T]], *,
    queues: Sequence[str] = (), jobs: Sequence[str] = (),
) -> T:
    """Validate names first (a typo should not wait out a connect timeout), then connect, run, close."""

    async def session() -> T:
        client = await connect(url)
        try:
            return await fn(QueueStore(client))
        finally:
            await client.aclose()

    with _errors():
        for queue in queues:
            validate_queue(queue)
        for job_id in jobs:
            queue_of(job_id)
        return asyncio.run(session())
    raise AssertionError("unreachable")  # _errors either returns above or exits


def _out() -> Console:
    """Rich squeezes tables into 80 columns when stdout is no terminal; a pipe or file has no such limit."""
    if sys.stdout.isatty():
        return Console(highlight=False)
    return Console(highlight=False, width=max(200, int(os.environ.get("COLUMNS", "0") or 0)))


def _print_json(doc: Any) -> None:
    sys.stdout.write(orjson.dumps(doc).decode() + "\n")
    sys.stdout.flush()


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
    checker = QueueStore(None)
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
                raise InvalidJob(f"line {n}: unknown key(s) {', '.join(unknown)}; "
                                 f"allowed: input, {', '.join(LINE_OPTIONS)}")
            opts.update({k: v for k, v in item.items() if k != "input"})
            item = item["input"]
        try:
            spec = JobSpec(input=item, **opts)
            checker.validate(spec)
        except (OffloadError, TypeError) as exc:
            raise InvalidJob(f"line {n}: {exc}") from None
        specs.append(spec)
    return specs


async def _enqueue_bulk(store: QueueStore, queue: str, specs: list[JobSpec]) -> list[str]:
    columns = (TextColumn("enqueue"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    ids: list[str] = []
    with Progress(*columns, console=err, disable=not err.is_terminal) as progress:
        task = progress.add_task("enqueue", total=len(specs))
        for i in range(0, len(specs), BULK_CHUNK):
            ids += await store.enqueue_many(queue, specs[i : i + BULK_CHUNK])
            progress.update(task, completed=len(ids))
    return ids


@app.command()
def enqueue(
    queue: Annotated[str, typer.Option("--queue", "-q", help="Queue name.", show_default=False)],
    input: Annotated[str | None, typer.Option("--input", "-i", metavar="JSON", help="Job input.")] = None,
    file: Annotated[typer.FileBinaryRead | None, typer.Option(
        "--file", "-f", metavar="PATH", help="JSON Lines ('-' for stdin): per line one input, or "
        '{"input": ..., options}. The options below become per-line defaults.')] = None,
    priority: Annotated[int, typer.Option(min=-1000, max=1000, help="Higher runs first.")] = 0,
    delay: Annotated[float | None, typer.Option(min=0, help="Seconds before the job is ready.")] = None,
    max_attempts: Annotated[int, typer.Option(min=1)] = DEFAULT_MAX_ATTEMPTS,
    output_key: Annotated[str | None, typer.Option(help="Result key (default results/<id>.json).")] = None,
    idempotency_key: Annotated[str | None, typer.Option(
        help="Enqueueing the same key again returns the first job's id.")] = None,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
) -> None:
    """Enqueue one job (prints its id) or a JSON Lines file (prints the count)."""
    if (input is None) == (file is None):
        raise typer.BadParameter("give exactly one of --input or --file")
    if file is not None and (idempotency_key or output_key):  # one value for every line would collide
        raise typer.BadParameter("--output-key and --idempotency-key name one job; set them per line")
    defaults: dict[str, Any] = {"priority": priority, "delay": delay, "max_attempts": max_attempts,
                                "output_key": output_key, "idempotency_key": idempotency_key}
    if input is not None:
        try:
            value = orjson.loads(input)
        except orjson.JSONDecodeError as exc:
            _fail(f"--input is not valid JSON: {exc}")
        spec = JobSpec(input=value, **defaults)
        job_id = _run(url, lambda store: store.enqueue(queue, spec), queues=[queue])
        _print_json({"id": job_id}) if json_out else typer.echo(job_id)
        return
    assert file is not None
    with _errors():
        validate_queue(queue)
        specs = _parse_lines(iter(file), defaults)
    ids = _run(url, lambda store: _enqueue_bulk(store, queue, specs))
    _print_json({"count": len(ids), "ids": ids}) if json_out else typer.echo(len(ids))


@app.command()
def status(job_id: Annotated[str, typer.Argument(help="Job id.")], json_out: JsonOpt = False,
           url: UrlOpt = None) -> None:
    """Show one job's record (the lease token is never shown: it authorises writes)."""
    job = _run(url, lambda store: store.get(job_id), jobs=[job_id])
    record = job.to_dict()
    if json_out:
        _print_json(record)
        return
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in record.items():
        shown = _when(value) if key in TIME_FIELDS else "-" if value is None else _short(value, 2000)
        table.add_row(key, Text(shown))
    _out().print(table)


def _jobs_table(jobs: list[Job]) -> Table:
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("id", no_wrap=True, min_width=max((len(j.id) for j in jobs), default=2))  # never cut ids
    for name in ("state", "tries", "prio", "finished/created", "error"):
        table.add_column(name)
    for j in jobs:
        table.add_row(Text(j.id), j.state.value, f"{j.attempts}/{j.max_attempts}", str(j.priority),
                      _when(j.finished_at or j.created_at), Text(_short(j.error or "", 60)))
    return table


def _list(url: str | None, queue: str, state: str, limit: int, cursor: int, json_out: bool) -> None:
    jobs, next_cursor = _run(
        url, lambda store: store.list_jobs(queue, state, cursor=cursor, limit=limit), queues=[queue]
    )
    if json_out:
        _print_json({"jobs": [j.to_dict() for j in jobs], "next_cursor": next_cursor})
        return
    _out().print(_jobs_table(jobs))
    if next_cursor is not None:
        err.print(f"more: --cursor {next_cursor}")


@app.command("jobs")
def jobs_cmd(
    queue: QueueArg,
    state: Annotated[str, typer.Option(help=f"One of: {', '.join(STATE_SETS)}.", show_default=False)],
    limit: LimitOpt = 50, cursor: CursorOpt = 0, json_out: JsonOpt = False, url: UrlOpt = None,
) -> None:
    """List a queue's jobs in one state (waiting states oldest first, finished ones newest first)."""
    if state not in STATE_SETS:
        raise typer.BadParameter(f"unknown state {state!r}; choose one of: {', '.join(STATE_SETS)}")
    _list(url, queue, state, limit, cursor, json_out)


async def _snapshot(store: QueueStore) -> list[QueueStats]:
    names = await store.queues()
    return list(await asyncio.gather(*(store.stats(q) for q in names)))


def _queues_table(stats: list[QueueStats]) -> Table:
    table = Table(box=box.SIMPLE_HEAD)
    names = [Text(s.queue + " (paused)", style="yellow") if s.paused else Text(s.queue) for s in stats]
    table.add_column("queue", no_wrap=True, min_width=max((len(n) for n in names), default=5))
    for column in (*COUNT_COLUMNS, "workers", "oldest"):
        table.add_column(column, justify="right")
    for name, s in zip(names, stats, strict=True):
        table.add_row(name, *(str(s.counts.get(c, 0)) for c in COUNT_COLUMNS), str(s.workers),
                      _age(s.oldest_ready_age_ms))
    return table


@app.command()
def queues(
    json_out: JsonOpt = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 1.0,
    url: UrlOpt = None,
) -> None:
    """Counts per state for every queue. With --watch and --json, one JSON document per line per refresh."""

    def show(stats: list[QueueStats]) -> None:
        _print_json([s.to_dict() for s in stats]) if json_out else _out().print(_queues_table(stats))

    if not watch:
        show(_run(url, _snapshot))
        return

    async def loop(store: QueueStore) -> None:
        out = _out()
        try:
            if json_out or not out.is_terminal:  # a pipe gets a stream of snapshots, not cursor tricks
                while True:
                    show(await _snapshot(store))
                    await asyncio.sleep(interval)
            with Live(console=out, auto_refresh=False) as live:
                while True:
                    live.update(_queues_table(await _snapshot(store)), refresh=True)
                    await asyncio.sleep(interval)
        except asyncio.CancelledError:  # Ctrl-C is how a watch ends: leave quietly with status 0
            return

    _run(url, loop)


def _move(url: str | None, queue: str, state: str, job_ids: list[str] | None, all_: bool,
          json_out: bool) -> None:
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

    moved = _run(url, go, queues=[queue], jobs=ids)
    verb = "requeued" if state == "dead" else "released"
    _print_json({verb: moved}) if json_out else typer.echo(f"{verb} {len(moved)}")
    missing = sorted(set(ids) - set(moved))
    if missing:
        _fail(f"{len(missing)} job(s) not {state} in queue {queue}: {', '.join(missing)}")


@dead_app.command("list")
def dead_list(queue: QueueArg, limit: LimitOpt = 50, cursor: CursorOpt = 0, json_out: JsonOpt = False,
              url: UrlOpt = None) -> None:
    """Dead-lettered jobs, newest first, with the reason they died."""
    _list(url, queue, "dead", limit, cursor, json_out)


@dead_app.command("requeue")
def dead_requeue(queue: QueueArg, job_ids: IdsArg = None, all_: AllOpt = False, json_out: JsonOpt = False,
                 url: UrlOpt = None) -> None:
    """Send dead jobs back to the queue with a fresh attempt budget."""
    _move(url, queue, "dead", job_ids, all_, json_out)


@dead_app.command("purge")
def dead_purge(queue: QueueArg, url: UrlOpt = None) -> None:
    """Delete every dead job of the queue (records included)."""
    typer.echo(f"purged {_run(url, lambda store: store.purge(queue, 'dead'), queues=[queue])}")


@held_app.command("list")
def held_list(queue: QueueArg, limit: LimitOpt = 50, cursor: CursorOpt = 0, json_out: JsonOpt = False,
              url: UrlOpt = None) -> None:
    """Jobs held because a cap was reached, oldest first."""
    _list(url, queue, "held", limit, cursor, json_out)


@held_app.command("release")
def held_release(queue: QueueArg, job_ids: IdsArg = None, all_: AllOpt = False, json_out: JsonOpt = False,
                 url: UrlOpt = None) -> None:
    """Make held jobs ready now instead of waiting for the cap window to reset."""
    _move(url, queue, "held", job_ids, all_, json_out)


@app.command()
def pause(queue: QueueArg, url: UrlOpt = None) -> None:
    """Stop workers claiming from the queue; enqueueing still works."""
    _run(url, lambda store: store.pause(queue), queues=[queue])
    typer.echo(f"paused {queue}")


@app.command()
def resume(queue: QueueArg, url: UrlOpt = None) -> None:
    """Let workers claim from a paused queue again."""
    _run(url, lambda store: store.resume(queue), queues=[queue])
    typer.echo(f"resumed {queue}")


@app.command()
def cancel(job_id: Annotated[str, typer.Argument(help="Job id.")], url: UrlOpt = None) -> None:
    """Cancel a job: at once if it waits, else its worker cancels the remote job and acknowledges."""
    code = _run(url, lambda store: store.cancel(job_id), jobs=[job_id])
    typer.echo("cancelled" if code == "cancelled" else "cancel requested")


@app.command()
def purge(queue: QueueArg, state: Annotated[str, typer.Option(help="State to delete.", show_default=False)],
          url: UrlOpt = None) -> None:
    """Delete every job of the queue in one state (active jobs cannot be purged)."""
    typer.echo(f"purged {_run(url, lambda store: store.purge(queue, state), queues=[queue])}")


@app.command()
def ingest(
    from_list: Annotated[str, typer.Option("--from-list", envvar="QUEUE_KEY", show_default=False,
                                           help="The tutorial's Redis list (default: $QUEUE_KEY).")],
    queue: Annotated[str, typer.Option("--queue", "-q", help="Queue name.", show_default=False)],
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

    ok, bad = _run(url, drain, queues=[queue])
    if json_out:
        _print_json({"ingested": ok, "dead": bad})
    else:
        typer.echo(f"ingested {ok}" + (f", {bad} malformed (dead-lettered)" if bad else ""))


@embedded_app.command("status")
def embedded_status(json_out: JsonOpt = False) -> None:
    """Whether the embedded Valkey runs, and where."""
    url = running_url()
    running = url is not None
    home = str(data_dir())
    if json_out:
        _print_json({"running": running, "url": url if running else None, "data_dir": home})
    else:
        typer.echo(f"{f'running at {url}' if running else 'not running'} (data in {home})")


@embedded_app.command("start")
def embedded_start() -> None:
    """Start the embedded Valkey if needed and print its URL (other commands also start it on demand)."""
    with _errors():
        typer.echo(ensure_embedded())


@embedded_app.command("stop")
def embedded_stop() -> None:
    """Stop the embedded Valkey; its data stays on disk (AOF) for the next start."""
    with _errors():
        typer.echo("stopped" if stop_embedded() else "not running")


@app.command()
def demo(jobs: Annotated[int, typer.Option(min=1, max=10_000, help="Jobs to run.")] = 40) -> None:
    """Run a batch end to end on the local stack (started if needed) and show where the results are."""
    from offload.demo import run_demo

    with _errors():
        asyncio.run(run_demo(_out(), jobs))


@app.command()
def up(
    workers: Annotated[int, typer.Option(min=1, max=64, help="Dispatch worker processes.")] = 2,
    latency: Annotated[str, typer.Option(help="Simulated GPU job time: 2, 1-3 or lognormal:2:0.5.")] = "1-3",
) -> None:
    """Start the local stack in the background: Valkey, S3, the GPU API simulator, N workers (./.offload/)."""
    from offload.stack import up as stack_up

    with _errors():
        for name, where in stack_up(workers=workers, latency=latency):
            typer.echo(f"{name:<10} {where}")


@app.command()
def down() -> None:
    """Stop the local stack (workers drain first); data stays under ./.offload/."""
    from offload.stack import down as stack_down

    with _errors():
        typer.echo("stopped: " + (", ".join(stack_down()) or "nothing was running"))


def main() -> None:
    """Console-script entry point (`offload = "offload.cli:main"`)."""
    app(prog_name="offload")
