"""Counters that let a test prove what a client did: requests per route, faults injected, and above all
how many times each client-side job was submitted (guarantee 2, "no double GPU spend", is checked here).
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class Stats:
    """Plain counters; the event loop is the only writer, so no locking. In `responses`, code 599 stands for a
    connection the simulator reset on purpose (no HTTP status reached the client)."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.submissions: Counter[str] = Counter()
        self.submissions_by_family: Counter[str] = Counter()
        self.cancels: Counter[str] = Counter()
        self.replays: Counter[str] = Counter()

    def request(self, route: str) -> None:
        self.requests[route] += 1

    def status(self, route: str, code: int) -> None:
        self.statuses[f"{route} {code}"] += 1

    def fault(self, route: str, kind: str) -> None:
        self.faults[f"{route} {kind}"] += 1

    def submitted(self, family: str, input_key: str) -> None:
        self.submissions[input_key] += 1
        self.submissions_by_family[family] += 1

    def replayed(self, family: str) -> None:
        """A submit answered from the Idempotency-Key cache: no new job, not a submission."""
        self.replays[family] += 1

    def cancelled(self, family: str) -> None:
        self.cancels[family] += 1

    def snapshot(self, jobs_in_store: int) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "responses": dict(self.statuses),
            "faults": dict(self.faults),
            "submissions": sum(self.submissions.values()),
            "submissions_by_family": dict(self.submissions_by_family),
            "submissions_by_input_id": dict(self.submissions),
            "duplicate_input_ids": sorted(k for k, n in self.submissions.items() if n > 1),
            "cancels": dict(self.cancels),
            "idempotent_replays": dict(self.replays),
            "jobs_in_store": jobs_in_store,
        }
