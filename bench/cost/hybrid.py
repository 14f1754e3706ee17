"""The hybrid in bench.cost's world: the fleet with `overflow`, and the overflow routing a dispatch worker does.

The real autoscaler sizes the fleet (offload/autoscale/hybrid.py: the base load, and machines the waiting work
justifies). After each of its evaluations the router here asks `overflow.predicted_wait` for every waiting job,
in queue order, from what it can see (machines serving and idle, the queue's mean run time from the store's
histogram blended with the block's `run_time` prior as the autoscaler does, booting machines expected ready a
measured boot after their rental, never their actual boot time):
while some job would start later than `after` past its arrival, it claims that many jobs from the head of the
queue for the serverless backend (the oldest have the least time left). A serverless job starts after a cold
start drawn from `Prices.cold`, is billed for its cold start and run by the second at `Prices.serverless`, and is
completed through the store, so the autoscaler's run histogram and arrival count see it like any other.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any

from bench.cost.world import QUEUE, START, CostWorld, Hosts, Policy
from offload.autoscale import overflow
from offload.autoscale.hybrid import expected_run
from offload.autoscale.settings import Overflow
from offload.errors import StaleLease
from offload.queue.keyspace import gpu_worker as worker_key

OVERFLOW_WORKER = "serverless"
LEASE_MS = 6 * 3600 * 1000  # a serverless job's lease: its backend answers long before


@dataclass(frozen=True)
class Prices:
    """What each kind of capacity costs. Defaults: the issue's (a rented GPU at $1.00/h, the same GPU serverless
    at $2.50/h billed per second, a 5-20 s cold start, billed)."""

    rented: float = 1.00  # $ per GPU-hour
    serverless: float = 2.50  # $ per GPU-hour, billed per second
    cold: tuple[float, float] = (5.0, 20.0)  # seconds, uniform


def colds(jobs: list[tuple[float, float]], prices: Prices, seed: int) -> list[float]:
    """Each job's serverless cold start, drawn the same for serverless-only (mix.py) and the hybrid."""
    rng = random.Random(seed + 7)
    return [rng.uniform(*prices.cold) for _ in jobs]


class HybridWorld(CostWorld):
    """CostWorld whose queue also overflows to a serverless backend (policy.overflow must be set)."""

    def __init__(
        self, r: Any, jobs: list[tuple[float, float]], policy: Policy, hosts: Hosts, prices: Prices, seed: int = 0
    ):
        assert policy.overflow is not None
        super().__init__(r, jobs, policy, hosts, seed)
        self.prices = prices
        self.colds = colds(jobs, prices, seed)
        self.flow = Overflow.model_validate({"backends": ["serverless"], **policy.overflow})
        self.remote: list[tuple[float, str, str, int]] = []  # (done at, job id, lease token, trace index)
        self.boot_seen: list[float] = []
        self.lo = 0  # every job before it has started

    async def machines(self) -> None:
        before = set(self.gpus)
        await super().machines()
        for pid in set(self.gpus) - before:
            rental = self.gpus[pid].rental
            self.boot_seen.append((rental.boot_at or rental.created) - rental.created)

    def expected_boot(self) -> float:
        recent = self.boot_seen[-5:]
        return sum(recent) / len(recent) if recent else 180.0

    async def route(self) -> None:
        """Claim for serverless the jobs the fleet is predicted not to start within `after` of their arrival."""
        run_s = await expected_run(self.store, QUEUE, self.flow)
        rate = 60 / run_s if run_s > 0 else 0.0
        now = self.clock()
        serving = [g for g in self.gpus.values() if await self.r.hget(worker_key(g.id), "draining") != "1"]
        idle = sum(1 for g in serving if g.job is None)
        boot = self.expected_boot()
        booting = [r.created + boot - now for pid, r in self.by_id.items() if r.gone is None and pid not in self.gpus]
        waiting = self.waiting()
        late = 0
        for position, n in enumerate(waiting):
            wait = overflow.predicted_wait(position, idle, len(serving), rate, booting)
            if wait is None or now + wait - self.arrival(n) > self.flow.after:
                late += 1
        if late:
            await self.overflow(late)

    def waiting(self) -> list[int]:
        """Trace indices enqueued and not yet claimed, in queue order."""
        while self.lo < self.next_job and self.lo in self.served.started:
            self.lo += 1
        return [n for n in range(self.lo, self.next_job) if n not in self.served.started]

    def arrival(self, n: int) -> float:
        return START + self.jobs[n][0]

    async def overflow(self, n: int) -> None:
        now = self.clock()
        for job in await self.store.claim(QUEUE, OVERFLOW_WORKER, n, lease_ms=LEASE_MS):
            k = self.index[job.id]
            cold = self.colds[k]
            self.served.started.setdefault(k, now + cold)
            self.served.serverless_s += cold + self.jobs[k][1]
            self.remote.append((now + cold + self.jobs[k][1], job.id, job.token, k))

    async def finish_remote(self) -> None:
        now, left = self.clock(), []
        for done_at, job_id, token, k in self.remote:
            if done_at > now:
                left.append((done_at, job_id, token, k))
                continue
            with contextlib.suppress(StaleLease):
                await self.store.complete(job_id, token, "results/x.json")
                self.completed += 1
                self.served.done_by.setdefault(k, []).append("serverless")
        self.remote = left

    def next_event(self, next_tick: float) -> float:
        t = super().next_event(next_tick)
        return min([t, *(d for d, *_ in self.remote if d > self.clock())])

    async def after_tick(self) -> None:
        await self.route()

    async def each_event(self) -> None:
        await self.finish_remote()
