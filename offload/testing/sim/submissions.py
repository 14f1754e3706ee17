"""Who submitted what, and `Idempotency-Key` as a provider that honours it would.

Every submission that reaches a provider handler and creates a remote job (or is answered from the key cache)
is logged: the client-side input id, the key, the worker named in the User-Agent (`offload/<v> worker/<id>`),
the port it arrived on (a harness can give each client its own port), arrival and response times, and whether
it was a replay or its answer was lost (a reset, or a gateway's 5xx page instead, with that status).
`GET /_sim/submissions` pages through the log, so a fault harness can
tell which duplicate was paid for by whom, and why.

Keys follow the IETF httpapi idempotency-key draft: a key seen before (within the TTL, per API family) gets the
first answer again, with the same remote id, and creates no job; a key whose first request is still being
served gets 409; the same key with a different body gets 422. Only requests that created a job are remembered,
so a rejected or throttled submit can be retried with the same key.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from offload.testing.sim.store import Job

WORKER_IN_AGENT = re.compile(r"\bworker/(\S+)")


def worker_of(user_agent: str | None) -> str | None:
    """The worker id a client put in its User-Agent (`offload/0.1 worker/host:1:ab12`), if any."""
    if not user_agent:
        return None
    m = WORKER_IN_AGENT.search(user_agent)
    return m[1] if m else None


@dataclass(slots=True)
class Submission:
    """One accepted submit request. `job` is kept (even after the store expired it) so the log can say how
    the remote job ended: a resubmission after a failed or expired run is a retry, not a duplicate."""

    seq: int
    family: str
    route: str
    job: Job
    key: str | None
    user_agent: str | None
    port: int | None
    arrival: float
    replay: bool
    responded: float | None = None
    lost: bool = False
    gateway: bool = False  # created, but a gateway's 5xx went out instead of the answer (`status`)
    status: int = 0

    def view(self, now: float) -> dict[str, Any]:
        job = self.job
        return {
            "seq": self.seq,
            "family": self.family,
            "route": self.route,
            "input_id": job.input_key,
            "remote_id": job.id,
            "idempotency_key": self.key,
            "worker": worker_of(self.user_agent),
            "user_agent": self.user_agent,
            "port": self.port,
            "arrival": self.arrival,
            "responded": self.responded,
            "replay": self.replay,
            "lost_response": self.lost,
            "gateway_error": self.gateway,
            "status": self.status,
            "remote_status": job.phase(now),
            "remote_ended_at": job.ended_at(),
            "remote_expires_at": job.expires_at(),
        }


@dataclass(slots=True)
class _Entry:
    fingerprint: str
    expires: float
    job: Job | None = None  # None while the first request is still being served
    reply: Any = None  # the first answer (an engine.Reply), replayed as is


Verdict = Literal["new", "busy", "mismatch"]


@dataclass
class SubmissionLog:
    """The log plus the key cache. Single-threaded: only the event loop touches it."""

    entries: list[Submission] = field(default_factory=list)
    _keys: dict[tuple[str, str], _Entry] = field(default_factory=dict)
    _expiry: list[tuple[float, str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries)

    def add(
        self,
        family: str,
        route: str,
        job: Job,
        *,
        key: str | None,
        user_agent: str | None,
        port: int | None,
        arrival: float,
        replay: bool,
    ) -> Submission:
        entry = Submission(len(self.entries) + 1, family, route, job, key, user_agent, port, arrival, replay)
        self.entries.append(entry)
        return entry

    def page(self, after: int, limit: int) -> Iterator[Submission]:
        """Entries with seq > after (seq counts from 1 and equals the position + 1)."""
        yield from self.entries[max(after, 0) : max(after, 0) + limit]

    # -- Idempotency-Key ------------------------------------------------------------------------------

    def begin(self, family: str, key: str, body: bytes, now: float, ttl: float) -> _Entry | Verdict:
        """The cached first answer for this key, or why not: `new` (reserved now: serve the request),
        `busy` (the first request is still being served), `mismatch` (same key, different body)."""
        self._purge(now)
        fingerprint = hashlib.sha256(body).hexdigest()
        found = self._keys.get((family, key))
        if found is None:
            self._keys[(family, key)] = _Entry(fingerprint, now + ttl)
            heapq.heappush(self._expiry, (now + ttl, family, key))
            return "new"
        if found.fingerprint != fingerprint:
            return "mismatch"
        return found if found.job is not None else "busy"

    def done(self, family: str, key: str, job: Job, reply: Any) -> None:
        entry = self._keys.get((family, key))
        if entry is not None:
            entry.job, entry.reply = job, reply

    def abandon(self, family: str, key: str) -> None:
        """The request created no job (rejected, or the handler failed): the key may be used again."""
        entry = self._keys.get((family, key))
        if entry is not None and entry.job is None:
            del self._keys[(family, key)]

    def _purge(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, family, key = heapq.heappop(heap)
            entry = self._keys.get((family, key))
            if entry is not None and entry.expires <= now:
                del self._keys[(family, key)]

    def clear(self) -> None:
        self.entries.clear()
        self._keys.clear()
        self._expiry.clear()
