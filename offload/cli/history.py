"""`offload history <queue>`: the queue's history (offload/queue/history.py) as a compact table, one row per bucket
that saw anything, oldest first; `--json` prints every point, the empty ones too."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import typer

from offload.cli.options import JsonOpt, QueueArg, UrlOpt
from offload.cli.output import listing, number_column, print_json, show, text_column
from offload.cli.session import run_store
from offload.cli.spend import usd
from offload.queue.history import HistoryPoint

RangeOpt = Annotated[
    Literal["hour", "day", "week"],
    typer.Option("--range", help="hour: 60 one-minute points; day: 24 hourly; week: 168 hourly."),
]


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v / 1000:.1f}s" if v >= 1000 else f"{v:.0f}ms")


def _gauge(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def _busy(p: HistoryPoint) -> bool:
    return any(p.counts.values()) or any(p.spend_usd.values()) or any(v for v in p.gauges.values())


def history(queue: QueueArg, range_: RangeOpt = "hour", json_out: JsonOpt = False, url: UrlOpt = None) -> None:
    """A queue's counts, wait and run p50/p95, spend and backlog per minute (last hour) or hour (day, week)."""
    step, points = run_store(url, lambda store: store.history(queue, range_), known=[queue])
    if json_out:
        print_json({"queue": queue, "range": range_, "step_s": step, "points": [p.to_dict() for p in points]})
        return
    grid = listing()
    text_column(grid, "from")
    for name in ("in", "ok", "retried", "dead", "cancelled", "wait p50", "wait p95", "run p50", "run p95", "$"):
        number_column(grid, name)
    number_column(grid, "backlog")
    busy = [p for p in points if _busy(p)]
    for p in busy:
        c = p.counts
        grid.add_row(
            datetime.fromtimestamp(p.t).astimezone().strftime("%Y-%m-%d %H:%M"),
            *(str(c[k]) for k in ("enqueued", "succeeded", "failed", "dead", "cancelled")),
            _ms(p.wait_ms["p50"]),
            _ms(p.wait_ms["p95"]),
            _ms(p.run_ms["p50"]),
            _ms(p.run_ms["p95"]),
            usd(sum(p.spend_usd.values())),
            _gauge(p.gauges.get("backlog")),
        )
    show(grid)
    typer.echo(f"{len(points) - len(busy)} of {len(points)} {'minutes' if step == 60 else 'hours'} without activity")


def register(app: typer.Typer) -> None:
    app.command()(history)
