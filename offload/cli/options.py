"""The options and arguments several commands share, each defined once with one help text.

A command group's own options stay in its module; what is here means the same thing wherever it appears.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        show_default=False,
        help="Redis/Valkey URL. Default: OFFLOAD_REDIS_URL, else REDIS_URL, else the config's redis_url, "
        "else the embedded server.",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        show_default=False,
        help="offload.yaml to read. Default: OFFLOAD_CONFIG, else ./offload.yaml, else the local stack's.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document (for scripts) instead of text.")]


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


LogLevelOpt = Annotated[
    LogLevel,
    typer.Option(
        envvar="OFFLOAD_LOG_LEVEL",
        case_sensitive=False,
        help="info: start, stop and what went wrong, without a line per routine request or finished job; debug: "
        "everything.",
    ),
]
QueueOpt = Annotated[str, typer.Option("--queue", "-q", help="Queue name.", show_default=False)]
QueueArg = Annotated[str, typer.Argument(help="Queue name.", show_default=False)]
JobArg = Annotated[str, typer.Argument(help="Job id.", show_default=False)]
LimitOpt = Annotated[int, typer.Option(min=1, max=1000, help="Jobs per page.")]
CursorOpt = Annotated[int, typer.Option(min=0, help="Page start, from a previous listing's next cursor.")]
IdsArg = Annotated[list[str] | None, typer.Argument(help="Job ids (or use --all).", show_default=False)]
AllOpt = Annotated[bool, typer.Option("--all", help="Every job in the set.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do it without asking (for scripts).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Only say what would go.")]
