"""The fault schedule's own discipline: two faults never stop the same worker at once. A drain picked while its
lease count is read from a store that is down (seconds) must not pick a worker another fault began restarting
meanwhile: that second SIGTERM cuts the restart's drain and its 15 s grace ends in a SIGKILL that the checker then
reports as a drain's bad exit (`drain: w1#4 exited -9 after 8.22 s`, a CI-sized run on a loaded machine). And the
fault phase's end continues a worker a stop fault left stopped before it waits for the drains: a stopped worker's
drain never ends (`drain: w2#5 exited -9 after 90.0 s`, a CI run whose last SIGSTOP hit a draining worker). And the
watchdog never records a kill of the harness's own as a worker's exit, and a drain whose worker the kill fault
ended first is the kill's. And one process a slot: a clock restart whose worker the kill fault ended and restarted
while its SIGTERM waited starts no second one, and that kill's end is not rewritten as the SIGTERM's."""

from __future__ import annotations

import asyncio
import random
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from support.eventually import eventually, eventually_sync

from bench.chaos.checker import drains as drains_verdict
from bench.chaos.faketime import ClockFile
from bench.chaos.faults import Profile, Schedule
from bench.chaos.procs import Incarnation, WorkerSlot
from bench.chaos.rundata import Evidence
from bench.chaos.settle import Settle
from offload.connection import connect
from offload.eventloop import within
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


class Life:
    n, pid = 1, 0
    end: str | None = None
    stops: tuple[list[float], ...] = ()

    def read_id(self) -> str:
        return "host:1"


class Slot:
    """A worker slot's faces the schedule uses, recording each stop it is sent; no process behind it."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name, self.dir, self.queue, self.pidns = name, directory, "q", False
        self.running, self.stopped, self.terminating = True, False, False
        self.current: Life | None = Life()
        self.lives = [self.current]
        self.stops: list[str] = []
        self.exited = threading.Event()  # a stopped worker takes its time to exit: until the test says so
        self.was_stopped, self.continued = threading.Event(), threading.Event()

    def terminate(self) -> None:
        self.terminating = True
        self.stops.append("terminate")
        assert self.exited.wait(10)

    def drain(self, life: Life, cut_after: float | None = None, wait: float = 90.0) -> tuple[int | None, list[int]]:
        """Ends (exit 0) once the worker runs: at once if never stopped, after its SIGCONT if a stop fault came
        (within 10 s: the real drain SIGKILLs a worker still there after its wait); nothing if `life` has ended."""
        if self.current is not life:
            return None, []
        self.terminating = True
        self.stops.append("drain")
        if self.was_stopped.is_set() and not self.continued.wait(10):
            return -9, []
        return 0, []

    def sigstop(self) -> None:
        self.stopped = True
        self.was_stopped.set()

    def sigcont(self) -> None:
        if self.stopped:
            self.stopped = False
            self.continued.set()

    def kill(self) -> None:
        """The kill fault's SIGKILL: the incarnation ends at once, whatever else is stopping it."""
        assert self.current is not None
        self.current.end, self.current, self.running = "kill", None, False

    def start(self, clock: Any = None) -> Life:
        self.terminating, self.running = False, True
        self.current = Life()
        self.lives.append(self.current)
        return self.current


