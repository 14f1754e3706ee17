"""The spend columns of `offload queues`: today's spend (the job store's UTC day) per kind of capacity, so the
APIs' charges, the fleet's job shares and the fleet's idle rental read side by side (offload/models.py SPEND_KINDS).
"""

from __future__ import annotations

from offload.models import SPEND_KINDS, Job, QueueStats

#: Column titles, one per SPEND_KINDS line.
SPEND_COLUMNS = tuple(f"{kind.replace('_', ' ')} $" for kind in SPEND_KINDS)


def usd(amount: float) -> str:
    """Cents for most spend, more digits for the fractions of a cent a few seconds of a machine cost."""
    return f"{amount:.2f}" if amount >= 1 or amount == 0 else f"{amount:.4f}"


def _cell(stats: QueueStats, kind: str) -> str:
    amount = stats.spend.get(kind)
    unpriced = stats.totals.get("fleet_unpriced", 0) if kind == "fleet" else 0
    if unpriced and not amount:  # a GPU worker that is no rented machine: its cost is unknown, not $0
        return "price unknown"
    shown = "-" if amount is None else usd(amount)
    return f"{shown} + price unknown" if unpriced else shown


def spend_cells(stats: QueueStats) -> list[str]:
    """One cell per SPEND_COLUMNS: "-" for a kind the queue never spent on."""
    return [_cell(stats, kind) for kind in SPEND_KINDS]


def cost_unknown(job: Job) -> str | None:
    """What a job's view says of a fleet job without a cost: its machine had no price, which is not $0."""
    if job.kind == "fleet" and job.cost is None and job.state.value == "succeeded":
        return "unknown: its GPU worker is no rented machine (no price)"
    return None
