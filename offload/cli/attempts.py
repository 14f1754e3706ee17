"""A job's attempts under `offload status <id>`: one row per lease (offload/queue/attempts.py)."""

from __future__ import annotations

from rich.text import Text

from offload.cli.output import age, listing, number_column, out, short, show, text_column, when
from offload.models import Attempt

COLUMNS = ("#", "claimed by", "backend", "remote id", "learned by", "started", "duration", "cost", "outcome", "error")


def _remote(a: Attempt) -> str:
    if not a.remote_id:
        return "-"
    return a.remote_id + (" (resumed)" if a.resumed else " (adopted)" if a.adopted else "")


def show_attempts(kept: list[Attempt], made: int) -> None:
    """The attempts as a table; a line saying how many were dropped from the middle of a long history."""
    if not kept:
        out().print(Text("no attempt yet"))
        return
    grid = listing()
    for name in COLUMNS:
        (number_column if name in ("#", "duration", "cost") else text_column)(grid, name)
    for a in kept:
        grid.add_row(
            str(a.number),
            a.claimed_by,
            a.backend or "-",
            _remote(a),
            a.learned_by or "-",
            when(a.claimed_at),
            age(a.duration_ms),
            "-" if a.cost is None else f"${a.cost:.4f}",
            a.outcome or "running",
            Text(short(a.error, 200) if a.error else "-"),
        )
    show(grid)
    if made > len(kept):
        out().print(Text(f"{made} attempts: {made - len(kept)} in the middle are not kept (the first 5, the last 45)"))
