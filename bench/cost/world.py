"""The simulated world `bench.cost` measures in: a settable clock, GPU machines on the mock provider that boot (or
never do), work through the real queue store one job at a time, and may be pre-empted, and the real autoscaler
ticking every poll. Real Valkey underneath; nothing sleeps: the clock jumps from one event to the next.

The tests' worlds (tests/support/autoscale_world.py) share the clock and the GPU worker's registry record.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Any

from offload.autoscale.providers import LaunchSpec, Machine
from offload.autoscale.providers.mock import MockConfig, MockProvider
from offload.autoscale.scaler import Autoscaler
from offload.config import Settings
from offload.errors import StaleLease
from offload.queue.keyspace import GPU_WORKERS as INDEX
from offload.queue.keyspace import gpu_worker as worker_key
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

QUEUE = "gpu"
START = 1_800_000_000.0  # 2027-01-15 08:00 UTC: a fixed instant, so every run replays exactly


@dataclass
class Clock:
    t: float = START

    def __call__(self) -> float:
        return self.t

    def ms(self) -> int:
        """The same instant in integer milliseconds: a QueueStore's clock."""
        return int(self.t * 1000)

    def advance(self, seconds: float) -> None:
        self.t += seconds


async def put_worker(
    redis: RedisClient,
    worker_id: str,
    queue: str,
    instance_id: str | None,
    now: float,
    *,
    in_flight: int = 0,
    protected: bool = False,
) -> None:
    """A GPU worker's registry record, as the server's WorkerRegistry writes it (register + heartbeat)."""
    await redis.hset(
        worker_key(worker_id),
        mapping={
            "id": worker_id,
            "key_id": "k",
            "host": "gpu-host",
            "version": "test",
            "queues": queue,
            "pid": 1,
            "concurrency": 1,
            "instance_id": instance_id or "",
            "protected": int(protected),
            "gpus": "[]",
            "last_heartbeat": int(now * 1000),
            "in_flight": in_flight,
        },
    )
    await redis.hsetnx(worker_key(worker_id), "registered_at", int(now * 1000))  # at its registration only
    await redis.zadd(INDEX, {worker_id: int(now * 1000)})


async def drop_worker(redis: RedisClient, worker_id: str) -> None:
    await redis.delete(worker_key(worker_id))
    await redis.zrem(INDEX, worker_id)


@dataclass(frozen=True)
class Policy:
    """One autoscaling policy as offload.yaml would state it."""

    name: str
    max_workers: int
    jobs_per_worker: int | None = None  # None: the guide's triggers (no_workers, queue_depth, latency)
    idle_timeout: float = 600.0
    poll: float = 30.0
    boot_timeout: float = 1200.0
    by_cost: bool = False  # scale in by cost (the `cost` scale-down trigger) besides the idle timeout
    overflow: dict[str, Any] | None = None  # the autoscale block's `overflow` (a hybrid: bench/cost/hybrid.py)

    def block(self, price: float) -> dict[str, Any]:
        up: list[dict[str, Any]] = [{"trigger": "no_workers"}]
        if self.jobs_per_worker is None:
            up += [
                {"trigger": "queue_depth", "threshold": 10},
                {"trigger": "latency", "max_latency": f"{2 * self.poll:g}s"},
            ]
        block: dict[str, Any] = {
            "enabled": True,
            "provider": "m",
            "max_workers": self.max_workers,
            "poll_interval": f"{self.poll:g}s",
            "boot_timeout": f"{self.boot_timeout:g}s",
            "scale_up": up,
            "scale_down": [{"trigger": "idle", "timeout": f"{self.idle_timeout:g}s"}]
            + ([{"trigger": "cost"}] if self.by_cost else []),
            "instance": {"gpu": "RTX 4090", "image": "img", "max_price_per_hour": price},
        }
        if self.jobs_per_worker is not None:
            block["jobs_per_worker"] = self.jobs_per_worker
        if self.overflow is not None:
            block["overflow"] = self.overflow
        return block


@dataclass(frozen=True)
class Hosts:
    """How rented machines behave: boot time, the share that never boots, pre-emptions, price."""

    boot: tuple[float, float] = (120.0, 240.0)  # seconds, uniform
    p_never_boot: float = 0.0
    p_preempt: float = 0.0  # a machine that boots is pre-empted at a uniform time in its first `preempt_within`
    preempt_within: float = 4 * 3600.0
    price: float = 0.5  # $ per GPU-hour (python -m bench.cost sets --rented, $1.00 by default)


