"""Where command output goes, and how values look in it: people get rich tables on stdout, scripts get one JSON
document per line.

Consoles resolve sys.stdout/sys.stderr at write time, so test runners that swap the streams still work.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from offload import exactjson

err = Console(stderr=True, highlight=False)
# A pipe or file has no width: tables are laid out at their natural width (rich sizes a table to its content, not
# to the console) and no line is cut or wrapped. Any number this large does; sys.maxsize makes rich slow.
UNBOUNDED = 1_000_000


def out() -> Console:
    """A terminal's width on a terminal, no width limit elsewhere."""
    if sys.stdout.isatty():
        return Console(highlight=False)
    return Console(highlight=False, width=UNBOUNDED)


def print_json(doc: Any) -> None:
    """One document on one line, flushed: `--watch --json` streams stay line-delimited. Integers of any size
    stay integers (offload/exactjson.py)."""
    sys.stdout.write(exactjson.dumps(doc).decode() + "\n")
    sys.stdout.flush()


def listing() -> Table:
    """An empty listing table: add columns with `text_column` and `number_column`, print it with `show`."""
    return Table(box=box.SIMPLE_HEAD, collapse_padding=True)


def text_column(grid: Table, name: str) -> None:
    grid.add_column(name, overflow="fold")


def number_column(grid: Table, name: str) -> None:
    grid.add_column(name, justify="right", no_wrap=True)


def show(grid: Table) -> None:
    """A table at its natural width when it fits (always, off a terminal). On a terminal too narrow for it, one
    block of `column: value` lines per row instead: squeezed, rich would cut values or fold them into columns of
    single letters."""
    console = out()
    if Measurement.get(console, console.options.update_width(UNBOUNDED), grid).maximum <= console.width:
        console.print(grid)
        return
    headers = [str(column.header) for column in grid.columns]
    pad = max((len(h) for h in headers), default=0)
    cells = [list(column.cells) for column in grid.columns]
    for row in range(grid.row_count):
        for header, column in zip(headers, cells, strict=True):
            value = column[row]
            console.print(Text(f"{header:>{pad}}  ") + (value if isinstance(value, Text) else Text(str(value))))
        console.print()


def when(ms: int | None) -> str:
    """A store time (ms since the epoch) in local time."""
    return "-" if ms is None else datetime.fromtimestamp(ms / 1000).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def age(ms: int | None) -> str:
    if ms is None:
        return "-"
    s = ms // 1000
    if s < 60:
        return f"{ms / 1000:.1f}s"
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def short(value: Any, width: int = 80) -> str:
    """A value as one line of JSON (a string as itself), cut at `width` with an ellipsis."""
    text = value if isinstance(value, str) else exactjson.dumps(value).decode()
    return text if len(text) <= width else text[: width - 1] + "…"
