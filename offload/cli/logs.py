"""How the long-running commands (worker, server, autoscale) log: one format, one level, quiet libraries.

At info a process logs its start, its stop and what went wrong; the lines that come once per routine request or
per finished job are debug (httpx's request lines; the server's access log leaves heartbeats, claims and
long-polls out: offload/server/runner.py).
"""

from __future__ import annotations

import logging

from offload.cli.options import LogLevel

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: LogLevel) -> None:
    logging.basicConfig(level=level.value.upper(), format=FORMAT)
    if level is not LogLevel.DEBUG:  # httpx logs every request at INFO: thousands of lines a second at scale
        logging.getLogger("httpx").setLevel(logging.WARNING)
