"""docs/reference/cli.md: every `offload` command, its arguments and options, from the Typer app."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer.main

from offload.cli.app import app
from scripts.reference.schema_md import cell

INTRO = """# Command line

Every `offload` command with its arguments and options, generated from the Typer app (`offload/cli/`) by
`python -m scripts.reference`. How the commands fit together: [Operate queues from the command
line](../how-to/command-line.md). Every read command takes `--json`; errors are one line on stderr (`error: ...`,
exit code 1), usage mistakes exit 2. `offload COMMAND --help` prints the same on the terminal.
"""


def commands() -> Iterator[tuple[list[str], Any]]:
    """(path, command) for every leaf command, sorted by path: `["offload", "dead", "list"]`."""
    root = typer.main.get_command(app)

    def walk(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        subs = getattr(cmd, "commands", None)
        if subs is None:
            yield path, cmd
            return
        for name in sorted(subs):
            if not subs[name].hidden:
                yield from walk(subs[name], [*path, name])

    yield from walk(root, ["offload"])


def _type(param: Any, ctx: Any) -> str:
    if param.metavar:
        return str(param.metavar)
    if getattr(param, "is_flag", False):
        return "flag"
    return str(param.display_type(ctx)).strip("<>")


def _default(param: Any) -> str:
    if param.required:
        return "required"
    value = param.default
    if value is None or value == () or value == []:
        return ""
    return f"`{value}`"


def section(path: list[str], cmd: Any, ctx: Any) -> list[str]:
    lines = [f"## {' '.join(path)}", ""]
    if cmd.help:
        lines += ["\n".join(line.rstrip() for line in cmd.help.strip().splitlines()), ""]
    params = [p for p in cmd.params if not getattr(p, "hidden", False)]
    args = [p for p in params if p.param_type_name == "argument"]
    usage = " ".join([*path, *(p.name.upper() + ("..." if p.nargs == -1 else "") for p in args), "[OPTIONS]"])
    lines += [f"`{usage}`", ""]
    if not params:
        return lines
    lines += ["| argument or option | type | default | meaning |", "|---|---|---|---|"]
    for p in params:
        names = p.name.upper() if p.param_type_name == "argument" else ", ".join([*p.opts, *p.secondary_opts])
        lines.append(f"| `{names}` | {cell(_type(p, ctx))} | {_default(p)} | {cell(p.help or '')} |")
    return [*lines, ""]


def pages() -> dict[str, str]:
    root = typer.main.get_command(app)
    ctx = root.make_context("offload", [], resilient_parsing=True)
    lines = [INTRO]
    for path, cmd in commands():
        lines += section(path, cmd, ctx)
    return {"reference/cli.md": "\n".join(lines).rstrip("\n") + "\n"}
