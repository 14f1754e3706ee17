"""Group commit for the local directory store: a few threads write every small object in flight, a batch at a
time, and make each batch durable together.

A small local write (local.py) hands its key and bytes to a lane and waits. The lane's thread takes the whole
list of writes queued since it last looked and gives it to the store's `commit` (local.py's `_commit`: temp
files, one sync, renames, one sync), then wakes each loop that waits with one call for the batch. A group of
writes (`write_many`: a job's copied files and then its output JSON) goes to one lane as one piece and is
waited for as one: in the same batch, renamed in its order, and a write whose predecessor in the group failed
is not renamed, so the output JSON never appears without its files. Why: a job's writes are then one wait on a
lane, not two in a row, and in a burst of job ends that wait is the largest step of a job's end.

Why the file system work is here and not on the event loop: on ext4 under a burst, creating, renaming and
making directories wait for the journal while a sync commits it, and one fsync per file and per directory costs
several times the kernel CPU of one sync per batch. Why a few lanes and not the default thread pool: a pool work
item per write is a future, a queue, a thread woken and a loop wakeup each, and every system call in a thread
must win the GIL back from the busy loop; a lane pays those once per batch. Why four and not one: where the file
system's inode allocation is slow (an ext4 that has just deleted many files), one lane serialises that kernel
work. The measurements: docs/explanation/performance.md, *Local storage*.

A write whose caller was cancelled before its lane got to it is skipped; one cancelled later is finished by the
lane or undone (its temp file removed) before its rename. The threads are daemons, started on first use (again
after a fork, which keeps no threads), and wait for work when there is none.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Pending:
    """One write handed to a lane: the commit function sets `error` for a write that failed (or leaves it None)
    and may note its temp file, directories and file system on the way. `after`: the write before it in its
    group, which must not have failed for this one to be renamed; the group shares one `future`."""

    target: str
    data: bytes
    future: asyncio.Future[None]
    after: Pending | None = None
    error: BaseException | None = None
    tmp: str = ""
    made: list[str] = field(default_factory=list)
    device: int = 0

    @property
    def abandoned(self) -> bool:
        """The caller stopped waiting (cancelled): not worth writing, or renaming."""
        return self.future.done()

    @property
    def orphaned(self) -> bool:
        """An earlier write of its group failed: this one must not replace its target."""
        return self.after is not None and self.after.error is not None


Commit = Callable[[list[Pending]], None]


class GroupCommit:
    """`await group.write(target, data)`, batched on `lanes` threads (writes are dealt to them in turn), each
    batch written by `commit`, which must never raise: it sets `Pending.error` instead."""

    def __init__(self, commit: Commit, lanes: int = 4) -> None:
        self._lanes = [_Lane(commit) for _ in range(lanes)]
        self._next = 0

    async def write(self, target: str, data: bytes) -> None:
        """Write `data` to `target` durably (whatever `commit` makes of it); raises the write's error."""
        await self.write_many(((target, data),))

    async def write_many(self, writes: Sequence[tuple[str, bytes]]) -> None:
        """Write each (target, data) durably, on one lane, in one batch and in this order; a write whose
        predecessor failed is not made. Raises the first failure."""
        self._next = (self._next + 1) % len(self._lanes)
        await self._lanes[self._next].write_many(writes)


class _Lane:
    """One thread and the batch it takes next."""

    def __init__(self, commit: Commit) -> None:
        self._commit = commit
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._batch: list[Pending] = []
        self._thread: threading.Thread | None = None
        self._pid = 0

    async def write_many(self, writes: Sequence[tuple[str, bytes]]) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        group: list[Pending] = []
        for target, data in writes:
            group.append(Pending(target, data, future, group[-1] if group else None))
        with self._lock:
            self._batch.extend(group)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="offload-fsync", daemon=True)
                self._thread.start()
            self._ready.notify()
        await future

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._batch:
                    self._ready.wait()
                batch, self._batch = self._batch, []
            live = [p for p in batch if not p.abandoned]
            try:
                self._commit(live)
            except BaseException as exc:  # a bug in commit: every caller of the batch hears of it
                for p in live:
                    p.error = p.error or exc
            _wake(live)


def _wake(done: list[Pending]) -> None:
    """One call per waiting loop for the whole batch (a loop that has closed meanwhile is skipped)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Pending]] = {}
    for p in done:
        by_loop.setdefault(p.future.get_loop(), []).append(p)
    for loop, results in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, results)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            continue


def _settle(results: list[Pending]) -> None:
    """Each group's future gets its first failure, or None once every write of the group is done."""
    first: dict[asyncio.Future[None], BaseException | None] = {}
    for p in results:
        if first.get(p.future) is None:
            first[p.future] = p.error
    for future, error in first.items():
        if future.done():  # its writer was cancelled
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
