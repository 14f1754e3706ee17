"""The fault schedule's own discipline: two faults never stop the same worker at once. A drain picked while its
lease count is read from a store that is down (seconds) must not pick a worker another fault began restarting
meanwhile: that second SIGTERM cuts the restart's drain and its 15 s grace ends in a SIGKILL that the checker then
reports as a drain's bad exit (`drain: w1#4 exited -9 after 8.22 s`, a CI-sized run on a loaded machine)."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

from support.eventually import eventually

from bench.chaos.faults import Profile, Schedule


class Life:
    n = 1
    end: str | None = None

    def read_id(self) -> str:
        return "host:1"


class Slot:
    """A worker slot's faces the schedule uses, recording each stop it is sent; no process behind it."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name, self.dir, self.queue = name, directory, "q"
        self.running, self.stopped, self.terminating = True, False, False
        self.current: Life | None = Life()
        self.lives = [self.current]
        self.stops: list[str] = []
        self.exited = threading.Event()  # a stopped worker takes its time to exit: until the test says so

    def terminate(self) -> None:
        self.terminating = True
        self.stops.append("terminate")
        assert self.exited.wait(10)

    def drain(self, cut_after: float | None = None, wait: float = 90.0) -> tuple[int, list[int]]:
        self.terminating = True
        self.stops.append("drain")
        return 0, []

    def start(self, clock: Any = None) -> Life:
        self.terminating = False
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


def schedule_of(profile: Profile, slot: Slot, store: SlowStore) -> Any:
    """A schedule over stand-ins: the faults these tests call touch no proxy and no simulator."""
    stand_ins: list[Any] = [[slot], store, None, None]
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
