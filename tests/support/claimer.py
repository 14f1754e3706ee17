"""A minimal worker process for crash tests: claim a batch, "work" on each job, complete it, record the ack.

    python tests/support/claimer.py URL QUEUE WORKER_ID BATCH [LEASE_MS] --out DIR [--work-ms MS]

LEASE_MS omitted or 0 means the store's default lease. Two files per worker in DIR:

- `<worker>.done`: one job id per line, appended (flushed and fsynced) only AFTER `complete_many` said OK for
  that job. This is the claimer's acknowledgement log that the crash test counts.
- `<worker>.log`: a journal the test reads to choose kill moments (flushed, not fsynced: it only has to
  survive SIGKILL of this process, and the page cache does that):
    `C id id ...`  a claim returned these jobs      `H`     a heartbeat was accepted
    `P id`         about to complete this job        `R`     an in-doubt claim was released
    `A id`         STALE, but the store holds this attempt's result: a retried completion already applied
    `S id`         STALE and not ours: the lease was lost (e.g. reaped during an outage); no ack
  Between `P id` and `id` appearing in `.done` the claimer is inside its ack window: a SIGKILL there can lose
  an ack the store already applied, which is inherent to any worker (the store cannot tell a dead worker it
  succeeded), so the crash test never kills there.

A Redis outage is survived: every call is retried with a small backoff. In-doubt writes are resolved
instead of guessed: a claim whose reply was lost is undone with `release_leases` (the claimer holds nothing
else at that point), and a completion whose reply was lost is retried; STALE then means "already applied"
exactly when the stored result is this attempt's unique result string.

Exits 0 once claims have come back empty for 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable
from typing import IO, Any, TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from offload.connection import connect
from offload.models import ClaimedJob, JobState
from offload.queue.store import QueueStore

EMPTY_EXIT_S = 2.0
IDLE_POLL_S = 0.05
BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.5)
TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)
# A LOADING server (AOF replay after restart) answers with BusyLoadingError, a ConnectionError subclass.

T = TypeVar("T")


class Claimer:
    def __init__(self, store: QueueStore, queue: str, worker_id: str, batch: int, work_s: float, out: str):
        self.store = store
        self.queue = queue
        self.wid = worker_id
        self.batch = batch
        self.work_s = work_s
        self.held: set[str] = set()
        self.done: IO[str] = open(os.path.join(out, f"{worker_id}.done"), "a")  # noqa: SIM115
        self.log: IO[str] = open(os.path.join(out, f"{worker_id}.log"), "a")  # noqa: SIM115
        self.retries = 0

    def journal(self, line: str) -> None:
        self.log.write(line + "\n")
        self.log.flush()

    def ack(self, job_id: str) -> None:
        self.done.write(job_id + "\n")
        self.done.flush()
        os.fsync(self.done.fileno())

    async def retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` until it returns; only for calls that are safe to repeat."""
        for attempt in range(1_000_000):
            try:
                return await call()
            except TRANSIENT:
                self.retries += 1
                await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
        raise AssertionError("unreachable")

    async def heartbeats(self) -> None:
        """One heartbeat per lease/3 carrying every id still held; drop the ones reported lost."""
        interval = self.store.lease_ms / 3000
        while True:
            try:
                reply = await self.store.heartbeat(self.queue, self.wid, sorted(self.held))
                self.held.difference_update(reply.lost)
                self.journal("H")
            except TRANSIENT:
                self.retries += 1
            await asyncio.sleep(interval)

    async def claim(self) -> list[ClaimedJob]:
        try:
            return await self.store.claim(self.queue, self.wid, self.batch)
        except TRANSIENT:
            # The claim may have been applied with the reply lost; we hold nothing else now, so give back
            # everything this worker id owns rather than strand those jobs under a live worker.
            self.retries += 1
            await asyncio.sleep(BACKOFF_S[0])
            await self.retrying(lambda: self.store.release_leases(self.queue, self.wid))
            self.journal("R")
            return []

    async def complete(self, job: ClaimedJob) -> bool:
        """True when this attempt's completion was applied (now or by a retry whose reply was lost)."""
        result = f"mem://{job.token}"  # the token embeds the worker id and is unique per lease
        code = await self.retrying(lambda: self.store.complete_many(self.queue, [(job.id, job.token, result, None)]))
        if code == ["OK"]:
            return True
        stored = await self.retrying(lambda: self.store.get(job.id))
        mine = stored.state is JobState.SUCCEEDED and stored.result == result
        self.journal(("A " if mine else "S ") + job.id)
        return mine

    async def run(self) -> int:
        beat = asyncio.create_task(self.heartbeats())
        loop = asyncio.get_running_loop()
        empty_since: float | None = None
        try:
            while True:
                jobs = await self.claim()
                if not jobs:
                    now = loop.time()
                    if empty_since is None:
                        self.journal("E")  # the first empty claim of a streak: it exits EMPTY_EXIT_S later
                    empty_since = empty_since or now
                    if now - empty_since >= EMPTY_EXIT_S:
                        return 0
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                empty_since = None
                self.held.update(job.id for job in jobs)
                self.journal("C " + " ".join(job.id for job in jobs))
                for job in jobs:
                    await asyncio.sleep(self.work_s)  # the "work"; heartbeats keep running meanwhile
                    if job.id not in self.held:
                        continue  # lease lost (reported by a heartbeat): someone else owns it now
                    self.journal("P " + job.id)
                    if await self.complete(job):
                        self.ack(job.id)
                    self.held.discard(job.id)
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            print(f"{self.wid}: exiting, {self.retries} transient errors retried", file=sys.stderr)


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("queue")
    p.add_argument("worker_id")
    p.add_argument("batch", type=int)
    p.add_argument("lease_ms", type=int, nargs="?", default=0, help="0 or omitted: the store default")
    p.add_argument("--out", required=True, help="directory for <worker>.done and <worker>.log")
    p.add_argument("--work-ms", type=float, default=2.0, help="simulated work per job")
    a = p.parse_args(argv)
    # socket_timeout: a half-dead connection must surface as an error, never hang the claimer.
    sep = "&" if "?" in a.url else "?"
    client: Any = await connect(f"{a.url}{sep}socket_timeout=5&socket_connect_timeout=2", retry_for=60)
    # No silent client-side retries: the claimer must know which calls are in doubt to resolve them.
    client.set_retry(Retry(NoBackoff(), 0))
    store = QueueStore(client, **({"lease_ms": a.lease_ms} if a.lease_ms else {}))
    try:
        return await Claimer(store, a.queue, a.worker_id, a.batch, a.work_ms / 1000, a.out).run()
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
