"""What a dispatch worker is told: its queue, backend, limits (slots, prefetch, submit gate), timings, caps and
prices; and what follows from them (how many jobs it leases, what one submission reserves, what a run cost).

Every default that is also a setting has one home: a queue's in offload/models.py (as offload/config.py's
QueueSettings uses them), a backend's in its settings model (offload/backends/settings.py), read from there;
`from_settings` builds the options of one queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from offload.backends.base import RemoteResult
from offload.backends.settings import HttpJobSettings
from offload.caps import reservation
from offload.config import Settings
from offload.models import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_POLL_TIMEOUT_S,
    DEFAULT_SUBMIT_CONCURRENCY,
    ClaimMode,
)
from offload.queue.store import DEFAULT_LEASE_MS

DRAIN_GRACE_S = 30.0  # how long a drain lets the jobs in flight finish (a second signal cuts it)


def _default(model: type[BaseModel], name: str) -> Any:
    """The default of setting `name` of `model`, read from the model itself."""
    return model.model_fields[name].default


@dataclass
class WorkerOptions:
    queue: str
    backend_name: str
    concurrency: int = DEFAULT_CONCURRENCY
    lease_ms: int = DEFAULT_LEASE_MS
    poll_interval: float = DEFAULT_POLL_INTERVAL_S
    poll_timeout: float = DEFAULT_POLL_TIMEOUT_S
    # a 404 for a remote job not yet seen: the status lagging (worker/lag.py)
    not_found_grace_s: float = _default(HttpJobSettings, "not_found_grace_s")
    # at poll_timeout, submit again although the backend cannot cancel
    resubmit_on_timeout: bool = _default(HttpJobSettings, "resubmit_on_timeout")
    first_poll: float = 0.25
    claim_batch: int = 500
    grace_s: float = DRAIN_GRACE_S
    # The backend's `timeout` per request: a drain awaits the submit calls already out at least this long (plus
    # drain.RECORD_S to checkpoint their answers), even past `grace_s`.
    backend_timeout: float = _default(HttpJobSettings, "timeout")
    backend_timeout_max: float | None = None  # a routed queue's longest backend `timeout` (the drain's bound)
    daily_job_cap: int | None = None
    daily_spend_cap: float | None = None
    price_per_job: float | None = None
    price_per_second: float | None = None
    max_job_cost: float | None = None
    ingest_list: str | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    submit_retries_on_429: int = 8  # also the resends of a submit answered 409 (its key still being served)
    submit_concurrency: int = DEFAULT_SUBMIT_CONCURRENCY
    prefetch: int | None = None  # jobs leased beyond `concurrency`, ready for the next free slot (None: paced)
    # An idle worker's claims back off from 20 ms to this. Jobs made ready wake it at once (wakeups.py); the poll
    # is the fallback for a lost wake-up, and how soon a due delayed or retrying job is seen.
    idle_poll_max: float = 0.5
    # Webhooks (`server.public_url` set and a backend whose provider calls back): the URL prefix
    # `<public_url>/v1/hooks/<backend>`, the fallback poll interval, and how long a job whose earlier
    # submission's outcome is unknown waits for that submission's webhook before submitting again.
    hook_base: str | None = None
    hook_poll_interval: float = _default(HttpJobSettings, "webhook_poll_interval_s")
    hook_grace_s: float = 0.0
    # A GPU-worker queue's serverless overflow: claims take only the jobs the fleet will not start within
    # `overflow_after` seconds (claim mode "overflow", pick.lua)
    claim_mode: ClaimMode = ""
    overflow_after: float = 0.0

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        queue: str,
        *,
        concurrency: int | None = None,
        grace_s: float = DRAIN_GRACE_S,
        lease_ms: int | None = None,
    ) -> WorkerOptions:
        """The options of a worker serving `queue` as configured; `concurrency` and `lease_ms` override."""
        q = settings.queue(queue)
        backend_name, bs = settings.backend_for(queue)
        caps = settings.cap_limits(queue)
        routed = len(q.served_backends) > 1
        flow = None if q.dispatched else settings.overflow(queue)
        return cls(
            queue=queue,
            backend_name=backend_name,
            concurrency=concurrency or q.concurrency,
            poll_interval=q.poll_interval,
            poll_timeout=q.poll_timeout,
            not_found_grace_s=bs.not_found_grace_s,
            resubmit_on_timeout=bs.resubmit_on_timeout,
            grace_s=grace_s,
            backend_timeout=bs.timeout,
            daily_job_cap=q.daily_job_cap,
            daily_spend_cap=q.daily_spend_cap,
            price_per_job=bs.price_per_job,
            price_per_second=bs.price_per_second,
            # a routed queue reserves what its dearest backend may cost (the route is chosen after the claim)
            max_job_cost=caps.reserve if routed and caps is not None else bs.max_job_cost,
            backend_timeout_max=max(b.timeout for _, b in settings.backends_for(queue)),
            ingest_list=q.ingest_list,
            max_attempts=q.max_attempts,
            submit_concurrency=q.submit_concurrency,
            hook_base=settings.hook_base(backend_name),
            hook_poll_interval=bs.webhook_poll_interval_s,
            hook_grace_s=settings.hook_grace_s(backend_name),
            claim_mode="overflow" if flow is not None else "",
            overflow_after=flow.after if flow is not None else 0.0,
            **({"lease_ms": lease_ms} if lease_ms is not None else {}),
        )

    @property
    def capped(self) -> bool:
        """Whether a daily job or spend cap applies to this worker's submissions."""
        return self.daily_job_cap is not None or self.daily_spend_cap is not None

    @property
    def leased_max(self) -> int:
        """How many jobs before or in their remote work the worker holds at least: `concurrency` at the provider
        plus `prefetch` claimed ahead. The ones ahead keep every slot busy while a claim is on its way; by
        default a quarter of `concurrency` (at least 1, at most `claim_batch`), raised by `prefetch.Prefetch`
        as far as the pace of the jobs needs (up to `concurrency`), so that on long jobs workers beside this one
        still get their share of a short queue. None by default under a daily cap: a job claimed ahead when the
        cap is reached is held until the next window, and a cap is where hoarding costs most."""
        if self.prefetch is not None:
            ahead = self.prefetch
        elif self.capped:
            ahead = 0
        else:
            ahead = min(max(self.concurrency // 4, 1), self.claim_batch)
        return self.concurrency + max(ahead, 0)

    @property
    def reservation(self) -> float:
        """What one submission is reserved at against the spend cap before it is sent (offload.caps)."""
        return reservation(
            max_job_cost=self.max_job_cost,
            price_per_job=self.price_per_job,
            price_per_second=self.price_per_second,
            poll_timeout=self.poll_timeout,
        )

    def cost(self, result: RemoteResult) -> float | None:
        """What a finished remote run cost: as reported, else billed seconds times the price, else the price
        per job; None when unknown (its reservation then stands as its cost)."""
        if result.cost is not None:
            return result.cost
        if self.price_per_second is not None and result.duration_s is not None:
            return self.price_per_second * result.duration_s
        return self.price_per_job
