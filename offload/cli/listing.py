"""`offload jobs QUEUE [--state S]` and the listings of `dead list` and `held list`: one page of jobs as a table
(or `--json`), and the cursor of the next page on stderr."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from offload.cli.options import CursorOpt, JsonOpt, LimitOpt, QueueArg, UrlOpt
from offload.cli.output import err, listing, number_column, print_json, short, show, text_column, when
from offload.cli.session import run_store
from offload.errors import InvalidJob
from offload.models import Job
from offload.queue.listing import LISTABLE_STATES, check_state


def jobs_table(jobs: list[Job]) -> Table:
    grid = listing()
    for name in ("id", "state"):
        text_column(grid, name)
    for name in ("tries", "prio"):
        number_column(grid, name)
    for name in ("finished/created", "error"):
        text_column(grid, name)
    for j in jobs:
        shown = when(j.finished_at or j.created_at)
        tries = f"{j.attempts}/{j.max_attempts}"
        grid.add_row(Text(j.id), j.state.value, tries, str(j.priority), shown, Text(short(j.error or "", 60)))
    return grid


def list_page(url: str | None, queue: str, state: str | None, limit: int, cursor: int, json_out: bool) -> None:
    """One page of a queue's jobs (an unknown queue is an error, naming the closest known one)."""
    jobs, next_cursor = run_store(
        url, lambda store: store.list_jobs(queue, state, cursor=cursor, limit=limit), known=[queue]
    )
    if json_out:
        print_json({"jobs": [j.to_dict() for j in jobs], "next_cursor": next_cursor})
        return
    show(jobs_table(jobs))
    if next_cursor is not None:
        err.print(f"more: --cursor {next_cursor}")


def jobs_cmd(
    queue: QueueArg,
    state: Annotated[
        str | None,
        typer.Option(help=f"Only jobs in this state: {', '.join(LISTABLE_STATES)}.", show_default="every state"),
    ] = None,
    limit: LimitOpt = 50,
    cursor: CursorOpt = 0,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
) -> None:
    """List a queue's jobs: all of them newest first, or in one state (waiting states oldest first, finished ones
    newest first). Without --state every job's creation time is read: on a queue of millions, give --state."""
    try:
        check_state(state)
    except InvalidJob as exc:  # a usage mistake, reported as Typer reports the others (exit 2)
        raise typer.BadParameter(str(exc), param_hint="--state") from None
    list_page(url, queue, state, limit, cursor, json_out)
