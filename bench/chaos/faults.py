"""The fault schedule: what to break, how often, with one seeded random stream so a run can be repeated.

`Profile` holds the rates (mean seconds between faults; 0 turns one off). `Schedule` runs every fault loop as
an asyncio task against the run's processes: worker SIGKILL (restarted after a container-like pause, in its PID
namespace when there is one) and SIGSTOP past the lease, a worker restarted with its wall clock hours or a day off,
graceful SIGTERM restarts (some cut by a second SIGTERM), Valkey SIGKILL + restart, steps of Valkey's clock back
and forward, the proxy's dropped replies, resets and black-holes, 429 storms at the simulator, an operator
cancelling jobs (`operator`: mostly jobs that wait with a remote job that may still run, handed back by a killed or
stopped worker, else running ones), Valkey at its maxmemory (`oom`: maxmemory lowered under what it holds for a
while, then lifted), Valkey switched to an evicting maxmemory-policy for a while (`eviction`, allkeys-lru with no
maxmemory: nothing is really evicted, the workers must stop paying), and failovers to a replica cut off
(bench/chaos/failover.py). The provider's own faults (5xx, 429s, lost answers, a gateway's 5xx after a submit was
accepted, a status that lags the submit) are the simulator's config (`Profile.sim_config`). Every fault is appended
to `timeline` with its time, which the checker uses to attribute what went wrong to what was done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.chaos.failover import Failover
from bench.chaos.faketime import ClockFile
from bench.chaos.procs import Incarnation, Sim, Valkey, WorkerSlot
from bench.chaos.proxy import FaultProxy
from offload.caps import DAY_S, window_start_s

log = logging.getLogger("chaos")
# a worker's wall clock after a bad RTC, an NTP step or a VM restored from a snapshot: hours or a day either way
WORKER_SKEWS_S = (-DAY_S, -3 * 3600, 3 * 3600, DAY_S)


@dataclass
class Profile:
    """How hard a run pushes. Intervals are means (each wait is drawn uniformly from 0.5x to 1.5x)."""

    minutes: float = 10.0
    workers: int = 3
    concurrency: int = 200
    jobs_per_s: float = 21.0
    lease_ms: int = 3000
    kill_every: float = 2.0
    restart_delay: tuple[float, float] = (0.2, 1.0)
    stop_every: float = 30.0
    stop_lease_factor: tuple[float, float] = (1.5, 3.0)
    valkey_every: float = 150.0
    # a worker slot restarted with its clock skewed (WORKER_SKEWS_S), back on the true clock `worker_clock_s` later
    worker_clock_every: float = 60.0
    worker_clock_s: float = 20.0
    # Valkey's clock stepped back by a random amount in this range, and later forward to the true time again
    valkey_clock_every: float = 45.0
    valkey_clock_step_s: tuple[float, float] = (300.0, 3600.0)
    drop_every: float = 3.0
    reset_every: float = 45.0
    blackhole_every: float = 90.0
    blackhole_s: float = 3.0
    delay_ms: float = 0.0
    storm_every: float = 60.0
    storm_s: float = 4.0
    cancel_every: float = 5.0
    # graceful restarts (`systemctl restart`: SIGTERM, the workers' --grace 2) of the worker holding the most
    # leases, right after a burst of `drain_burst` jobs, a share of them cut by a second SIGTERM after
    # `drain_cut_after` seconds; with them on, jobs wait at the submit gate and the rate limit (options.profile_for)
    drain_every: float = 40.0
    drain_burst: int = 40
    drain_cut_share: float = 0.3
    drain_cut_after: tuple[float, float] = (0.1, 1.0)
    submit_concurrency: int | None = None  # the queues' setting (None: offload's default)
    rate_limit: str | None = None  # the backend's (None: none)
    failover_every: float = 150.0
    failover_cut_s: float = 4.0  # how long the replica is cut off before it is promoted
    hostile_every: float = 20.0  # with the server (--webhooks): bad-key bursts and trickled bodies (hostile.py)
    server_restart_every: float = 60.0  # with the server (--webhooks): a deploy's restart (hooks.Deploys)
    error_rate: float = 0.05
    rate_429: float = 0.01
    lost_response_rate: float = 0.002
    fail_rate: float = 0.02
    gateway_error_rate: float = 0.01  # submits created, then answered a gateway's 502/504/524 page
    status_lag: float = 1.0  # seconds a job's status answers 404 after its submit
    # the workers' `not_found_grace_s`: past the lag and short of `result_ttl`, as the default 30 s is to a
    # provider's lag of seconds and its results kept for 30 min (a grace past result_ttl only delays the jobs whose
    # remote result expired before the worker that resumed them polled)
    not_found_grace_s: float = 4.0
    latency: str = "10-22"
    submit_latency: str = "0.02-0.4"
    result_ttl: float = 10.0
    capped_jobs: int = 64
    daily_job_cap: int = 40
    max_attempts: int = 25
    # with --webhooks (bench/chaos/hooks.py): per-delivery fault rates at the simulator, and the grace a job
    # whose submission's outcome is unknown waits for its webhook
    hook_drop_rate: float = 0.02
    hook_duplicate_rate: float = 0.02
    hook_reorder_rate: float = 0.02
    hook_delay_rate: float = 0.05
    hook_delay_s: float = 2.0
    hook_grace_s: float = 5.0
    # the job store's memory: at maxmemory for `oom_s`, evicting policy for `eviction_s`
    oom_every: float = 90.0
    oom_s: float = 8.0
    eviction_every: float = 120.0
    eviction_s: float = 12.0
    ssrf_share: float = 0.02  # of the produced jobs: inputs naming an internal service (bench/chaos/egress.py)

    def sim_config(self, seed: int, honour: bool) -> dict[str, Any]:
        return {
            "seed": seed,
            "honour_idempotency_key": honour,
            "default": {
                "latency": self.latency,
                "queue_delay": "0-1",
                "submit_latency": self.submit_latency,
                "fail_rate": self.fail_rate,
                "error_rate": self.error_rate,
                "rate_429": self.rate_429,
                "retry_after_seconds": 1,
                "lost_response_rate": self.lost_response_rate,
                "gateway_error_rate": self.gateway_error_rate,
                "status_lag": self.status_lag,
                "result_ttl": self.result_ttl,
                "files_per_job": 1,
                "file_type": "png",
            },
        }


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until every one has ended. One whose code swallowed the cancel (Python 3.11's
    `asyncio.wait_for` does when its call ends just as the cancel comes) is cancelled again each second: a run
    once waited here for good on a fault loop gone back to sleep. The swallower was redis-py's command write
    (offload/connection.py's `restore_lost_cancels` now delivers such a cancel); the re-cancel stays for any other
    library's."""
    for task in tasks:
        task.cancel()
    while pending := [t for t in tasks if not t.done()]:
        await asyncio.wait(pending, timeout=1.0)
        for task in pending:
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Schedule:
    """Runs the fault loops until `stop()`; everything it did is in `timeline` and `counts`."""

    profile: Profile
    rng: random.Random
    slots: list[WorkerSlot]
    valkey: Valkey
    proxy: FaultProxy
    sim: Sim
    burst: Callable[[int], Awaitable[None]] | None = None  # enqueues that many jobs at once (the run's producer)
    failover: Failover | None = None
    timeline: list[dict[str, Any]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    valkey_down: list[tuple[float, float]] = field(default_factory=list)
    # cancels one job as an operator would and says what it did ({"job", "answer", ...}), or None (nothing to cancel)
    operator: Callable[[], Awaitable[dict[str, Any] | None]] | None = None
    full: list[tuple[float, float]] = field(default_factory=list)  # Valkey at its maxmemory
    evicting: list[tuple[float, float]] = field(default_factory=list)  # maxmemory-policy not noeviction
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: bool = False
    # one at a time: an evicting policy with a maxmemory reached would really evict (and lose acknowledged jobs),
    # and a Valkey restart or a failover drops the CONFIG SET of a spell in force
    _store_fault: asyncio.Lock = field(default_factory=asyncio.Lock)
    _switching: asyncio.Task[None] | None = None
    _pending: set[asyncio.Task[None]] = field(default_factory=set)
    _drains: set[asyncio.Task[None]] = field(default_factory=set)
    _drained: int = 0  # drains begun: the first of a run is never cut, so a short run has a graceful one
    _clocked: set[str] = field(default_factory=set)  # slots a clock fault is restarting, or running skewed

    def note(self, kind: str, target: str = "", **detail: Any) -> None:
        self.timeline.append({"t": time.time(), "kind": kind, "target": target, **detail})
        self.counts[kind] += 1

    def _later(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _wait(self, mean: float) -> float:
        return mean * self.rng.uniform(0.5, 1.5)

    def start(self) -> None:
        p = self.profile
        loops = [
            (p.kill_every, self._kill),
            (p.stop_every, self._stop),
            (p.valkey_every, self._valkey),
            (p.worker_clock_every, self._worker_clock),
            (p.valkey_clock_every, self._valkey_clock),
            (p.drop_every, self._drop),
            (p.reset_every, self._reset),
            (p.blackhole_every, self._blackhole),
            (p.storm_every, self._storm),
            (p.cancel_every if self.operator else 0.0, self._cancel),
            (p.oom_every, self._oom),
            (p.eviction_every, self._eviction),
            (p.drain_every, self._drain),
            (p.failover_every if self.failover else 0.0, self._failover),
        ]
        self.proxy.delay_s = p.delay_ms / 1000
        for mean, action in loops:
            if mean > 0:
                self._tasks.append(asyncio.create_task(self._every(mean, action)))
        self._tasks.append(asyncio.create_task(self._watchdog()))

    async def stop(self) -> None:
        """End fault injection: every loop stops, stopped workers continue, the network heals."""
        self._stopping = True
        await cancel_all(self._tasks[:-1])  # keep the watchdog: it restarts workers that die on their own
        # before the drains are awaited: a stop fault cancelled in its sleep leaves its worker stopped, and a
        # stopped worker's drain never ends (its 90 s ran out in a SIGKILL, a "bad drain exit" of our own doing)
        for slot in self.slots:
            slot.sigcont()
        # a drain under way runs to its end first: a later SIGTERM (the run's own stops) would cut it unrecorded
        await asyncio.gather(*self._drains, return_exceptions=True)
        if self._switching is not None:  # a failover under way is finished, never left half done
            await self._switching
        if self.failover is not None:
            self.failover.heal()
        self.proxy.delay_s = 0.0
        self.proxy.drop_rate = 0.0
        self.proxy._drop_next = 0
        await self._store_settings_back()  # a fault cancelled midway leaves neither a limit nor an evicting policy
        if self.proxy.blackholed:
            await asyncio.sleep(self.profile.blackhole_s)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _every(self, mean: float, action: Any) -> None:
        while not self._stopping:  # (checked too: an action may have swallowed the stop's cancel, see cancel_all)
            await asyncio.sleep(self._wait(mean))
            try:
                await action()
            except Exception as exc:  # a fault that could not be injected must not end the run
                log.warning("fault %s failed: %s", getattr(action, "__name__", action), exc)

    # -- process faults ----------------------------------------------------------------------------

    def _alive(self, *, unstopped: bool = False) -> list[WorkerSlot]:
        return [s for s in self.slots if s.running and not (unstopped and s.stopped)]

    async def _kill(self) -> None:
        slots = self._alive()
        if not slots:
            return
        slot = self.rng.choice(slots)
        life = slot.current
        await asyncio.to_thread(slot.kill)
        self.note(
            "kill",
            slot.name,
            pid=life.pid if life else None,
            n=life.n if life else None,
            was_stopped=bool(life and life.stops and life.stops[-1][1] == life.ended),
        )
        self._later(self._restart(slot, self.rng.uniform(*self.profile.restart_delay)))

    async def _restart(self, slot: WorkerSlot, after: float) -> None:
        await asyncio.sleep(after)
        if not slot.running:
            life = slot.start()
            self.note("restart", slot.name, n=life.n, pidns=slot.pidns)

    async def _stop(self) -> None:
        slots = self._alive(unstopped=True)
        if not slots:
            return
        slot = self.rng.choice(slots)
        seconds = self.profile.lease_ms / 1000 * self.rng.uniform(*self.profile.stop_lease_factor)
        slot.sigstop()
        self.note("stop", slot.name, seconds=round(seconds, 2), n=slot.current.n if slot.current else None)
        await asyncio.sleep(seconds)
        if slot.stopped:
            slot.sigcont()
            self.note("cont", slot.name)

    async def _drain(self) -> None:
        """A graceful restart while jobs wait at the gate and the rate limit: a burst of jobs, then SIGTERM to the
        serving worker holding the most leases (sometimes a second SIGTERM soon after: a cut), its exit and a
        restart, in the background (the fault phase's end waits for it)."""
        if self.burst is not None:
            await self.burst(self.profile.drain_burst)
        slots = [s for s in self._alive(unstopped=True) if s.current and s.current.read_id() and not s.terminating]
        if not slots:
            return
        leases = await asyncio.to_thread(self._leases, slots)  # seconds, while the store is down
        slots = [s for s in slots if s.running and not s.terminating]  # another fault may have begun a stop meanwhile
        if not slots:
            return
        slot = max(slots, key=lambda s: (leases.get(s.name, 0), self.rng.random()))
        if (life := slot.current) is None:  # the kill fault's thread ended it meanwhile
            return
        slot.terminating = True  # claimed now, not when the drain's thread starts: no other fault stops it too
        p = self.profile
        cut = self.rng.uniform(*p.drain_cut_after) if self.rng.random() < p.drain_cut_share else None
        cut, self._drained = (cut if self._drained else None), self._drained + 1
        task = asyncio.create_task(self._drain_then_restart(slot, life, cut))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    def _leases(self, slots: list[WorkerSlot]) -> dict[str, int]:
        """Leases each slot's worker holds (read straight from Valkey; none if it cannot be read)."""
        counts: dict[str, int] = {}
        with contextlib.suppress(Exception), self.valkey.client() as client:
            for slot in slots:
                if slot.current and (worker := slot.current.read_id()):
                    counts[slot.name] = int(client.zcard(f"offload:{{{slot.queue}}}:owned:{worker}"))
        return counts

    async def _drain_then_restart(self, slot: WorkerSlot, life: Incarnation, cut_after: float | None) -> None:
        """Drains the incarnation chosen: if the kill fault ended it before the drain's thread ran, nothing is
        signalled and the drain is noted as killed (its jobs cost what a kill's do)."""
        began = time.time()
        code, found = await asyncio.to_thread(slot.drain, life, cut_after)
        self.note(
            "drain",
            slot.name,
            n=life.n,
            cut=cut_after is not None,
            killed=life.end == "kill",  # the kill fault came first: not this drain's doing
            code=code,
            took_s=round(time.time() - began, 2),
            handed_back=found[0] if found else None,
            calls_out=found[1] if found else None,
        )
        await self._restart(slot, self.rng.uniform(*self.profile.restart_delay))

    async def _watchdog(self) -> None:
        """A worker that exits on its own (e.g. a Redis blip it did not ride out) is a finding: record it with
        the tail of its log, and restart it like systemd's Restart=always would."""
        while True:
            await asyncio.sleep(0.2)
            for slot in self.slots:
                code = slot.exited()
                if code is None:
                    continue
                life = slot.lives[-1]
                tail = ""
                with contextlib.suppress(OSError):
                    tail = " | ".join(life.log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
                self.note("worker_exit", slot.name, code=code, n=life.n, tail=tail)
                self._later(self._restart(slot, 1.0))

    async def _oom(self) -> None:
        """Valkey at its maxmemory: the limit lowered under what it holds, so it refuses every write that adds data
        (claims, begins, enqueues) while the scripts that end or keep a job run; then lifted, as an operator would."""
        if self._store_fault.locked():
            return
        async with self._store_fault:
            began = time.time()
            limit = await asyncio.to_thread(self.valkey.squeeze)
            self.note("oom", "valkey", seconds=self.profile.oom_s, maxmemory=limit)
            try:
                await asyncio.sleep(self.profile.oom_s)
            finally:
                await asyncio.to_thread(self.valkey.config_set, "maxmemory", 0)
                self.full.append((began, time.time()))

    async def _eviction(self) -> None:
        """An evicting maxmemory-policy (a managed Redis's default, or a config change): the workers must notice
        within OFFLOAD_STORE_CHECK_S and claim or submit nothing until it is noeviction again."""
        if self._store_fault.locked():
            return
        async with self._store_fault:
            began = time.time()
            await asyncio.to_thread(self.valkey.config_set, "maxmemory-policy", "allkeys-lru")
            self.note("eviction", "valkey", seconds=self.profile.eviction_s)
            try:
                await asyncio.sleep(self.profile.eviction_s)
            finally:
                await asyncio.to_thread(self.valkey.config_set, "maxmemory-policy", "noeviction")
                self.evicting.append((began, time.time()))

    async def _store_settings_back(self) -> None:
        for name, value in (("maxmemory", 0), ("maxmemory-policy", "noeviction")):
            try:
                await asyncio.to_thread(self.valkey.config_set, name, value)
            except Exception as exc:  # (Valkey restarting: it comes back with both as they were)
                log.warning("restoring %s failed: %s", name, exc)

    async def _worker_clock(self) -> None:
        """A worker slot restarted (SIGTERM, as a reboot would) with its wall clock hours or a day off: the capped
        queue's slot first, where a cap window of its own would pay past the cap. `worker_clock_s` later it is
        restarted on the true clock (NTP caught up, or the host was replaced), unless it ended meanwhile."""
        alive = [s for s in self._alive(unstopped=True) if s.name not in self._clocked and not s.terminating]
        if not alive:
            return
        capped = self.slots[-1]
        slot = capped if not self.counts["worker_clock"] and capped in alive else self.rng.choice(alive)
        skew = self.rng.choice(WORKER_SKEWS_S)
        self._clocked.add(slot.name)  # one restart of a slot at a time: never two processes in one slot
        slot.terminating = True  # claimed before the thread starts: a drain does not pick it meanwhile
        await asyncio.to_thread(slot.terminate)
        if slot.running:  # the kill fault ended it meanwhile and its restart came first: one process a slot
            self._clocked.discard(slot.name)
            self.note("worker_clock_skipped", slot.name, n=slot.current.n if slot.current else None)
            return
        life = slot.start(ClockFile(slot.dir / f"{slot.name}-clock-{len(slot.lives) + 1}", skew))
        self.note("worker_clock", slot.name, n=life.n, skew_s=skew)
        self._later(self._true_clock(slot, life))

    async def _true_clock(self, slot: WorkerSlot, life: Any) -> None:
        try:
            await asyncio.sleep(self.profile.worker_clock_s)
            # a slot being drained restarts on the true clock anyway: a second stop would cut that drain and
            # SIGKILL it 15 s later, a "bad drain exit" that was the harness's own doing
            if slot.current is life and not self._stopping and not slot.terminating:
                slot.terminating = True
                await asyncio.to_thread(slot.terminate)
                if not slot.running:  # (a kill's restart may have come first: one process a slot)
                    again = slot.start()
                    self.note("restart", slot.name, n=again.n, pidns=slot.pidns)
        finally:
            self._clocked.discard(slot.name)

    async def _valkey_clock(self) -> None:
        """Valkey's clock steps back (an NTP correction of a clock that ran ahead, a failover to a host whose
        clock is behind) and, the next time, forward to the true time again. It never runs ahead of the true time
        nor back past its last midnight, so the capped queue's day stays the one the run began in (the roll at
        the end is the harness's own step)."""
        clock = self.valkey.clock
        assert clock is not None  # the run's Valkey always has one
        if clock.offset_s < 0:
            step = -clock.offset_s
        else:
            store_now = time.time() + clock.offset_s
            since_midnight = store_now - window_start_s(store_now)
            step = -min(self.rng.uniform(*self.profile.valkey_clock_step_s), since_midnight - 120)
            if step >= 0:
                return
        clock.step(step)
        self.note("valkey_clock", "valkey", step_s=round(step, 1), offset_s=round(clock.offset_s, 1))

    async def _valkey(self) -> None:
        # A restart undoes a spell's CONFIG SET (the checker would judge a spell that was not there any more), so it
        # waits for the spell to end. It waits rather than skips: the spells hold the lock most of a quick run, and
        # a run whose crashes were all skipped would prove nothing about them.
        async with self._store_fault:
            if self._stopping:
                return
            began = time.time()
            down = await asyncio.to_thread(self.valkey.restart)
            self.valkey_down.append((began, began + down))
            self.note("valkey_restart", "valkey", down_s=round(down, 2), appendfsync=self.valkey.appendfsync)

    # -- network and provider faults ------------------------------------------------------------------

    async def _drop(self) -> None:
        self.proxy.drop_next(1)
        self.counts["drop_scheduled"] += 1

    async def _reset(self) -> None:
        n = self.proxy.reset_all()
        self.note("reset", "proxy", connections=n)

    async def _blackhole(self) -> None:
        self.proxy.blackhole(self.profile.blackhole_s)
        self.note("blackhole", "proxy", seconds=self.profile.blackhole_s)

    async def _cancel(self) -> None:
        assert self.operator is not None
        done = await self.operator()
        if done is not None:
            self.note("cancel", done.pop("job"), **done)

    async def _failover(self) -> None:
        """Cut the replica off, let the primary take writes it will lose, then fail over to the replica."""
        assert self.failover is not None
        if self._store_fault.locked():  # the promoted replica has none of a spell's CONFIG SET (see _valkey)
            return
        async with self._store_fault:
            self.failover.cut()
            self.note("replica_cut", "valkey", seconds=self.profile.failover_cut_s)
            try:
                await asyncio.sleep(self.profile.failover_cut_s)
            except asyncio.CancelledError:
                self.failover.heal()  # the run is ending: no failover this time
                raise
            self._switching = asyncio.create_task(self._switch())
            await asyncio.shield(self._switching)

    async def _switch(self) -> None:
        assert self.failover is not None
        done = await self.failover.fail_over()
        self.valkey = self.failover.primary  # the Valkey restarts (`_valkey`) hit the primary of the moment
        self.note("failover", "valkey", seconds=round(done["switched_at"] - done["cut_at"], 2), **done)

    async def _storm(self) -> None:
        await asyncio.to_thread(self.sim.post, "/_sim/outage", {"mode": "429", "seconds": self.profile.storm_s})
        self.note("storm_429", "sim", seconds=self.profile.storm_s)
