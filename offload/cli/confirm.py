"""The one rule for commands that delete: say what would go, and go only when someone said yes."""

from __future__ import annotations

import sys

import typer

from offload.cli.errors import fail


def confirmed(verb: str, what: str, *, yes: bool, dry_run: bool, nothing: bool = False) -> bool:
    """Whether to `verb` `what` ("purge", "3 dead job(s) of queue gpu"; "revoke", "key k1"). --dry-run prints what
    would go and declines; --yes (or `nothing` to delete) goes ahead; a person at a terminal is asked; anything
    else (a script, a pipe, cron) gets a one-line error: nothing is deleted that nobody confirmed."""
    if dry_run:
        typer.echo(f"would {verb} {what}")
        return False
    if yes or nothing:
        return True
    if not sys.stdin.isatty():
        fail(f"refusing to {verb} {what} unconfirmed: add --yes to go ahead (or --dry-run to see what would go)")
    if not typer.confirm(f"{verb.capitalize()} {what}? This cannot be undone", default=False):
        fail(f"not confirmed: nothing to {verb}")
    return True
