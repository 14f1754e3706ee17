"""`offload config check`: load offload.yaml plus the environment the way every command does, and say what it found."""

from __future__ import annotations

import typer

from offload.cli.errors import error_line, errors
from offload.cli.options import ConfigOpt, JsonOpt
from offload.cli.output import print_json
from offload.cli.session import settings
from offload.config import config_file, problems

config_app = typer.Typer(help="Validate offload.yaml and the environment.", no_args_is_help=True)


@config_app.command("check")
def config_check(config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """Load offload.yaml plus the environment; list every problem, one line each naming its field."""
    with errors():
        found = [" ".join(str(p).split()) for p in problems(config)]
    if found:
        if json_out:
            print_json({"ok": False, "problems": found})
        for line in found:
            typer.echo(error_line(line), err=True)
        raise typer.Exit(1)
    loaded = settings(config)
    if json_out:
        with errors():
            file = config_file(config)
        print_json(
            {
                "ok": True,
                "config": str(file) if file else None,
                "storage": loaded.storage.kind,
                "backends": {name: b.kind for name, b in loaded.backends.items()},
                "queues": {
                    name: {
                        "backend": q.backend,
                        "backends": q.route_backends,
                        "route": q.route,
                        "autoscale": q.autoscale is not None,
                    }
                    for name, q in loaded.queues.items()
                },
            }
        )
        return
    queues = ", ".join(f"{n} -> {', '.join(q.route_backends) or None}" for n, q in loaded.queues.items()) or "none"
    typer.echo(f"ok: storage {loaded.storage.kind}, backends {', '.join(loaded.backends) or 'none'}, queues {queues}")


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
