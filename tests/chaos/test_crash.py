"""Crash tests with real processes: SIGKILLed claimers, a SIGKILLed and restarted Valkey, lease cost.

The claimers are `tests/support/claimer.py` subprocesses; every process a test starts is tracked by PID and SIGKILLed
in fixture teardown. Figures the engineer quotes are printed (run with `-s` to see them live; they are also
in the captured output of a failing test).
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from support.admin_redis import redis_admin
from support.eventually import seconds_until
from support.procs import die_with_parent
from support.servers import ValkeyServer

from offload.connection import connect
from offload.models import JobState
from offload.queue.specs import JobSpec
from offload.queue.store import DEFAULT_LEASE_MS, QueueStore

CLAIMER = Path(__file__).parents[1] / "support" / "claimer.py"
TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)


class Procs:
    """Subprocesses started by one test, killed (SIGKILL, by PID) at teardown."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.all: dict[str, subprocess.Popen[bytes]] = {}

    def claimer(self, url: str, queue: str, wid: str, batch: int, lease_ms: int | None, work_ms: float) -> None:
        args = [url, queue, wid, str(batch), *([str(lease_ms)] if lease_ms else [])]
        args += ["--out", str(self.out), "--work-ms", str(work_ms)]
        with open(self.out / f"{wid}.stderr", "wb") as err:
            self.all[wid] = subprocess.Popen(
                [sys.executable, str(CLAIMER), *args], stdout=err, stderr=err, preexec_fn=die_with_parent
            )

    def alive(self) -> list[str]:
        return [wid for wid, p in self.all.items() if p.poll() is None]

    def sigkill(self, wid: str) -> None:
        p = self.all[wid]
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()

    def kill_all(self) -> None:
        for wid in list(self.all):
            self.sigkill(wid)

    def stderr(self, wid: str) -> str:
        return (self.out / f"{wid}.stderr").read_text(errors="replace")[-2000:]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    out = tmp_path / "claimers"
    out.mkdir()
    p = Procs(out)
    try:
        yield p
    finally:
        p.kill_all()


async def open_store(url: str, **kwargs: Any) -> QueueStore:
    client = await connect(url)
    redis_admin(client).set_retry(Retry(NoBackoff(), 0))  # the test handles outages itself, without hidden delays
    return QueueStore(client, **kwargs)


@pytest.fixture
async def crash_store(own_valkey: ValkeyServer) -> AsyncIterator[QueueStore]:
    store = await open_store(own_valkey.url)
    yield store
    await store.redis.aclose()


@pytest.fixture
async def vstore(valkey_url: str) -> AsyncIterator[QueueStore]:
    store = await open_store(valkey_url)
    yield store
    await store.redis.aclose()


def journal(out: Path, wid: str) -> list[str]:
    path = out / f"{wid}.log"
    return path.read_text().splitlines() if path.exists() else []


def acks(out: Path, wid: str) -> list[str]:
    path = out / f"{wid}.done"
    return path.read_text().split() if path.exists() else []


def wait_stopped(pid: int) -> None:
    """Until SIGSTOP has taken effect (it is delivered asynchronously); a millisecond or so."""
    while True:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat[stat.rindex(")") + 2]
        if state in "Tt":
            return
        assert state not in "ZX", f"process {pid} exited before it could be killed"
        time.sleep(0.0002)


def safe_to_kill(out: Path, wid: str) -> bool:
    """A stopped claimer is mid-batch (holds claimed, unfinished jobs) and not inside its ack window
    (completion sent or answered, ack not yet written), where a kill would lose an ack the store applied."""
    lines = [ln for ln in journal(out, wid) if ln.startswith(("C ", "P "))]
    claims = [i for i, ln in enumerate(lines) if ln.startswith("C ")]
    if not claims:
        return False
    batch = lines[claims[-1]].split()[1:]
    started = lines[claims[-1] + 1 :]
    if len(started) >= len(batch):
        return False  # batch finished (or finishing): not mid-batch
    if started:
        done = acks(out, wid)
        in_flight = started[-1][2:]
        # Unsafe unless this job's ack is already written. (A STALE completion is never acked, so such a
        # moment is skipped too; the next attempt a few ms later will be in the work phase.)
        return bool(done) and done[-1] == in_flight
    return True


