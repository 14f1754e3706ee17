"""The history's gauges (offload/queue/history.py): once a minute of the store's clock, each queue's backlog, jobs
in flight, and its rented machines with their price per hour, written into the minute's, hour's and day's buckets
with the history's settings from offload.yaml. Every server samples; each bucket keeps its peak, so two servers
sampling the same minute write what one would. An idle queue (all four zero) gets no sample: no bucket a minute
for nothing; one marker a bucket for all queues says the minute was sampled, so its gauges read 0, not unknown."""

from __future__ import annotations

import time
from collections import defaultdict

from offload.autoscale.instances import ACTIVE, InstanceStore
from offload.queue import history
from offload.server.state import ServerState


class HistorySampler:
    def __init__(self) -> None:
        self._minute = -1  # the store's minute last sampled by this process
        self._at = -float("inf")  # when (monotonic)

    async def maybe_sample(self, state: ServerState, now_s: float) -> bool:
        """Sample every queue when the store's minute changed since this process last did, or `history_sample_s`
        passed (a bucket keeps its peak: sampling more often changes no point's meaning); True when it did."""
        minute = int(now_s // 60)
        if minute == self._minute and time.monotonic() - self._at < state.options.history_sample_s:
            return False
        keep = state.options.settings.history.keep()
        machines: dict[str, int] = defaultdict(int)
        usd_h: dict[str, float] = defaultdict(float)
        for inst in await InstanceStore(state.redis).live():
            if inst.status in ACTIVE and not inst.teardown:
                machines[inst.queue] += 1
                usd_h[inst.queue] += inst.price
        minute_ms: int | None = None  # the store's minute, as the first sample's script read it
        for queue in sorted(set(await state.store.queues()) | set(state.options.settings.queues)):
            counts = (await state.store.stats(queue)).counts
            gauges: dict[str, float | None] = {
                "backlog": counts.get("queued", 0) + counts.get("retrying", 0),
                "in_flight": counts.get("active", 0),
                "fleet_machines": machines.get(queue, 0),
                "fleet_usd_per_h": usd_h.get(queue, 0.0),
            }
            if not any(gauges.values()):  # an idle queue: no bucket a minute for nothing (the marker says 0)
                gauges = {}
            minute_ms = await history.sample(state.redis, queue, keep, gauges)
        if minute_ms is not None:
            await history.mark_sampled(state.redis, keep, minute_ms)
        self._minute, self._at = minute, time.monotonic()
        return True
