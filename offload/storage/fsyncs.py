"""Group fsync for the local directory store: one thread syncs what every write in flight is waiting for.

A small local write (local.py) leaves the event loop only to wait for the disk: its file's fsync, then its
directory's. Through the default thread pool each of those was a work item of its own (a future, a queue, a
thread woken, a loop wakeup per item), and every fsync committed the file system's journal again while the
next ones queued behind it. Here the loop appends the request to a list and one thread takes the whole list
at a time: it fsyncs each file (and closes it), then each distinct directory once, after all of them (a
directory asked for twice in one batch is synced once, after every rename that asked), then wakes each loop
that waits with one call for the batch. Every file and directory is still fsynced itself, as POSIX asks; on a
journaling file system the first fsync of a batch commits the journal for all the rest, which then find
nothing left to write.

A file handed over is always closed by the thread, whatever became of the task that handed it over (a
cancelled write must not leak its descriptor). The thread is a daemon, started on first use (again after a
fork, which keeps no threads), and waits for work when there is none.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Batch:
    files: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)
    dirs: list[tuple[list[str], asyncio.Future[None]]] = field(default_factory=list)


class GroupSync:
    """`await sync.file(fd)` and `await sync.dirs([...])`, batched on `lanes` threads (requests are dealt to them
    in turn). `fsync_file(fd)` must close `fd`; `fsync_dir(path)` must not raise for a directory the platform
    cannot sync (see local.py)."""

    def __init__(self, fsync_file: Callable[[int], None], fsync_dir: Callable[[str], None], lanes: int = 4) -> None:
        self._lanes = [_Lane(fsync_file, fsync_dir) for _ in range(lanes)]
        self._next = 0

    async def file(self, fd: int) -> None:
        """fsync and close `fd` (closed even if the caller is cancelled meanwhile); raises the fsync's OSError."""
        await self._lane().file(fd)

    async def dirs(self, directories: list[str]) -> None:
        """fsync each directory (innermost first, as given), after every request queued before this one."""
        await self._lane().dirs(directories)

    def _lane(self) -> _Lane:
        self._next = (self._next + 1) % len(self._lanes)
        return self._lanes[self._next]


class _Lane:
    """One fsync thread and the batch it takes next."""

    def __init__(self, fsync_file: Callable[[int], None], fsync_dir: Callable[[str], None]) -> None:
        self._fsync_file, self._fsync_dir = fsync_file, fsync_dir
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._batch = _Batch()
        self._thread: threading.Thread | None = None
        self._pid = 0

    async def file(self, fd: int) -> None:
        """fsync and close `fd` (closed even if the caller is cancelled meanwhile); raises the fsync's OSError."""
        future = asyncio.get_running_loop().create_future()
        self._put(lambda batch: batch.files.append((fd, future)))
        await future

    async def dirs(self, directories: list[str]) -> None:
        """fsync each directory (innermost first, as given), after every request queued before this one."""
        future = asyncio.get_running_loop().create_future()
        self._put(lambda batch: batch.dirs.append((directories, future)))
        await future

    def _put(self, add: Callable[[_Batch], None]) -> None:
        with self._lock:
            add(self._batch)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="offload-fsync", daemon=True)
                self._thread.start()
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._batch.files and not self._batch.dirs:
                    self._ready.wait()
                batch, self._batch = self._batch, _Batch()
            done: list[tuple[asyncio.Future[None], BaseException | None]] = []
            for fd, future in batch.files:
                try:
                    self._fsync_file(fd)
                    done.append((future, None))
                except BaseException as exc:  # handed to the writer, who maps it
                    done.append((future, exc))
            synced: set[str] = set()
            for directories, future in batch.dirs:
                for directory in directories:
                    if directory not in synced:  # every rename that asked for it happened before this batch
                        synced.add(directory)
                        self._fsync_dir(directory)
                done.append((future, None))
            _wake(done)


def _wake(done: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    """One call per waiting loop for the whole batch (a loop that has closed meanwhile is skipped)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], BaseException | None]]] = {}
    for future, exc in done:
        by_loop.setdefault(future.get_loop(), []).append((future, exc))
    for loop, results in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, results)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            continue


def _settle(results: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for future, exc in results:
        if future.done():  # its writer was cancelled
            continue
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