async def kill_mid_batch(procs: Procs, wid: str, rng: random.Random, limit_s: float = 20.0) -> int:
    """SIGSTOP the claimer, and SIGKILL it if the moment is safe, else SIGCONT and retry a few ms later.
    Returns the number of attempts."""
    pid = procs.all[wid].pid
    t0 = time.monotonic()
    for attempt in range(1, 100_000):
        os.kill(pid, signal.SIGSTOP)
        wait_stopped(pid)
        if safe_to_kill(procs.out, wid):
            procs.sigkill(wid)
            return attempt
        os.kill(pid, signal.SIGCONT)
        if time.monotonic() - t0 > limit_s:
            raise AssertionError(f"{wid} never offered a safe mid-batch moment in {limit_s:g}s")
        await asyncio.sleep(rng.uniform(0.001, 0.01))
    raise AssertionError("unreachable")


async def succeeded(store: QueueStore, queue: str) -> int | None:
    try:
        return (await store.stats(queue)).counts["succeeded"]
    except TRANSIENT:
        return None  # server down or reloading


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_every_job_completes_exactly_once_through_kills_and_server_restart(
    own_valkey: ValkeyServer, crash_store: QueueStore, procs: Procs
) -> None:
    store, server, out = crash_store, own_valkey, procs.out
    queue, total, lease_ms, batch, work_ms = "crash", 5_000, 1_000, 20, 1.0
    seed = int(os.environ.get("OFFLOAD_CRASH_SEED", "20240611"))
    rng = random.Random(seed)
    t_start = time.monotonic()
    # max_attempts is generous so a job caught in several kills is not dead-lettered (a documented, separate
    # outcome); this test is about exactly-once completion.
    ids = await store.enqueue_many(queue, [JobSpec({"n": i}, max_attempts=10) for i in range(total)])
    assert len(set(ids)) == total

    next_wid = 0

    def start_claimer() -> str:
        nonlocal next_wid
        next_wid += 1
        wid = f"w{next_wid}"
        procs.claimer(server.url, queue, wid, batch, lease_ms, work_ms)
        return wid

    for _ in range(3):
        start_claimer()

    # Kill moments are drawn on progress (jobs succeeded), so they land mid-run on fast and slow machines.
    events = [(at, "claimer") for at in rng.sample(range(250, 4_250), 6)]
    events.append((rng.randrange(1_500, 3_500), "server"))
    events.sort()
    log: list[str] = []
    for at, kind in events:
        await seconds_until(functools.partial(_reached, store, queue, at), 120, f"{at} jobs succeeded")
        await asyncio.sleep(rng.uniform(0, 0.1))
        if kind == "claimer":
            victim = rng.choice(procs.alive())
            attempts = await kill_mid_batch(procs, victim, rng)
            replacement = start_claimer()
            log.append(f"@{at}: SIGKILL {victim} mid-batch (attempt {attempts}), started {replacement}")
        else:
            server.kill()
            t_down = time.monotonic()
            await asyncio.sleep(rng.uniform(0.3, 1.0))  # the outage itself, not a synchronisation
            server.restart()
            log.append(f"@{at}: SIGKILL valkey, restarted after {time.monotonic() - t_down:.2f}s")
        for wid in procs.all:
            assert procs.all[wid].returncode in (None, -signal.SIGKILL), procs.stderr(wid)

    async def all_done() -> bool:
        n = await succeeded(store, queue)
        if n != total and not procs.alive():
            raise AssertionError(f"all claimers exited at {n} succeeded: {await store.stats(queue)}")
        return n == total

    await seconds_until(all_done, 120, f"{total} jobs succeeded", every=0.1)
    t_done = time.monotonic() - t_start
    # Claimers leave on their own once the queue has been empty for 2 s.
    await seconds_until(lambda: _none_alive(procs), 30, "claimers to exit", why=lambda: _last_words(procs))
    for wid, p in procs.all.items():
        assert p.returncode in (0, -signal.SIGKILL), f"{wid} exited {p.returncode}:\n{procs.stderr(wid)}"

    stats = await store.stats(queue)
    assert stats.counts == {**dict.fromkeys(stats.counts, 0), "succeeded": total}, stats
    assert stats.totals.get("succeeded") == total, stats.totals
    jobs = []
    for i in range(0, total, 50):  # a few at a time: the client's connection pool is bounded
        jobs += await asyncio.gather(*(store.get(job_id) for job_id in ids[i : i + 50]))
    assert [j.state for j in jobs] == [JobState.SUCCEEDED] * total

    ackers: dict[str, list[str]] = {}
    for wid in procs.all:
        for job_id in acks(out, wid):
            ackers.setdefault(job_id, []).append(wid)
    counts = Counter({job_id: len(w) for job_id, w in ackers.items()})
    duplicates = {job_id: ackers[job_id] for job_id, c in counts.items() if c > 1}
    missing = set(ids) - set(counts)
    unknown = set(counts) - set(ids)
    assert not duplicates, f"acked more than once: {duplicates}"
    assert not missing, f"succeeded but never acked: {sorted(missing)[:10]} ({len(missing)})"
    assert not unknown, unknown
    # The store recorded the completing attempt's result, which names its worker: it is the one that acked.
    for job in jobs:
        assert job.result is not None and job.result.startswith("mem://")
        assert job.result[len("mem://") :].rsplit("/", 1)[0] == ackers[job.id][0], job

    expiries = sum(j.lease_expiries for j in jobs)
    per_worker = {wid: len(acks(out, wid)) for wid in procs.all}
    marks = Counter(ln[0] for wid in procs.all for ln in journal(out, wid) if ln[0] in "ASR")
    print(
        f"\n[crash] seed {seed}: {total} jobs, {len(procs.all)} claimer processes, all succeeded after "
        f"{t_done:.1f}s (test {time.monotonic() - t_start:.1f}s); {expiries} lease expiries; "
        f"completions applied but answered STALE after a lost reply: {marks['A']}; "
        f"leases lost: {marks['S']}; "
        f"in-doubt claims released: {marks['R']}; acks per worker {per_worker}"
    )
    print("\n".join("[crash] " + line for line in log))


