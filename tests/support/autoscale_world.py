"""A simulated world for the autoscaler: a clock, a provider whose every call can fail in each of the ways real
ones do, GPU machines that boot (or never do), work, hang or get pre-empted, two servers sharing one Redis, and
the checks that say whether the autoscaler kept its promises. Real Valkey and the real job store underneath.

Everything random comes from one `random.Random`, so a scenario replays exactly from its parameters (the property
test draws them with hypothesis, which shrinks a failing one to a small counterexample).

What the world records, for the invariants:
- `creates`: every create call, with its time; `events`: every change that may justify renting (a burst, a pause
  or resume, a schedule fire, a failure, a pre-emption, a leader change, a day rollover);
- `violations`: a busy or protected machine destroyed, more machines billed than max_workers, spend past the cap;
- `failures`: what went wrong (a failed instance, a failed or ambiguous create, a teardown that keeps failing),
  each of which must be covered by an alert.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bench.cost.world import Clock, drop_worker, put_worker
from offload.autoscale import keyspace
from offload.autoscale.instances import InstanceStore
from offload.autoscale.providers import LaunchSpec, Machine, OutOfCapacity, ProviderError
from offload.autoscale.providers.mock import MockConfig, MockProvider
from offload.autoscale.scaler import Autoscaler
from offload.config import Settings
from offload.errors import StaleLease
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.redis_client import RedisClient

QUEUE = "gpu"
DAY0 = datetime(2027, 3, 28, tzinfo=UTC).timestamp()  # a Sunday: Europe's clocks go forward at 01:00 UTC
CREATE_OUTCOMES = ("ok", "no_offer", "http_5xx", "timeout_created", "crash_created")


class Crash(BaseException):
    """The server process dies inside a provider call (not an Exception: nothing may catch it on the way)."""


@dataclass
class Scenario:
    """One simulated day. Times are minutes after midnight UTC of DAY0 unless named otherwise."""

    poll: int = 300  # seconds
    tz: str = "UTC"
    min_workers: int = 0
    max_workers: int = 2
    idle_timeout: int = 30  # minutes
    boot_timeout: int = 30  # minutes
    triggers: tuple[str, ...] = ("no_workers",)
    up_schedules: tuple[tuple[str, int, int], ...] = ()  # (cron, workers, duration minutes)
    down_schedules: tuple[str, ...] = ()
    bursts: tuple[tuple[int, int], ...] = ()  # (minute, jobs)
    pauses: tuple[tuple[int, int], ...] = ()  # (minute, length in minutes)
    job_minutes: tuple[int, int] = (5, 60)
    boot_minutes: tuple[int, int] = (2, 12)
    create_weights: tuple[int, ...] = (10, 0, 0, 0, 0)  # ok, no_offer, http_5xx, timeout_created, crash_created
    p_boot_never: float = 0.0
    p_preempt: float = 0.0
    p_hang: float = 0.0
    p_destroy_fail: float = 0.0
    p_self_protect: float = 0.0
    protect_ops: tuple[tuple[int, int], ...] = ()  # (minute to protect the newest instance, minutes held)
    leader_stalls: tuple[tuple[int, int], ...] = ()  # (minute, minutes the leading server stops)
    spend_cap: float | None = None
    price: float = 0.5
    cooldown: int = 0  # alert cooldown, minutes
    seed: int = 0

    def block(self) -> dict[str, Any]:
        up: list[dict[str, Any]] = []
        for t in self.triggers:
            if t == "no_workers":
                up.append({"trigger": "no_workers"})
            elif t == "queue_depth":
                up.append({"trigger": "queue_depth", "threshold": 10})
            elif t == "latency":
                up.append({"trigger": "latency", "max_latency": f"{2 * self.poll}s"})
        up += [
            {"trigger": "schedule", "cron": c, "workers": min(w, self.max_workers), "duration": f"{d}m"}
            for c, w, d in self.up_schedules
        ]
        down: list[dict[str, Any]] = [{"trigger": "idle", "timeout": f"{self.idle_timeout}m"}]
        down += [{"trigger": "schedule", "cron": c} for c in self.down_schedules]
        block: dict[str, Any] = {
            "enabled": True,
            "provider": "m",
            "min_workers": min(self.min_workers, self.max_workers),
            "max_workers": self.max_workers,
            "poll_interval": f"{self.poll}s",
            "boot_timeout": f"{self.boot_timeout}m",
            "timezone": self.tz,
            "scale_up": up,
            "scale_down": down,
            "instance": {"gpu": "RTX 4090", "image": "img", "max_price_per_hour": self.price},
        }
        if self.spend_cap is not None:
            block["daily_spend_cap"] = self.spend_cap
        return block


@dataclass
class Fate:
    """What will happen to one rented machine, drawn when it is created."""

    boot_at: float | None  # its worker registers then; None: never (bad image, crash loop)
    preempt_at: float | None = None
    hang_at: float | None = None  # the worker stops heart-beating (machine hung)
    self_protect: bool = False


@dataclass
class GpuWorker:
    id: str
    instance: str
    provider_id: str
    protected: bool
    job: tuple[str, str] | None = None
    done_at: float = 0.0
    hung: bool = False


class ChaosMock(MockProvider):
    """The mock provider, with the world deciding each create's and destroy's fate."""

    def __init__(self, world: World, name: str = "m") -> None:
        super().__init__(name, MockConfig(price_per_hour=world.sc.price), world.r, world.clock)
        self.world = world

    async def create(self, spec: LaunchSpec) -> Machine:
        w = self.world
        w.creates.append(w.clock())
        outcome = "ok" if w.healthy else w.rng.choices(CREATE_OUTCOMES, weights=w.sc.create_weights)[0]
        inst_id = spec.label.removeprefix("offload-")
        if outcome == "no_offer":
            w.fail(f"create: no offer ({spec.label})", instance=inst_id)
            raise OutOfCapacity("chaos: no offer")
        if outcome == "http_5xx":
            w.fail(f"create: HTTP 503, nothing rented ({spec.label})", instance=inst_id)
            raise ProviderError("chaos: POST /pods: HTTP 503", ambiguous=True)
        machine = await super().create(spec)
        w.fates[machine.provider_id] = w.draw_fate()
        if outcome == "timeout_created":
            w.fail(f"create: timed out, rented anyway ({spec.label})", instance=inst_id)
            raise ProviderError("chaos: POST /pods: ReadTimeout (the request may have gone through)", ambiguous=True)
        if outcome == "crash_created":
            w.event("server crash mid-create")
            raise Crash
        return machine

    async def destroy(self, provider_id: str) -> None:
        w = self.world
        if not w.healthy and w.rng.random() < w.sc.p_destroy_fail:
            w.unattended += 1  # the machine bills one more poll: not the autoscaler's doing
            raise ProviderError("chaos: DELETE /pods: HTTP 500")
        if provider_id in await self.all_ids():
            await w.check_destroy(provider_id)
        await super().destroy(provider_id)


class World:
    def __init__(self, r: RedisClient, sc: Scenario) -> None:
        self.r = r
        self.sc = sc
        self.rng = random.Random(sc.seed)
        self.clock = Clock(DAY0)
        self.store = QueueStore(r, clock_ms=lambda: int(self.clock() * 1000))
        self.instances = InstanceStore(r)
        self.healthy = False  # the end phase turns every fault off
        self.creates: list[float] = []
        self.events: list[tuple[float, str]] = []
        self.failures: list[tuple[float, str, str]] = []  # (time, what, instance id or "")
        self.violations: list[str] = []
        self.fates: dict[str, Fate] = {}
        self.workers: dict[str, GpuWorker] = {}  # by provider id
        self.preempted: set[str] = set()
        self.enqueued = 0
        self.servers: list[Autoscaler] = []
        self.dead: list[Autoscaler] = []
        self.stalled_until: dict[str, float] = {}
        self.n_servers = 0
        self.provider = ChaosMock(self)
        self.unattended = 0  # machine-polls billed beyond the autoscaler's control (failed destroys, no leader)
        for _ in range(2):
            self.start_server()

    # -- bookkeeping -----------------------------------------------------------------------------------------

    def event(self, what: str) -> None:
        self.events.append((self.clock(), what))

    def fail(self, what: str, *, instance: str = "") -> None:
        self.failures.append((self.clock(), what, instance))
        self.event(what)

    def draw_fate(self) -> Fate:
        now, sc, rng = self.clock(), self.sc, self.rng
        never = not self.healthy and rng.random() < sc.p_boot_never
        boot = None if never else now + rng.uniform(*sc.boot_minutes) * 60
        fate = Fate(boot_at=boot, self_protect=not self.healthy and rng.random() < sc.p_self_protect)
        if not self.healthy and boot is not None and rng.random() < sc.p_preempt:
            fate.preempt_at = boot + rng.uniform(5, 240) * 60
        if not self.healthy and boot is not None and rng.random() < sc.p_hang:
            fate.hang_at = boot + rng.uniform(5, 240) * 60
        return fate

    def start_server(self) -> Autoscaler:
        self.n_servers += 1
        settings = Settings.model_validate(
            {
                "queues": {QUEUE: {"autoscale": self.sc.block()}},
                "autoscaler": {"worker_key": "ofk_worker_key", "leader_ttl": 2 * self.sc.poll},
                "alerts": {"cooldown": self.sc.cooldown * 60},
            }
        )
        s = Autoscaler(
            self.r,
            settings,
            clock=self.clock,
            owner=f"server-{self.n_servers}",
            provider_override={"m": self.provider},
            drain_settle=0.0,
            env={},
        )
        self.servers.append(s)
        return s

    async def check_destroy(self, provider_id: str) -> None:
        """Called just before the provider destroys a machine: was it busy or protected?"""
        if provider_id in self.preempted:
            return
        label = next((m.label for m in await self.provider.list() if m.provider_id == provider_id), "")
        inst = await self.instances.get(label.removeprefix("offload-"))
        reason = inst.reason if inst else ""
        w = self.workers.get(provider_id)
        excused = any(x in reason for x in ("drain_timeout", "spend cap"))
        if w is not None and not w.hung and w.job is not None and not excused:
            self.violations.append(f"{self.when()}: busy machine {provider_id} destroyed ({reason or 'scale-down'})")
        # a worker's own OFFLOAD_PROTECTED counts where the provider honours it (a provider config may have to
        # allow self-protection; the mock here has no such setting: honoured)
        honoured = getattr(self.provider.config, "allow_worker_protect", True)
        if (inst is not None and inst.protect) or (w is not None and w.protected and not w.hung and honoured):
            self.violations.append(f"{self.when()}: protected machine {provider_id} destroyed ({reason})")

    def when(self) -> str:
        return datetime.fromtimestamp(self.clock(), UTC).strftime("%d %H:%M")

    # -- the GPU machines' side ------------------------------------------------------------------------------

    async def fleet_step(self) -> None:
        now = self.clock()
        await self._fleet_changes(now)
        lease = int(3 * self.sc.poll * 1000)
        for pid, w in self.workers.items():
            await self._worker_step(pid, w, now, lease)
        await self.store.reap(QUEUE)

    async def _fleet_changes(self, now: float) -> None:
        """Machines pre-empted at their time, workers of vanished machines dropped, booted machines' started."""
        machines = {m.provider_id: m for m in await self.provider.list()}
        for pid, fate in list(self.fates.items()):
            if pid in machines and fate.preempt_at is not None and now >= fate.preempt_at:
                self.preempted.add(pid)
                self.event(f"pre-empted {pid}")
                await self.provider.vanish(pid)
                machines.pop(pid)
        for pid, w in list(self.workers.items()):
            if pid not in machines:
                await drop_worker(self.r, w.id)
                del self.workers[pid]
        for pid, m in machines.items():
            booting = self.fates.get(pid)
            if pid in self.workers or booting is None or booting.boot_at is None or now < booting.boot_at:
                continue
            self.workers[pid] = GpuWorker(
                f"r-{pid}", m.label.removeprefix("offload-"), pid, protected=booting.self_protect and not self.healthy
            )

    async def _worker_step(self, pid: str, w: GpuWorker, now: float, lease: int) -> None:
        """One GPU worker's step: hang at its time, finish its job, claim the next unless draining, heartbeat."""
        fate = self.fates[pid]
        if not w.hung and fate.hang_at is not None and now >= fate.hang_at:
            w.hung = True
            self.event(f"hung {pid}")
            await drop_worker(self.r, w.id)
        if w.hung:
            return
        if self.healthy:
            w.protected = False
        if w.job is not None and now >= w.done_at:
            with contextlib.suppress(StaleLease):  # its lease was handed back meanwhile (e.g. the spend cap)
                await self.store.complete(w.job[0], w.job[1], f"results/{w.job[0]}.json")
            w.job = None
        draining = await self.r.hget(f"offload:rworker:{w.id}", "draining") == "1"
        if w.job is None and not draining:
            got = await self.store.claim(QUEUE, w.id, 1, lease_ms=lease)
            if got:
                w.job = (got[0].id, got[0].token)
                w.done_at = now + self.rng.uniform(*self.sc.job_minutes) * 60
        if w.job is not None:
            beat = await self.store.heartbeat(QUEUE, w.id, [w.job[0]], lease_ms=lease)
            if w.job[0] in beat.lost:
                w.job = None
        await put_worker(self.r, w.id, QUEUE, w.instance, now, in_flight=int(w.job is not None), protected=w.protected)
        if draining:
            await self.r.hset(f"offload:rworker:{w.id}", "draining", 1)

    # -- the day ---------------------------------------------------------------------------------------------

    async def load_step(self, minute: float, step_minutes: float) -> None:
        for at, n in self.sc.bursts:
            if minute <= at < minute + step_minutes:
                await self.store.enqueue_many(QUEUE, [JobSpec(input={"n": self.enqueued + i}) for i in range(n)])
                self.enqueued += n
                self.event(f"burst {n}")
        for at, length in self.sc.pauses:
            if minute <= at < minute + step_minutes:
                await self.store.pause(QUEUE)
                self.event("pause")
            if minute <= at + length < minute + step_minutes:
                await self.store.resume(QUEUE)
                self.event("resume")
        for at, held in self.sc.protect_ops:
            if minute <= at < minute + step_minutes:
                live = [i for i in await self.instances.live() if i.status in ("booting", "running")]
                if live:
                    await self.instances.set_protect(live[-1].id, True)
                    self.protected_ops.append((live[-1].id, at + held))
            for inst_id, until in list(self.protected_ops):
                if minute <= until < minute + step_minutes:
                    await self.instances.set_protect(inst_id, False)
                    self.protected_ops.remove((inst_id, until))
        for at, length in self.sc.leader_stalls:
            if minute <= at < minute + step_minutes:
                leader = await self.r.get(keyspace.LEADER)
                if leader:
                    self.stalled_until[leader.split("|")[0]] = self.clock() + length * 60
                    self.event("leader stalls")

    protected_ops: list[tuple[str, float]]

    async def tick_servers(self) -> None:
        led = False
        for s in list(self.servers):
            if self.stalled_until.get(s.leader.owner, 0) > self.clock():
                continue
            try:
                led |= await s.tick()
            except Crash:
                self.servers.remove(s)
                self.dead.append(s)
                self.start_server()
        if not led:  # no server evaluated this poll (a stalled or dead leader's lock had not run out)
            self.unattended += self.sc.max_workers

    async def run(self) -> None:
        self.protected_ops = []
        step = self.sc.poll
        day_end = DAY0 + 86_400
        while self.clock() < day_end:
            minute = (self.clock() - DAY0) / 60
            await self.load_step(minute, step / 60)
            await self.fleet_step()
            await self.tick_servers()
            await self.check_tick()
            self.clock.advance(step)
        # The end: faults off, nobody protected, autoscaling switched off; everything must go within 8 hours.
        self.healthy = True
        for inst_id, _ in self.protected_ops:
            await self.instances.set_protect(inst_id, False)
        for inst in await self.instances.live():
            await self.instances.set_protect(inst.id, False)
        await self.store.resume(QUEUE)
        for s in self.servers:
            s.settings.queues[QUEUE].autoscale["enabled"] = False  # type: ignore[index]
        self.stalled_until.clear()
        while self.clock() < day_end + 8 * 3600:
            await self.fleet_step()
            await self.tick_servers()
            await self.check_tick()
            if not await self.provider.all_ids() and not await self.instances.live():
                break
            self.clock.advance(step)

    # -- invariants ------------------------------------------------------------------------------------------

    async def check_tick(self) -> None:
        billed = await self.provider.all_ids()
        if len(billed) > self.sc.max_workers:
            self.violations.append(f"{self.when()}: {len(billed)} machines billed, max_workers {self.sc.max_workers}")
        if self.sc.spend_cap is not None:
            now = self.clock()
            day = datetime.fromtimestamp(now, UTC).strftime("%Y%m%d")
            spent = sum(
                float(v or 0) for v in await self.r.mget(keyspace.cost(QUEUE, day), keyspace.cost(QUEUE, f"dry:{day}"))
            )
            # one poll of the whole fleet, plus a poll per machine the provider refused to destroy and per poll no
            # server evaluated (both only prolong what runs; neither is the autoscaler's decision)
            slack = (self.sc.max_workers + self.unattended) * self.sc.price * self.sc.poll / 3600 + 1e-6
            if spent > self.sc.spend_cap + slack:
                self.violations.append(
                    f"{self.when()}: spent ${spent:.2f} today, cap ${self.sc.spend_cap:.2f} "
                    f"(+ one poll and unattended machine-polls: ${slack:.2f})"
                )
                self.sc = Scenario(**{**self.sc.__dict__, "spend_cap": None})  # report it once

    async def journal(self) -> list[dict[str, str]]:
        return [e for _, e in await self.r.xrange(keyspace.EVENTS)]

    async def verdict(self) -> list[str]:
        """Every invariant that does not hold, as readable lines (empty: all hold)."""
        out = list(dict.fromkeys(self.violations))
        leaked = await self.provider.all_ids()
        live = await self.instances.live()
        if leaked or live:
            out.append(f"leaked at the end: machines {leaked}, live records {[(i.id, i.status) for i in live]}")
        journal = await self.journal()
        failed = [(float(e["ts"]), e["message"], e.get("instance", "")) for e in journal if e.get("kind") == "failed"]
        for inst in await self.instances.recent(10_000):
            if inst.teardown_attempts >= 3:
                failed.append(
                    (inst.teardown_at, f"teardown of {inst.id} failed {inst.teardown_attempts} times", inst.id)
                )
        alerts = [a for s in self.servers + self.dead for a in s.alerter.sent]
        for s in self.servers + self.dead:
            await s.alerter.drain()
        cool = self.sc.cooldown * 60
        for t, what, inst_id in sorted(self.failures + failed):
            # covered: an alert naming the instance, or (with a cooldown) one about the queue within it
            ok = any(
                t - cool - self.sc.poll <= a["ts"] <= t + 2 * self.sc.poll
                and (
                    (inst_id and inst_id in a["message"])
                    or a["subject"] == inst_id
                    or (cool > 0 and a["subject"].split("/")[0] == QUEUE)
                )
                for a in alerts
            )
            if not ok:
                out.append(f"no alert for a failure at {datetime.fromtimestamp(t, UTC):%d %H:%M}: {what}")
        by_subject: dict[tuple[str, str], list[float]] = {}
        for a in alerts:
            by_subject.setdefault((a["kind"], a["subject"]), []).append(a["ts"])
        for (kind, subject), times in by_subject.items():
            times.sort()
            if any(b - a < cool for a, b in itertools.pairwise(times)):
                out.append(f"alert {kind}/{subject} sent twice within the cooldown")
        out += self.loop_check(failed)
        return out

    def loop_check(self, failed: list[tuple[float, str, str]]) -> list[str]:
        """Rentals in any window of 24 polls are at most max_workers x (1 + the changes that could justify them),
        counting changes from one boot timeout + idle timeout before the window (their consequences come late)."""
        sc = self.sc
        events = sorted([t for t, _ in self.events] + [t for t, _, _ in failed] + self.schedule_fires())
        window = 24 * sc.poll
        lag = (sc.boot_timeout + sc.idle_timeout) * 60 + 2 * sc.poll
        out = []
        for start in sorted(set(self.creates)):
            n = sum(1 for t in self.creates if start <= t < start + window)
            e = sum(1 for t in events if start - lag <= t < start + window)
            if n > sc.max_workers * (1 + e):
                out.append(
                    f"{n} rentals in {window / 3600:.1f} h from {datetime.fromtimestamp(start, UTC):%d %H:%M} "
                    f"with only {e} changes to justify them (a rent-and-drain loop?)"
                )
                break
        return out

    def schedule_fires(self) -> list[float]:
        from zoneinfo import ZoneInfo

        from cronsim import CronSim

        out: list[float] = []
        tz = ZoneInfo(self.sc.tz)
        start = datetime.fromtimestamp(DAY0 - 86_400, tz)
        crons = [c for c, _, _ in self.sc.up_schedules] + list(self.sc.down_schedules)
        for cron in crons:
            for t in CronSim(cron, start):
                if t.timestamp() > DAY0 + 2 * 86_400:
                    break
                out.append(t.timestamp())
        out.append(DAY0 + 86_400)  # the UTC day rolls over: a spend cap resets
        return out
