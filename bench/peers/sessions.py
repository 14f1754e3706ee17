"""The timed runs of the peer benchmark: (a) and (b) throughput, one worker serving no-op and I/O-wait jobs in
turn (`throughput_session`), and (c) jobs in flight, long jobs against the simulator for offload
(`offload_gpu_session`) or sleeping jobs for a peer (`gpu_session`). Each returns a `Run` per workload."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from bench import web
from bench.peers import offload_hooks
from bench.peers.harness import HOST, OFFLOAD_GPU_QUEUE, POLL, Bench, Proc, Usage, free_port, merge_problems
from bench.peers.systems import OFFLOAD_WEBHOOKS, System


@dataclass
class Run:
    system: str
    workload: str
    rep: int
    n: int
    concurrency: int
    done: int = 0
    seconds: float = 0.0  # first enqueue -> last job done, by the system's own clock record (or -> the cap)
    detected_s: float | None = None  # offload's (c): first enqueue -> the harness saw every job done (0.1 s polls)
    enqueue_s: float | None = None
    jobs_per_s: float = 0.0
    peak_in_flight: int = 0
    peak_claimed: int | None = None  # offload's (c): claimed jobs; peak_in_flight counts those submitted
    capped: bool = False  # not all done within the cap: jobs_per_s is done / cap
    worker_cpu_s: float | None = None
    worker_rss_mb: float | None = None
    valkey_cpu_us_per_job: float | None = None  # Valkey's CPU over the run (enqueue and process) per job done
    sim_cpu_s: float | None = None  # offload's (c): the simulator's CPU, on the same cores
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, in flight, done)
    log_problems: list[tuple[str, int]] = field(default_factory=list)  # the worker's warnings and errors
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def valkey_cpu(client: redis.Redis) -> float:
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _sum(values: list[Any]) -> int:
    return sum(int(v) for v in values)


def _float(value: Any) -> float | None:
    return float(value) if value is not None else None


def run_jobs(
    bench: Bench,
    system: System,
    db: int,
    worker: Proc,
    run: Run,
    sleep_s: float,
    cap: float,
    sample_every: float | None = None,
) -> Run:
    """One producer enqueues `run.n` jobs of `sleep_s` seconds to a running worker; wait until all are done or
    `cap` seconds have passed since the first enqueue. Reads the counters the worker process reports."""
    client = bench.client(db)
    rid = f"{system.name}-{run.workload}-{run.rep}"
    log_from = worker.size()
    producer = bench.producer(system, db, rid, run.n, sleep_s, False)
    usage = Usage(worker.pid)
    try:
        t0 = _warmed_up(client, rid, worker, producer)
        usage.sample()
        cpu0 = usage.cpu_seconds()
        valkey0 = valkey_cpu(client)
        next_sample = 0.0
        while True:
            now = time.time()
            finished = _float(client.get(f"bench:{rid}:finished"))
            if sample_every is not None and (now - t0 >= next_sample or finished):
                inflight = _sum(client.hvals(f"bench:{rid}:inflight"))
                run.samples.append((round(now - t0, 2), inflight, _sum(client.hvals(f"bench:{rid}:done"))))
                next_sample += sample_every
                usage.sample()
            if finished is not None:
                run.seconds = finished - t0
                break
            if now - t0 > cap:
                run.seconds, run.capped = now - t0, True
                break
            if not worker.alive():
                raise RuntimeError(f"worker exited:\n{worker.tail()}")
            time.sleep(POLL)
        valkey1 = valkey_cpu(client)
        time.sleep(2 * 0.1)  # the reporter's last write
        usage.sample()
        run.done = min(_sum(client.hvals(f"bench:{rid}:done")), run.n)
        run.valkey_cpu_us_per_job = round((valkey1 - valkey0) * 1e6 / run.done, 1) if run.done else None
        run.peak_in_flight = max([int(v) for v in client.hvals(f"bench:{rid}:peak")] or [0])
        run.jobs_per_s = run.done / run.seconds if run.seconds > 0 else 0.0
        t_enq = _float(client.get(f"bench:{rid}:t_enq"))
        run.enqueue_s = t_enq - t0 if t_enq is not None else None
        cpu1 = usage.cpu_seconds()
        run.worker_cpu_s = round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None
        run.worker_rss_mb = usage.rss_mb()
    except Exception as exc:
        run.error = str(exc)[:2000]
    finally:
        if producer.alive():
            producer.kill()
        client.close()
        run.log_problems = worker.problems(log_from)
    return run


def _warmed_up(client: redis.Redis, rid: str, worker: Proc, producer: Proc) -> float:
    """When the producer's first enqueue went out, once the worker has run its warm-up job."""
    deadline = time.monotonic() + 150  # worker start-up + warm-up job
    while (t0 := _float(client.get(f"bench:{rid}:t0"))) is None:
        if not producer.alive() and producer.popen.returncode != 0:
            raise RuntimeError(f"producer failed:\n{producer.tail()}")
        if not worker.alive():
            raise RuntimeError(f"worker exited:\n{worker.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no warm-up within 150 s\nworker:\n{worker.tail()}\nproducer:\n{producer.tail()}")
        time.sleep(POLL)
    return t0


