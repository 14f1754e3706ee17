"""The `offload` command: the root Typer app with every command group mounted, and the console-script entry.

Each group lives in its own module (jobs, history, worker, server, keys, autoscale, stack, sim, config) and
registers its commands here; they share options, output and error handling from `options`, `output`, `errors` and
`session`, and never import each other.
"""

from __future__ import annotations

from typing import Annotated

import typer

from offload import __version__
from offload.cli import autoscale, config, history, jobs, keys, operate, server, sim, stack, worker
from offload.cli.errors import describe, error_line

app = typer.Typer(
    name="offload",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
    help="A durable GPU job queue on Redis/Valkey.",
)


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"offload {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """A durable GPU job queue on Redis/Valkey."""


for group in (jobs, operate, history, worker, server, keys, autoscale, stack, sim, config):
    group.register(app)


def main() -> None:
    """Run the CLI. An exception no command mapped (a bug) still ends as one `error:` line, exit 1."""
    try:
        app(prog_name="offload")
    except Exception as exc:
        typer.echo(error_line(describe(exc)), err=True)
        raise SystemExit(1) from None