async def _reached(store: QueueStore, queue: str, n: int) -> bool:
    done = await succeeded(store, queue)
    return done is not None and done >= n


async def _none_alive(procs: Procs) -> bool:
    return not procs.alive()


def _last_words(procs: Procs) -> str:
    """What each claimer still alive did last (its journal: C claim, P done, E an empty claim, H heartbeat, R
    release) and its stderr: a claimer that has not exited names where it stopped."""
    return "\n".join(
        f"{wid}: journal {journal(procs.out, wid)[-6:]}; stderr {procs.stderr(wid)[-400:]!r}" for wid in procs.alive()
    )


async def test_killed_claimer_jobs_back_in_ready_within_15s_by_default(
    valkey_url: str, vstore: QueueStore, procs: Procs
) -> None:
    store, queue, n = vstore, "lease", 200
    await store.enqueue_many(queue, [JobSpec({"n": i}) for i in range(n)])
    # Default lease (no lease_ms argument); the claimer holds the whole batch and keeps heartbeating.
    procs.claimer(valkey_url, queue, "holder", n, None, work_ms=600_000)

    async def claimed() -> bool:
        return any(ln.startswith("C ") and len(ln.split()) == n + 1 for ln in journal(procs.out, "holder"))

    await seconds_until(claimed, 30, "the claimer to claim 200 jobs")
    assert (await store.stats(queue)).counts["active"] == n
    # Kill right after a heartbeat: the worst case, a full fresh lease still to run out.
    beats = journal(procs.out, "holder").count("H")

    async def heartbeat_seen() -> bool:
        return journal(procs.out, "holder").count("H") > beats

    await seconds_until(heartbeat_seen, DEFAULT_LEASE_MS / 1000, "a heartbeat", every=0.005)
    procs.sigkill("holder")
    t_kill = time.monotonic()

    # What every worker and server does anyway: one maintenance call per second.
    next_reap = t_kill

    async def back_in_ready() -> bool:
        nonlocal next_reap
        if time.monotonic() >= next_reap:
            await store.reap(queue)
            next_reap += 1.0
        counts = (await store.stats(queue)).counts
        return counts["queued"] == n and counts["active"] == 0

    await seconds_until(back_in_ready, 30, "the jobs to return to ready", every=0.02)
    elapsed = time.monotonic() - t_kill
    print(
        f"\n[lease] default lease {DEFAULT_LEASE_MS} ms, heartbeat every {DEFAULT_LEASE_MS / 3000:.2f}s, "
        f"reap every 1s: {n} jobs of a SIGKILLed claimer back in ready {elapsed:.2f}s after the kill"
    )
    assert elapsed < 15


