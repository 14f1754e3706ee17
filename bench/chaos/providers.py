"""The two-provider profile (`--providers 2`, issue 39): the main queue routes to two simulated providers of
different kinds (`sim`, the `--backend` kind, then `sim2`), and the first one has an outage (503 on every call)
from 30 % to 60 % of the fault phase, then recovers. Jobs move to the second while the first cools down; a job
whose submission at the first had an unknown outcome waits for it (docs/how-to/routing.md). What it reports:
jobs per backend, the share that moved, and inputs paid at both providers (a defect: the run fails)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger("chaos")
# the second provider: another kind than the first, asynchronous (the checker judges one kind of answer per run)
SECOND = {"http-job": "runpod", "runpod": "http-job", "replicate": "http-job", "fal": "http-job"}
FAMILY = {"http-job": "jobs", "runpod": "runpod", "replicate": "replicate", "fal": "fal"}
OUTAGE = (0.3, 0.6)  # the first provider's outage, as shares of the fault phase
HEALTH = {"failures": 5, "window_s": 30, "cool_down_s": 5, "max_cool_down_s": 30}


def check(backend: str, providers: int, webhooks: bool) -> None:
    """A usage error, said at once."""
    if providers == 2 and (backend not in SECOND or webhooks):
        raise SystemExit(
            f"error: --providers 2 needs an asynchronous --backend ({', '.join(SECOND)}) without --webhooks"
        )


def queue_block(backends: dict[str, Any], first: str) -> dict[str, Any]:
    """The queue's `backends`/`health` and the second backend's settings (a copy of the first's, its kind's own)."""
    second = SECOND[first]
    block = {k: v for k, v in backends["sim"].items() if k not in ("kind", "endpoint_id", "version", "app")}
    backends["sim2"] = {**block, "kind": second, **({"endpoint_id": "chaos"} if second == "runpod" else {})}
    return {"backends": ["sim", "sim2"], "route": "fallback", "health": HEALTH}


async def outage(sim: Any, backend: str, fault_s: float, note: Callable[..., None]) -> None:
    """The first provider down (503) for the middle of the fault phase, then back."""
    family = FAMILY[backend]
    await asyncio.sleep(fault_s * OUTAGE[0])
    log.warning("provider outage: %s answers 503", family)
    await asyncio.to_thread(sim.post, "/_sim/outage", {"family": family, "mode": "503"})
    note("provider_outage", family, state="down")
    await asyncio.sleep(fault_s * (OUTAGE[1] - OUTAGE[0]))
    await asyncio.to_thread(sim.post, "/_sim/outage", {"family": family, "mode": None})
    note("provider_outage", family, state="up")
    log.warning("provider outage over: %s answers again", family)


def summary(records: dict[str, dict[str, str]], submissions: list[dict[str, Any]], queue: str) -> dict[str, Any]:
    """Jobs per backend (where each succeeded job ran), the share that moved to the second, and the inputs paid
    at both providers: one submission (one Idempotency-Key, `<job id>.<submission number>`) created at both, i.e.
    a try of unknown outcome at one sent to the other: never, or the run fails. A job's next submission (a new
    number: its earlier run failed, was cancelled or its result expired) may run anywhere, as on one provider; those
    are counted apart (`moved_after_remote_end`)."""
    ran = Counter(h.get("backend") or "?" for h in records.values() if h.get("state") == "succeeded")
    by_key: dict[str, set[str]] = {}
    by_input: dict[str, set[str]] = {}
    for s in submissions:
        if s.get("replay"):
            continue
        by_key.setdefault(str(s.get("idempotency_key")), set()).add(str(s.get("family")))
        by_input.setdefault(str(s.get("input_id")), set()).add(str(s.get("family")))
    both = sorted(key for key, families in by_key.items() if len(families) > 1 and key != "None")
    done = sum(ran.values())
    return {
        "queue": queue,
        "jobs_per_backend": dict(ran),
        "moved_share": round(ran.get("sim2", 0) / done, 3) if done else 0.0,
        "paid_at_both": len(both),
        "paid_at_both_examples": both[:5],
        "moved_after_remote_end": sum(1 for families in by_input.values() if len(families) > 1) - len(both),
    }
