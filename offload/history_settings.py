"""offload.yaml's `history:` block: whether each queue's history is kept (offload/queue/history.py) and how long
each resolution's points stay. Enforced by key expiry in the store; the server writes it to every queue each minute,
so a change reaches the scripts of every worker without a restart of theirs."""

from __future__ import annotations

from pydantic import Field

from offload.queue.history import HistoryKeep
from offload.queue.scripts import HISTORY_KEEP_S
from offload.schema import Strict

DAY_S = 86_400


class HistorySettings(Strict):
    enabled: bool = Field(True, description="count each queue's jobs, waits, run times and spend per minute")
    minute_days: float = Field(
        HISTORY_KEEP_S[0] / DAY_S, gt=0, le=31, description="days the one-minute points are kept"
    )
    hour_days: float = Field(HISTORY_KEEP_S[1] / DAY_S, gt=0, le=400, description="days the hourly points are kept")
    day_days: float = Field(HISTORY_KEEP_S[2] / DAY_S, gt=0, le=3660, description="days the daily points are kept")

    def keep(self) -> HistoryKeep:
        return HistoryKeep(
            enabled=self.enabled,
            minutes_s=round(self.minute_days * DAY_S),
            hours_s=round(self.hour_days * DAY_S),
            days_s=round(self.day_days * DAY_S),
        )
