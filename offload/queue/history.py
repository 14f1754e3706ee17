"""The queue's bounded history, read back as points: per minute, hour or day, what the scripts counted in that
bucket (lua/includes/history.lua) and the gauges the server sampled (lua/history_sample.lua).

A range is a whole axis: every bucket from the oldest to the current one is a point, zeros (counts) and nulls
(percentiles, gauges) where nothing was written, so a chart needs no gap filling. Percentiles come from the
histogram buckets /metrics uses (HIST_BUCKETS_S), interpolated within a bucket as Prometheus' histogram_quantile
does, so a chart and a Prometheus query agree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from offload.queue.keyspace import HISTORY_RESOLUTIONS, history_bucket, history_sampled, prefix, validate_queue
from offload.queue.scripts import HIST_BUCKETS_S, HISTORY_KEEP_S, SCRIPTS
from offload.redis_client import RedisClient

#: The ranges the API serves: (bucket length s, points).
RANGES: dict[str, tuple[int, int]] = {"hour": (60, 60), "day": (3600, 24), "week": (3600, 7 * 24)}
COUNTS = ("enqueued", "succeeded", "failed", "dead", "cancelled", "provider_calls", "provider_errors")
GAUGES = ("backlog", "in_flight", "fleet_machines", "fleet_usd_per_h")
SPEND_KINDS = ("serverless", "fleet")
QUANTILES = (0.5, 0.95, 0.99)
BOUNDS_MS = tuple(b * 1000 for b in HIST_BUCKETS_S)
NANO = 1e9  # the buckets keep USD in nano-USD, whole (HINCRBY: exact, and cheaper than HINCRBYFLOAT)

Raw = dict[str, float]  # one bucket's hash, numbers summed (several queues' buckets add up field by field)


@dataclass
class HistoryPoint:
    t: int  # the bucket's start, unix s (the store's clock)
    counts: dict[str, int]
    wait_ms: dict[str, float | None]
    run_ms: dict[str, float | None]
    spend_usd: dict[str, float]
    spend_by_backend: dict[str, float]
    gauges: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The point as the API and `offload history --json` show it: counts and gauges flat, machines and jobs
        whole, $/h to a millionth; a gauge no server sampled is None."""
        g = self.gauges
        whole = {k: None if g.get(k) is None else int(g[k] or 0) for k in ("backlog", "in_flight", "fleet_machines")}
        usd_h = g.get("fleet_usd_per_h")
        return {
            "t": self.t,
            **self.counts,
            "wait_ms": self.wait_ms,
            "run_ms": self.run_ms,
            "spend_usd": self.spend_usd,
            "spend_by_backend": self.spend_by_backend,
            **whole,
            "fleet_usd_per_h": None if usd_h is None else round(usd_h, 6),
        }


def quantile(q: float, buckets: Mapping[int, float]) -> float | None:
    """The q-quantile (ms) of a histogram given as counts per bucket index (1-based, len(BOUNDS_MS) + 1 the
    overflow bucket): linear within the bucket it falls in, the highest bound for the overflow bucket. None when
    the histogram is empty."""
    total = sum(buckets.values())
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i in range(1, len(BOUNDS_MS) + 2):
        n = buckets.get(i, 0)
        if n and seen + n >= rank:
            if i > len(BOUNDS_MS):
                return BOUNDS_MS[-1]
            low = BOUNDS_MS[i - 2] if i > 1 else 0.0
            return low + (BOUNDS_MS[i - 1] - low) * (rank - seen) / n
        seen += n
    return BOUNDS_MS[-1]


def _percentiles(raw: Raw, name: str) -> dict[str, float | None]:
    buckets = {int(k.split(":", 1)[1]): v for k, v in raw.items() if k.startswith(name + ":")}
    return {f"p{round(q * 100)}": quantile(q, buckets) for q in QUANTILES}


def to_point(t: int, raw: Raw) -> HistoryPoint:
    return HistoryPoint(
        t=t,
        counts={c: int(raw.get(c, 0)) for c in COUNTS},
        wait_ms=_percentiles(raw, "wait"),
        run_ms=_percentiles(raw, "run"),
        spend_usd={k: round(raw.get(f"spend:{k}", 0.0) / NANO, 9) for k in SPEND_KINDS},
        spend_by_backend={k[3:]: round(v / NANO, 9) for k, v in sorted(raw.items()) if k.startswith("sb:")},
        gauges={g: raw.get(f"g:{g}") for g in GAUGES},
    )