class SlowStore:
    """The run's Valkey while it restarts: a lease count read blocks until `up` is set."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.asked = threading.Event()

    def client(self) -> Any:
        self.asked.set()
        assert self.up.wait(10)
        raise ConnectionError("the store was down")  # _leases counts nothing then

    def config_set(self, name: str, value: object) -> None:
        """The phase's end puts the store's settings back: nothing to put back here."""


class Proxy:
    delay_s = drop_rate = 0.0
    _drop_next = 0
    blackholed = False


def schedule_of(profile: Profile, slot: Slot, store: SlowStore) -> Any:
    """A schedule over stand-ins: the faults these tests call touch no simulator."""
    stand_ins: list[Any] = [[slot], store, Proxy(), None]
    return Schedule(profile, random.Random(1), *stand_ins)


async def test_a_drain_does_not_pick_a_worker_a_clock_fault_is_restarting(tmp_path: Path) -> None:
    slot = Slot("w1", tmp_path)
    store = SlowStore()
    schedule = schedule_of(Profile(), slot, store)
    drain = asyncio.create_task(schedule._drain())
    assert await asyncio.to_thread(store.asked.wait, 10)  # the drain chose w1 and reads its leases
    clock = asyncio.create_task(schedule._worker_clock())  # meanwhile the clock fault restarts w1, skewed
    await eventually(lambda: slot.stops == ["terminate"], 10, "the clock fault's SIGTERM")
    store.up.set()
    await drain
    await asyncio.gather(*schedule._drains)
    slot.exited.set()
    await clock
    for task in schedule._pending:
        task.cancel()
    assert slot.stops == ["terminate"], slot.stops  # one stop: the drain let the restarting worker be


async def test_the_true_clock_restart_leaves_a_draining_worker_to_its_drain(tmp_path: Path) -> None:
    slot = Slot("w1", tmp_path)
    schedule = schedule_of(Profile(worker_clock_s=0.0), slot, SlowStore())
    life = slot.current
    slot.terminating = True  # a drain is under way: it restarts w1 on the true clock itself
    await schedule._true_clock(slot, life)
    assert slot.stops == [] and slot.current is life


async def test_the_fault_phase_ends_by_continuing_a_stopped_draining_worker(tmp_path: Path) -> None:
    slot = Slot("w1", tmp_path)
    store = SlowStore()
    store.up.set()  # the drain's lease count finds the store down at once (and counts none)
    schedule = schedule_of(Profile(lease_ms=60_000), slot, store)  # the stop fault sleeps past the phase's end
    blocked, real_drain = threading.Event(), slot.drain

    def drain(life: Life, cut_after: float | None = None, wait: float = 90.0) -> tuple[int | None, list[int]]:
        blocked.set()
        assert slot.was_stopped.wait(10)  # the stop fault comes while this drain runs
        return real_drain(life, cut_after, wait)

    slot.drain = drain  # type: ignore[method-assign]
    await schedule._drain()
    assert await asyncio.to_thread(blocked.wait, 10)
    # the stop fault picks the draining worker (a drain is no shield from SIGSTOP), then sleeps
    schedule._tasks = [asyncio.create_task(schedule._stop()), asyncio.create_task(asyncio.sleep(3600))]
    await eventually(lambda: slot.stopped, 10, "the stop fault's SIGSTOP")
    await within(schedule.stop(), 30)
    schedule._tasks[-1].cancel()
    drains = [e for e in schedule.timeline if e["kind"] == "drain"]
    assert [e["code"] for e in drains] == [0], drains  # continued, then drained: not SIGKILLed after its wait


async def test_a_kill_between_a_drains_pick_and_its_signal_is_the_kills_not_a_bad_exit(tmp_path: Path) -> None:
    """Found by a CI-sized run on a loaded machine (`drain: w2#None exited None after 0.03 s`): the kill fault
    SIGKILLed the worker a drain had just picked, before the drain's thread ran. The drain signals nothing then and
    is noted as killed, whose jobs cost what a kill's do; and it never drains the worker restarted meanwhile."""
    slot = Slot("w1", tmp_path)
    store = SlowStore()
    store.up.set()
    schedule = schedule_of(Profile(), slot, store)
    picked = slot.current
    assert picked is not None
    await schedule._drain()  # picked, its thread not yet run
    picked.end = "kill"  # the kill fault, then its restart
    slot.start()
    await asyncio.gather(*schedule._drains)
    drains = [e for e in schedule.timeline if e["kind"] == "drain"]
    assert [(e["n"], e["code"], e["killed"]) for e in drains] == [(1, None, True)], drains
    assert slot.stops == [], slot.stops  # the restarted worker was not drained
    findings: list[str] = []
    evidence = SimpleNamespace(d=SimpleNamespace(timeline=schedule.timeline), find=findings.append)
    assert drains_verdict(cast(Evidence, evidence))["drains"]["bad_exits"] == 0 and findings == [], findings


async def test_a_clock_restart_whose_worker_the_kill_fault_restarted_first_starts_no_second_one(
    tmp_path: Path,
) -> None:
    """The clock fault's SIGTERM is under way (in a thread) when the kill fault SIGKILLs the same worker and its
    restart comes first: the clock fault must not start another process in the slot (the first would run on,
    untracked, to the run's end)."""
    slot = Slot("w1", tmp_path)
    schedule = schedule_of(Profile(restart_delay=(0.0, 0.0)), slot, SlowStore())
    clock = asyncio.create_task(schedule._worker_clock())
    await eventually(lambda: slot.stops == ["terminate"], 10, "the clock fault's SIGTERM")
    await schedule._kill()  # the same worker: its SIGTERM does not shield it
    await eventually(lambda: len(slot.lives) == 2 and slot.running, 10, "the kill's restart")
    slot.exited.set()  # the SIGTERM's wait ends
    await clock
    assert len(slot.lives) == 2, [life.end for life in slot.lives]  # one restart: the kill's
    assert [e["kind"] for e in schedule.timeline] == ["kill", "restart", "worker_clock_skipped"], schedule.timeline
    assert "w1" not in schedule._clocked  # a later clock fault may pick the slot again
    for task in schedule._pending:
        task.cancel()


