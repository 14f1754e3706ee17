"""The `offload` command: the root Typer app with every command group mounted, and the console-script entry.

Each group lives in its own module (jobs, worker, server, keys, autoscale, stack, sim, config) and registers its
commands here; they share options, output and error handling from `options`, `output`, `errors` and `session`,
and never import each other.
"""

from __future__ import annotations

import typer

from offload.cli import autoscale, config, jobs, keys, server, sim, stack, worker
from offload.cli.errors import describe, error_line

app = typer.Typer(
    name="offload",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="A durable GPU job queue on Redis/Valkey.",
)
for group in (jobs, worker, server, keys, autoscale, stack, sim, config):
    group.register(app)


def main() -> None:
    """Run the CLI. An exception no command mapped (a bug) still ends as one `error:` line, exit 1."""
    try:
        app(prog_name="offload")
    except Exception as exc:
        typer.echo(error_line(describe(exc)), err=True)
        raise SystemExit(1) from None