@dataclass
class Rental:
    """One machine's life at the provider, as the bill sees it."""

    provider_id: str
    created: float
    boot_at: float | None  # its worker registers then; None: never
    preempt_at: float | None = None
    gone: float | None = None  # destroyed or pre-empted
    jobs: int = 0


@dataclass
class Gpu:
    """The worker on a booted machine: one job at a time."""

    id: str
    instance: str
    rental: Rental
    job: tuple[str, str, int] | None = None  # (id, lease token, trace index)
    done_at: float = 0.0


class BilledMock(MockProvider):
    """The mock provider, recording each machine's life (created, booted, gone) for the bill."""

    def __init__(self, world: CostWorld) -> None:
        super().__init__("m", MockConfig(price_per_hour=world.hosts.price), world.r, world.clock)
        self.world = world

    async def create(self, spec: LaunchSpec) -> Machine:
        machine = await super().create(spec)
        self.world.rented(machine.provider_id)
        return machine

    async def destroy(self, provider_id: str) -> None:
        await super().destroy(provider_id)
        self.world.gone(provider_id)


@dataclass
class Served:
    """What happened to the trace's jobs: when each started, and every rental."""

    started: dict[int, float] = field(default_factory=dict)  # trace index -> claim time
    rentals: list[Rental] = field(default_factory=list)
    end: float = START
    done: int = 0  # jobs completed
    done_by: dict[int, list[str]] = field(default_factory=dict)  # trace index -> the kinds that completed it
    serverless_s: float = 0.0  # seconds billed by serverless backends (a hybrid's overflow)


