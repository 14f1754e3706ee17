"""Operating a queue's jobs: dead and held jobs (list, requeue, release, purge), pause, resume, cancel, purge.

The commands that delete in bulk (`purge`, `dead purge`) ask first, with `--yes` and `--dry-run` (cli/confirm.py);
every command but `pause` (which may name a queue before its first job) refuses a queue that does not exist.
"""

from __future__ import annotations

from typing import Annotated

import typer

from offload.cli.confirm import confirmed
from offload.cli.errors import errors, fail
from offload.cli.listing import list_page
from offload.cli.options import (
    AllOpt,
    CursorOpt,
    DryRunOpt,
    IdsArg,
    JobArg,
    JsonOpt,
    LimitOpt,
    QueueArg,
    UrlOpt,
    YesOpt,
)
from offload.cli.output import print_json
from offload.cli.session import run_store
from offload.queue.listing import check_purgeable
from offload.queue.store import QueueStore

MOVE_BATCH = 1_000

dead_app = typer.Typer(no_args_is_help=True, help="Dead-lettered jobs: list, requeue, purge.")
held_app = typer.Typer(no_args_is_help=True, help="Jobs held over a cap: list, release.")


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

    moved = run_store(url, go, known=[queue], jobs=ids, makes_work=True)
    verb = "requeued" if state == "dead" else "released"
    print_json({verb: moved}) if json_out else typer.echo(f"{verb} {len(moved)}")
    missing = sorted(set(ids) - set(moved))
    if missing:
        fail(f"{len(missing)} job(s) not {state} in queue {queue}: {', '.join(missing)}")


def _purge(url: str | None, queue: str, state: str, yes: bool, dry_run: bool) -> None:
    """Count, confirm, delete. The count is the set's size when asked: jobs that land in the set meanwhile go too,
    and the line printed last is what was deleted."""
    with errors():
        check_purgeable(state)
    count = run_store(url, lambda store: store.stats(queue), known=[queue]).counts.get(state, 0)
    if confirmed("purge", f"{count} {state} job(s) of queue {queue}", yes=yes, dry_run=dry_run, nothing=count == 0):
        typer.echo(f"purged {run_store(url, lambda store: store.purge(queue, state), known=[queue])}")


@dead_app.command("list")
def dead_list(
    queue: QueueArg, limit: LimitOpt = 50, cursor: CursorOpt = 0, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """Dead-lettered jobs, newest first, with the reason they died."""
    list_page(url, queue, "dead", limit, cursor, json_out)


@dead_app.command("requeue")
def dead_requeue(
    queue: QueueArg, job_ids: IdsArg = None, all_: AllOpt = False, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """Send dead jobs back to the queue with a fresh attempt budget."""
    _move(url, queue, "dead", job_ids, all_, json_out)


@dead_app.command("purge")
def dead_purge(queue: QueueArg, yes: YesOpt = False, dry_run: DryRunOpt = False, url: UrlOpt = None) -> None:
    """Delete every dead job of the queue (records included), after saying how many and asking."""
    _purge(url, queue, "dead", yes, dry_run)


@held_app.command("list")
def held_list(
    queue: QueueArg, limit: LimitOpt = 50, cursor: CursorOpt = 0, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """Jobs held because a cap was reached, oldest first."""
    list_page(url, queue, "held", limit, cursor, json_out)


@held_app.command("release")
def held_release(
    queue: QueueArg, job_ids: IdsArg = None, all_: AllOpt = False, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """Make held jobs ready now instead of waiting for the cap window to reset."""
    _move(url, queue, "held", job_ids, all_, json_out)


def pause(queue: QueueArg, url: UrlOpt = None) -> None:
    """Stop workers claiming from the queue; enqueueing still works (the queue need not exist yet)."""
    run_store(url, lambda store: store.pause(queue), queues=[queue])
    typer.echo(f"paused {queue}")


def resume(queue: QueueArg, url: UrlOpt = None) -> None:
    """Let workers claim from a paused queue again."""
    run_store(url, lambda store: store.resume(queue), known=[queue], makes_work=True)
    typer.echo(f"resumed {queue}")


def cancel(job_id: JobArg, url: UrlOpt = None) -> None:
    """Cancel a job: at once if it waits with nothing remote, else a worker cancels the remote job first (the
    one holding it, or the next to claim it) and then acknowledges: `offload status` shows it meanwhile."""
    code = run_store(url, lambda store: store.cancel(job_id), jobs=[job_id])
    typer.echo("cancelled" if code == "cancelled" else "cancel requested")


def purge(
    queue: QueueArg,
    state: Annotated[str, typer.Option(help="State to delete.", show_default=False)],
    yes: YesOpt = False,
    dry_run: DryRunOpt = False,
    url: UrlOpt = None,
) -> None:
    """Delete every job of the queue in one state (not active ones), after saying how many and asking."""
    _purge(url, queue, state, yes, dry_run)


def register(app: typer.Typer) -> None:
    for command in (pause, resume, cancel, purge):
        app.command()(command)
    app.add_typer(dead_app, name="dead")
    app.add_typer(held_app, name="held")
