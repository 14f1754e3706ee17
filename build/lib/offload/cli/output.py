"""Where command output goes: people get rich tables on stdout, scripts get one JSON document per line.

Consoles resolve sys.stdout/sys.stderr at write time, so test runners that swap the streams still work.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import orjson
from rich.console import Console

err = Console(stderr=True, highlight=False)


def out() -> Console:
    """Rich squeezes tables into 80 columns when stdout is no terminal; a pipe or file has no such limit."""
    if sys.stdout.isatty():
        return Console(highlight=False)
    columns = os.environ.get("COLUMNS", "").strip()  # the terminal's convention, not ours: ignored unless a number
    return Console(highlight=False, width=max(200, int(columns) if columns.isdigit() else 0))


def print_json(doc: Any) -> None:
    """One document on one line, flushed: `--watch --json` streams stay line-delimited."""
    sys.stdout.write(orjson.dumps(doc).decode() + "\n")
    sys.stdout.flush()