class CostWorld:
    """Plays a trace of (arrival s, run s) jobs through one policy; `run()` returns what was served and rented."""

    def __init__(self, r: Any, jobs: list[tuple[float, float]], policy: Policy, hosts: Hosts, seed: int = 0) -> None:
        self.r, self.jobs, self.policy, self.hosts = r, jobs, policy, hosts
        self.rng = random.Random(seed)
        self.clock = Clock()
        self.store = QueueStore(r, clock_ms=self.clock.ms)
        self.provider = BilledMock(self)
        self.served = Served()
        self.by_id: dict[str, Rental] = {}
        self.gpus: dict[str, Gpu] = {}  # by provider id
        self.index: dict[str, int] = {}  # job id -> trace index
        self.next_job = 0
        self.completed = 0
        settings = Settings.model_validate(
            {
                "queues": {QUEUE: {"autoscale": policy.block(hosts.price)}},
                "autoscaler": {"worker_key": "ofk_worker_key", "leader_ttl": 4 * policy.poll},
            }
        )
        self.scaler = Autoscaler(
            r,
            settings,
            clock=self.clock,
            owner="bench",
            provider_override={"m": self.provider},
            drain_settle=0.0,
            env={},
        )

    # -- the bill -------------------------------------------------------------------------------------------

    def rented(self, provider_id: str) -> None:
        now, h, rng = self.clock(), self.hosts, self.rng
        boot = None if rng.random() < h.p_never_boot else now + rng.uniform(*h.boot)
        preempt = boot + rng.uniform(0, h.preempt_within) if boot is not None and rng.random() < h.p_preempt else None
        rental = Rental(provider_id, now, boot, preempt)
        self.by_id[provider_id] = rental
        self.served.rentals.append(rental)

    def gone(self, provider_id: str) -> None:
        rental = self.by_id.get(provider_id)
        if rental is not None and rental.gone is None:
            rental.gone = self.clock()

    # -- the machines' side ---------------------------------------------------------------------------------

    async def arrivals(self) -> None:
        now = self.clock()
        first = self.next_job
        while self.next_job < len(self.jobs) and START + self.jobs[self.next_job][0] <= now:
            self.next_job += 1
        if self.next_job > first:
            # ids in trace order: jobs that arrive together tie on their score, and the store then orders them by
            # id (random ones would hand a burst's cold starts, drawn per trace index, out differently each play)
            specs = [JobSpec(input={"n": i}, job_id=f"{QUEUE}:{i:028x}") for i in range(first, self.next_job)]
            ids = await self.store.enqueue_many(QUEUE, specs)
            self.index.update(zip(ids, range(first, self.next_job), strict=True))

    async def machines(self) -> None:
        """Boots and pre-emptions due now; workers die with their machine."""
        now = self.clock()
        for pid, rental in list(self.by_id.items()):
            if rental.gone is not None:
                if (gpu := self.gpus.pop(pid, None)) is not None:
                    await drop_worker(self.r, gpu.id)
                continue
            if rental.preempt_at is not None and now >= rental.preempt_at:
                await self.provider.vanish(pid)
                self.gone(pid)
                if (gpu := self.gpus.pop(pid, None)) is not None:
                    await drop_worker(self.r, gpu.id)
            elif pid not in self.gpus and rental.boot_at is not None and now >= rental.boot_at:
                label = next((m.label for m in await self.provider.list() if m.provider_id == pid), "")
                self.gpus[pid] = Gpu(f"r-{pid}", label.removeprefix("offload-"), rental)
                await self.beat(self.gpus[pid])

    async def work(self) -> None:
        """Each worker finishes its job when due and claims the next unless its machine is being retired."""
        now = self.clock()
        lease = int(3 * self.policy.poll * 1000)
        for gpu in self.gpus.values():
            if gpu.job is not None and now >= gpu.done_at:
                with contextlib.suppress(StaleLease):
                    await self.store.complete(gpu.job[0], gpu.job[1], "results/x.json")
                    self.completed += 1
                    self.served.done_by.setdefault(gpu.job[2], []).append("fleet")
                gpu.job = None
                await self.beat(gpu)
            if gpu.job is None and await self.r.hget(worker_key(gpu.id), "draining") != "1":
                got = await self.store.claim(QUEUE, gpu.id, 1, lease_ms=lease)
                if got:
                    n = self.index[got[0].id]
                    gpu.job = (got[0].id, got[0].token, n)
                    gpu.done_at = now + self.jobs[n][1]
                    self.served.started.setdefault(n, now)
                    gpu.rental.jobs += 1
                    await self.beat(gpu)

    async def beat(self, gpu: Gpu) -> None:
        draining = await self.r.hget(worker_key(gpu.id), "draining")
        await put_worker(self.r, gpu.id, QUEUE, gpu.instance, self.clock(), in_flight=int(gpu.job is not None))
        if gpu.job is not None:
            await self.store.heartbeat(QUEUE, gpu.id, [gpu.job[0]], lease_ms=int(3 * self.policy.poll * 1000))
        if draining == "1":
            await self.r.hset(worker_key(gpu.id), "draining", 1)

    async def each_event(self) -> None:
        """A hook for worlds with more than the fleet (bench/cost/hybrid.py)."""

    async def after_tick(self) -> None:
        """A hook run after each autoscaler evaluation."""

    # -- the run --------------------------------------------------------------------------------------------

    def next_event(self, next_tick: float) -> float:
        times = [next_tick]
        if self.next_job < len(self.jobs):
            times.append(START + self.jobs[self.next_job][0])
        times += [g.done_at for g in self.gpus.values() if g.job is not None]
        for rental in self.by_id.values():
            if rental.gone is None:
                times += [t for t in (rental.boot_at, rental.preempt_at) if t is not None and t > self.clock()]
        return max(self.clock(), min(times))

    async def run(self, limit: float) -> Served:
        """Until every job is done and every machine gone (or `limit` seconds of simulated time)."""
        next_tick = START
        while self.clock() < START + limit:
            await self.arrivals()
            await self.machines()
            await self.each_event()
            await self.work()
            if self.clock() >= next_tick:
                for gpu in self.gpus.values():
                    await self.beat(gpu)
                await self.store.reap(QUEUE)
                await self.scaler.tick()
                await self.after_tick()
                next_tick = self.clock() + self.policy.poll
                if self.completed >= len(self.jobs) and not await self.provider.all_ids():
                    break
            self.clock.t = self.next_event(next_tick)
        self.served.end = self.clock()
        self.served.done = self.completed
        for rental in self.served.rentals:
            if rental.gone is None:
                rental.gone = self.clock()
        await self.scaler.aclose()
        return self.served
