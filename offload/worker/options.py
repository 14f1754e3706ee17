"""What a dispatch worker is told: its queue, backend, limits (slots, prefetch, submit gate), timings, caps and
prices; and what follows from them (how many jobs it leases, what one submission reserves, what a run cost)."""

from __future__ import annotations

from dataclasses import dataclass

from offload.backends.base import RemoteResult
from offload.caps import reservation


@dataclass
class WorkerOptions:
    queue: str
    backend_name: str
    concurrency: int = 256
    lease_ms: int = 10_000
    poll_interval: float = 5.0
    poll_timeout: float = 600.0
    not_found_grace_s: float = 30.0  # a 404 for a remote job not yet seen: the status lagging (worker/lag.py)
    resubmit_on_timeout: bool = False  # at poll_timeout, submit again although the backend cannot cancel
    first_poll: float = 0.25
    claim_batch: int = 500
    grace_s: float = 30.0
    # The backend's `timeout` per request: a drain awaits the submit calls already out at least this long (plus
    # dispatch.RECORD_S to checkpoint their answers), even past `grace_s`.
    backend_timeout: float = 30.0
    daily_job_cap: int | None = None
    daily_spend_cap: float | None = None
    price_per_job: float | None = None
    price_per_second: float | None = None
    max_job_cost: float | None = None
    ingest_list: str | None = None
    max_attempts: int = 3
    submit_retries_on_429: int = 8  # also the resends of a submit answered 409 (its key still being served)
    submit_concurrency: int = 32
    prefetch: int | None = None  # jobs leased beyond `concurrency`, ready for the next free slot (None: paced)
    # An idle worker's claims back off from 20 ms to this. Jobs made ready wake it at once (wakeups.py); the poll
    # is the fallback for a lost wake-up, and how soon a due delayed or retrying job is seen.
    idle_poll_max: float = 0.5

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

    # Webhooks (`server.public_url` set and a backend whose provider calls back): the URL prefix
    # `<public_url>/v1/hooks/<backend>`, the fallback poll interval, and how long a job whose earlier
    # submission's outcome is unknown waits for that submission's webhook before submitting again.
    hook_base: str | None = None
    hook_poll_interval: float = 60.0
    hook_grace_s: float = 0.0

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