def merge(raws: Iterable[Raw]) -> Raw:
    """Several queues' buckets as one: every field summed (counts, histogram buckets, spend, the gauges' peaks)."""
    out: Raw = {}
    for raw in raws:
        for k, v in raw.items():
            out[k] = out.get(k, 0.0) + v
    return out


def axis(range_name: str, now_s: float) -> tuple[int, list[int]]:
    """(bucket length s, the buckets' starts oldest first, the current one last) of a range at `now_s`."""
    if range_name not in RANGES:
        raise ValueError(f"unknown history range {range_name!r}: choose one of {', '.join(RANGES)}")
    step, n = RANGES[range_name]
    last = int(now_s) - int(now_s) % step
    return step, [last - step * (n - 1 - i) for i in range(n)]


async def read_raw(redis: RedisClient, queue: str, step_s: int, starts: list[int]) -> list[Raw]:
    """Each bucket's hash, as numbers, in one pipeline (a queue's keys share a slot: one node of a cluster)."""
    validate_queue(queue)
    pipe = redis.pipeline(transaction=False)
    for t in starts:
        pipe.hgetall(history_bucket(queue, step_s, t))
    return [{k: float(v) for k, v in h.items()} for h in await pipe.execute()]


async def sampled(redis: RedisClient, step_s: int, starts: list[int]) -> list[bool]:
    """Whether a server sampled the gauges in each bucket (`mark_sampled`), in one pipeline."""
    pipe = redis.pipeline(transaction=False)
    for t in starts:
        pipe.exists(history_sampled(step_s, t))
    return [bool(n) for n in await pipe.execute()]


async def points(
    redis: RedisClient, queues: Sequence[str], range_name: str, now_s: float
) -> tuple[int, list[HistoryPoint]]:
    """(bucket length s, the range's points at `now_s`), the queues' buckets summed point by point. In a bucket a
    server sampled, a gauge the queues lack reads 0 (idle queues get no sample); elsewhere None (not known)."""
    step, starts = axis(range_name, now_s)
    per_queue, marks = await asyncio.gather(
        asyncio.gather(*(read_raw(redis, q, step, starts) for q in queues)), sampled(redis, step, starts)
    )
    out = []
    for i, t in enumerate(starts):
        point = to_point(t, merge(raws[i] for raws in per_queue))
        if marks[i]:
            point.gauges = {g: 0.0 if v is None else v for g, v in point.gauges.items()}
        out.append(point)
    return step, out


@dataclass(frozen=True)
class HistoryKeep:
    """Whether the history is written, and how long each resolution's buckets are kept (s)."""

    enabled: bool = True
    minutes_s: int = HISTORY_KEEP_S[0]
    hours_s: int = HISTORY_KEEP_S[1]
    days_s: int = HISTORY_KEEP_S[2]


async def sample(
    redis: RedisClient, queue: str, keep: HistoryKeep, gauges: Mapping[str, float | None], now_ms: str = ""
) -> int:
    """Write the queue's history settings and one sample of its gauges (each bucket keeps its peak); returns the
    start (ms) of the minute sampled. `now_ms` '' is the store's clock."""
    args: list[str | int] = [now_ms, int(keep.enabled), keep.minutes_s * 1000, keep.hours_s * 1000, keep.days_s * 1000]
    for name in GAUGES:
        value = gauges.get(name)
        args += [name, "" if value is None else repr(float(value))]
    return int(await SCRIPTS.history_sample(redis, [prefix(validate_queue(queue))], args))


async def mark_sampled(redis: RedisClient, keep: HistoryKeep, minute_ms: int) -> None:
    """Record that the gauges of the minute starting at `minute_ms` (the store's clock) were sampled, in its
    minute's, hour's and day's buckets, each marker expiring with its bucket (`history.lua`'s retention)."""
    if not keep.enabled:
        return
    pipe = redis.pipeline(transaction=False)
    for (step, _), kept_s in zip(HISTORY_RESOLUTIONS.items(), (keep.minutes_s, keep.hours_s, keep.days_s), strict=True):
        start_ms = minute_ms - minute_ms % (step * 1000)
        pipe.set(history_sampled(step, start_ms // 1000), 1, px=start_ms + (step + kept_s) * 1000 - minute_ms)
    await pipe.execute()


__all__ = [
    "HISTORY_RESOLUTIONS",
    "RANGES",
    "HistoryKeep",
    "HistoryPoint",
    "axis",
    "mark_sampled",
    "merge",
    "points",
    "read_raw",
    "sample",
]