def throughput_session(
    bench: Bench,
    system: System,
    db: int,
    rep: int,
    workloads: list[tuple[str, int, float]],
    concurrency: int,
    cap: float,
) -> list[Run]:
    """(a) and (b) for one system: one worker serves the workloads in turn (restarted after a capped run, so
    leftovers of one workload never count toward the next)."""
    results: list[Run] = []
    worker: Proc | None = None
    try:
        for name, n, sleep_s in workloads:
            if worker is None:
                bench.client(db).flushdb()
                worker = bench.worker(system, db, concurrency, f"{name}{rep}")
            run = run_jobs(bench, system, db, worker, Run(system.name, name, rep, n, concurrency), sleep_s, cap)
            results.append(run)
            if run.capped or run.error:
                worker.kill()
                worker = None
    finally:
        if worker is not None:
            worker.kill()
    return results


def gpu_session(
    bench: Bench, system: System, db: int, rep: int, n: int, sleep_s: float, concurrency: int, cap: float
) -> Run:
    """(c) for a peer: `n` jobs of `sleep_s` seconds, the concurrency knob at `concurrency`; in flight sampled."""
    bench.client(db).flushdb()
    worker = bench.worker(system, db, concurrency, f"gpu{rep}")
    try:
        return run_jobs(
            bench, system, db, worker, Run(system.name, "gpu", rep, n, concurrency), sleep_s, cap, sample_every=0.5
        )
    finally:
        worker.kill()


async def last_finished(r: Any, ids: list[str]) -> float:
    """When the last of `ids` finished (s, epoch), from the `finished_at` Valkey stamped on each record in the
    script that marked it succeeded, after its result was stored: offload's counterpart of the peers' reporter,
    which stamps the moment the n-th job body returned. The harness's own 0.1 s polls would add up to 0.1 s."""
    from offload.queue import keyspace

    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(keyspace.job(OFFLOAD_GPU_QUEUE, job_id), "finished_at")
    stamps = [int(v) for v in await pipe.execute() if v is not None]
    if len(stamps) < len(ids):
        raise RuntimeError(f"{len(ids) - len(stamps)} finished jobs have no finished_at")
    return max(stamps) / 1000