class KilledWhilePolled:
    """A worker process whose first `poll` lets a kill in another thread run first (up to `grace` s), as a thread
    switch between the watchdog's mark check and its poll would: the kill's exit is then all the poll could see."""

    def __init__(self, proc: subprocess.Popen[bytes], kill: Callable[[], None], grace: float = 0.5) -> None:
        self.proc, self.kill, self.grace = proc, kill, grace
        self.pid = proc.pid
        self.killer: threading.Thread | None = None

    def poll(self) -> int | None:
        if self.killer is None:
            self.killer = threading.Thread(target=self.kill)
            self.killer.start()
            self.killer.join(self.grace)  # the kill waits for the watchdog's look to end, when there is a lock
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)


def test_the_watchdog_never_takes_a_kill_of_ours_for_the_workers_own_exit(tmp_path: Path) -> None:
    slot = WorkerSlot("w1", "q", tmp_path / "offload.yaml", {}, tmp_path, concurrency=1, pidns=False)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its own group: the kill's killpg reaches it
    try:
        slot.lives.append(Incarnation(1, proc.pid, tmp_path / "w1-1.log", time.time()))
        stand_in = KilledWhilePolled(proc, slot.kill)
        slot.proc = stand_in  # type: ignore[assignment]
        seen = slot.exited()  # the watchdog's look, with the kill fault's thread switching in mid-look
        assert stand_in.killer is not None
        stand_in.killer.join(10)
        assert seen is None and slot.lives[-1].end == "kill", (seen, slot.lives[-1].end)
        assert slot.exited() is None  # nor on the next look
    finally:
        proc.kill()
        proc.wait(10)


def test_a_kill_during_a_terminate_stays_the_kills(tmp_path: Path) -> None:
    """A restart's SIGTERM is under way when the kill fault SIGKILLs the same worker: its end is the kill's, not
    overwritten as the SIGTERM's once that wait returns."""
    slot = WorkerSlot("w1", "q", tmp_path / "offload.yaml", {}, tmp_path, concurrency=1, pidns=False)
    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60"], start_new_session=True)  # ignores SIGTERM
    try:
        slot.lives.append(Incarnation(1, proc.pid, tmp_path / "w1-1.log", time.time()))
        slot.proc = proc
        stopping = threading.Thread(target=slot.terminate, kwargs={"grace": 30.0})
        stopping.start()
        eventually_sync(lambda: slot.terminating, 10, "the SIGTERM under way")
        slot.kill()
        stopping.join(30)
        assert not stopping.is_alive() and slot.lives[-1].end == "kill", slot.lives[-1].end
    finally:
        proc.kill()
        proc.wait(10)


async def test_the_days_end_reads_only_counted_jobs_as_still_to_send(valkey_url: str) -> None:
    """The first day's end, on a real store (cap 2, four capped jobs): a counted job whose call went out, a counted
    one with its call still to come, one held, and one never claimed (a capped queue's claim skips fresh jobs): the
    day is full, and only the counted one still to come is unsent (counting the never-claimed one would have made
    the checker expect a fifth run)."""
    queue = "capped-" + secrets.token_hex(3)
    redis = await connect(valkey_url)
    try:
        store = QueueStore(redis)
        ids = await store.enqueue_many(queue, [JobSpec(input=i) for i in range(4)])
        leases = {j.id: j.token for j in await store.claim(queue, "c1", 3, job_cap=2)}
        sent, unsent, held = ids[:3]
        begun = await store.begin_many(queue, [(j, leases[j], 0.0) for j in (sent, unsent, held)], job_cap=2)
        assert begun == ["OK:1", "OK:1", "CAP:jobs"]
        await store.checkpoint_many(queue, [(sent, leases[sent], "gpu", "r-1", 1)])
        settle = Settle(redis, cast(WorkerSlot, None), cast(ClockFile, None), ids, queue, 2)
        await settle.day_end(1.0)
        assert sorted(settle.counted) == sorted([sent, unsent]) and settle.unsent == [unsent]
    finally:
        await redis.aclose()
