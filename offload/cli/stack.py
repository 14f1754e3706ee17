"""The local stack from a shell: `offload up`, `down`, `demo`, and `offload embedded` for the Valkey alone."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from offload.cli.errors import errors
from offload.cli.options import JsonOpt
from offload.cli.output import out, print_json
from offload.local.embedded import data_dir, ensure_embedded, running_url, stop_embedded

embedded_app = typer.Typer(no_args_is_help=True, help="The embedded Valkey under ./.offload (OFFLOAD_HOME).")


@embedded_app.command("status")
def embedded_status(json_out: JsonOpt = False) -> None:
    """Whether the embedded Valkey runs, and where."""
    url = running_url()
    running = url is not None
    home = str(data_dir())
    if json_out:
        print_json({"running": running, "url": url if running else None, "data_dir": home})
    else:
        typer.echo(f"{f'running at {url}' if running else 'not running'} (data in {home})")


@embedded_app.command("start")
def embedded_start() -> None:
    """Start the embedded Valkey if needed and print its URL (other commands also start it on demand)."""
    with errors():
        typer.echo(ensure_embedded())


@embedded_app.command("stop")
def embedded_stop() -> None:
    """Stop the embedded Valkey; its data stays on disk (AOF) for the next start."""
    with errors():
        typer.echo("stopped" if stop_embedded() else "not running")


def demo(jobs: Annotated[int, typer.Option(min=1, max=10_000, help="Jobs to run.")] = 40) -> None:
    """Run a batch end to end on the local stack (started if needed) and show where the results are."""
    from offload.local.demo import run_demo

    with errors():
        asyncio.run(run_demo(out(), jobs))


def up(
    workers: Annotated[int, typer.Option(min=1, max=64, help="Dispatch worker processes.")] = 2,
    latency: Annotated[str, typer.Option(help="Simulated GPU job time: 2, 1-3 or lognormal:2:0.5.")] = "1-3",
) -> None:
    """Start the local stack in the background: Valkey, S3, the GPU API simulator, N workers (./.offload/)."""
    from offload.local.stack import up as stack_up

    with errors():
        for name, where in stack_up(workers=workers, latency=latency):
            typer.echo(f"{name:<10} {where}")


def down() -> None:
    """Stop the local stack (workers drain first); data stays under ./.offload/."""
    from offload.local.stack import down as stack_down

    with errors():
        typer.echo("stopped: " + (", ".join(stack_down()) or "nothing was running"))


def register(app: typer.Typer) -> None:
    app.add_typer(embedded_app, name="embedded")
    for command in (demo, up, down):
        app.command()(command)