@pytest.mark.parametrize("ids_mode", ["none", "all"])
async def test_keeping_10000_leases_alive_costs_a_few_calls_per_second(own_valkey: ValkeyServer, ids_mode: str) -> None:
    """Counted with the server's own commandstats, so on a Valkey of the test's own: on the shared one, a
    module-scoped server of another test module (pytest-xdist interleaves modules) once added its autoscaler's
    ZRANGEBYSCORE, SISMEMBER, ZADD and SADD to the count."""
    valkey, store = own_valkey, await open_store(own_valkey.url)
    try:
        await _keep_leases_alive(valkey, store, ids_mode)
    finally:
        await store.redis.aclose()


async def _keep_leases_alive(valkey: ValkeyServer, store: QueueStore, ids_mode: str) -> None:
    # a lease long enough that a loaded machine's stall between two beats costs none (the count is per second)
    queue, n, lease_ms, window = "hb", 10_000, 6_000, 8.0
    await store.enqueue_many(queue, [JobSpec({"n": i}) for i in range(n)])
    jobs = await store.claim(queue, "w-hb", n, lease_ms)
    assert len(jobs) == n
    held = [j.id for j in jobs] if ids_mode == "all" else []
    await store.heartbeat(queue, "w-hb", held, lease_ms)  # scripts loaded: no NOSCRIPT round trip inside
    interval = lease_ms / 3000
    admin = valkey.client(decode_responses=True)
    admin.config_resetstat()
    t0 = time.monotonic()
    beats = 0
    while (due := t0 + beats * interval) < t0 + window:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        reply = await store.heartbeat(queue, "w-hb", held, lease_ms)
        assert reply.lost == []
        beats += 1
    await asyncio.sleep(max(0.0, t0 + window - time.monotonic()))
    elapsed = time.monotonic() - t0
    stats = admin.info("commandstats")
    admin.close()

    total = sum(s["calls"] for s in stats.values())
    scripts = {k: s for k, s in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")}
    script_calls = sum(s["calls"] for s in scripts.values())
    # Client calls: the heartbeat scripts plus this test's own INFO; everything else ran inside the scripts.
    top_level = script_calls + sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("info", "config|resetstat"))
    usec_per_beat = sum(s["usec"] for s in scripts.values()) / script_calls
    inner = total - top_level
    print(
        f"\n[heartbeat ids={ids_mode}] {n} leases, lease {lease_ms} ms, "
        f"{beats} heartbeats in {elapsed:.2f}s: "
        f"{top_level / elapsed:.1f} client calls/s, {total / elapsed:.1f} server commands/s in total "
        f"({inner} run inside scripts); {usec_per_beat:.0f} usec server time per heartbeat; "
        f"by command: { {k[8:]: s['calls'] for k, s in stats.items()} }"
    )
    assert script_calls == beats
    assert top_level / elapsed < 20
    if ids_mode == "none":  # the worker's routine upkeep: liveness only
        assert total / elapsed < 20, "lease upkeep must not grow with the number of jobs held"
    else:  # verifying all 10,000 leases: a handful of set lookups per heartbeat, not one per job (fixed: TIME,
        # the silence stamp, the worker's deadline, its excuse, the reap scan, SCARD, the sequence number = 7,
        # plus one ZMSCORE per 3,999 leases)
        assert inner / beats <= 10, "lease verification must not cost a command per job"

    # None reaped: a maintenance pass finds nothing, every job is still active under its lease.
    _, reaped, _ = await store.reap(queue)
    counts = (await store.stats(queue)).counts
    assert (reaped, counts["active"], counts["queued"]) == (0, n, 0)
    assert (await store.heartbeat(queue, "w-hb", [j.id for j in jobs], lease_ms)).lost == []