def offload_gpu_session(
    bench: Bench, db: int, rep: int, n: int, sleep_s: float, concurrency: int, cap: float, *, webhooks: bool = False
) -> Run:
    """(c) for offload: the real `offload worker` against the simulator, polling, or with `webhooks` (and the
    real `offload server` receiving them; see offload_hooks.py), reported as system OFFLOAD_WEBHOOKS. In flight
    = jobs whose remote job was submitted (state `submitted`: remote id recorded, running at the provider), from
    the queue's own counts; the jobs claimed (active + submitted) are recorded beside it."""
    bench.client(db).flushdb()
    sim_url = bench.sim(sleep_s)
    tag = f"gpu{rep}" + ("-hooks" if webhooks else "")
    run = Run(OFFLOAD_WEBHOOKS if webhooks else "offload", "gpu", rep, n, concurrency)
    server: Proc | None = None
    if webhooks:
        web.post(f"{sim_url}/_sim/webhooks", json={"replicate_secret": offload_hooks.SECRET}).raise_for_status()
        port = free_port()
        config = bench.offload_config(db, sim_url, concurrency, tag, f"http://{HOST}:{port}")
        try:
            server = bench.offload_server(config, port, tag)
        except RuntimeError as exc:
            run.error = str(exc)[:2000]
            return run
    else:
        config = bench.offload_config(db, sim_url, concurrency, tag)
    worker = bench.offload_worker(config, concurrency, tag)
    usage = Usage(worker.pid)
    sim_usage = Usage(bench.sims[sleep_s][0].pid)
    try:
        asyncio.run(_offload_gpu_run(bench.url(db), rep, run, cap, worker, usage, sim_usage))
    except Exception as exc:
        run.error = str(exc)[:2000]
    finally:
        worker.kill()
        run.log_problems = worker.problems()
        if server is not None:
            server.kill()
            run.log_problems = merge_problems(run.log_problems, server.problems())
    return run


async def offload_serving(store: Any, worker: Proc) -> None:
    """Until the offload worker has registered in the GPU queue's worker set (60 s at most)."""
    deadline = time.monotonic() + 60
    while (await store.stats(OFFLOAD_GPU_QUEUE)).workers < 1:
        if not worker.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"offload worker not serving:\n{worker.tail()}")
        await asyncio.sleep(POLL)


async def _offload_gpu_run(
    url: str, rep: int, run: Run, cap: float, worker: Proc, usage: Usage, sim_usage: Usage
) -> None:
    """Enqueue `run.n` jobs once the worker serves, watch them to the end or `cap`, and note the CPU used."""
    from offload.connection import connect
    from offload.queue.specs import JobSpec
    from offload.queue.store import QueueStore

    r = await connect(url)
    store = QueueStore(r)
    try:
        await offload_serving(store, worker)
        usage.sample()
        sim_usage.sample()
        cpu0, sim0 = usage.cpu_seconds(), sim_usage.cpu_seconds()
        specs = [JobSpec(input={"id": f"g{rep}-{i}", "n": i}, retention=3600) for i in range(run.n)]
        ids: list[str] = []
        t0 = time.time()
        for k in range(0, run.n, 5_000):
            ids += await store.enqueue_many(OFFLOAD_GPU_QUEUE, specs[k : k + 5_000])
        run.enqueue_s = time.time() - t0
        await _watch_gpu_run(r, store, run, ids, t0, cap, worker, usage)
        usage.sample()
        sim_usage.sample()
        cpu1, sim1 = usage.cpu_seconds(), sim_usage.cpu_seconds()
        run.worker_cpu_s = round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None
        run.sim_cpu_s = round(sim1 - sim0, 2) if sim0 is not None and sim1 is not None else None
        run.worker_rss_mb = usage.rss_mb()
        run.jobs_per_s = run.done / run.seconds if run.seconds else 0.0
    finally:
        await r.aclose()


async def _watch_gpu_run(
    r: Any, store: Any, run: Run, ids: list[str], t0: float, cap: float, worker: Proc, usage: Usage
) -> None:
    """Sample jobs in flight (submitted) and claimed every 0.5 s until all `run.n` succeeded or `cap` passed."""
    n = run.n
    next_sample = 0.0
    while True:
        now = time.time() - t0
        c = (await store.stats(OFFLOAD_GPU_QUEUE)).counts
        in_flight = c["submitted"]
        run.peak_in_flight = max(run.peak_in_flight, in_flight)
        run.peak_claimed = max(run.peak_claimed or 0, c["active"] + c["submitted"])
        done = c["succeeded"]
        if now >= next_sample or done >= n:
            run.samples.append((round(now, 2), in_flight, done))
            next_sample += 0.5
            usage.sample()
        if done >= n or now > cap:
            run.done, run.seconds, run.capped = done, now, done < n
            if not run.capped:
                run.detected_s = now
                run.seconds = await last_finished(r, ids) - t0
            return
        if not worker.alive():
            raise RuntimeError(f"offload worker exited:\n{worker.tail()}")
        await asyncio.sleep(0.1)
