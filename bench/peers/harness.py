"""Processes, the shared Valkey, and the three kinds of run: throughput, jobs in flight, SIGKILL recovery.

Each system gets its own Valkey database (the same server), flushed before each of its runs, so no run sees
another's keys. Workers and producers run as their own process groups, started with the system's venv and
`BENCH_REDIS_URL`; a worker is stopped (or "crashed") by SIGKILL to its whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.peers import offload_hooks
from bench.peers.systems import APPS, OFFLOAD_WEBHOOKS, System

HOST = "127.0.0.1"
POLL = 0.05
OFFLOAD_GPU_QUEUE = offload_hooks.QUEUE

PROBLEM = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Exception|Error\b")
MASK = re.compile(r"0x[0-9a-f]+|[0-9a-f]{8,}(?:-[0-9a-f]{4,})*|\d+(?:[.,:]\d+)*")

try:
    psutil: Any = importlib.import_module("psutil")
except ImportError:  # optional: without it worker CPU and memory are not reported
    psutil = None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Proc:
    """A child in its own process group, its output in a log file."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> None:
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL to the process and every process it started, as when its machine dies: its process group and
        every descendant (RQ's work horse, for one, runs in a session of its own)."""
        family = descendants(self.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in family:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def problems(self, since: int = 0, top: int = 3) -> list[tuple[str, int]]:
        """The most frequent warning/error lines of the log after byte `since` (numbers and ids masked)."""
        try:
            with self.log.open("rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        found: dict[str, int] = {}
        for line in text.splitlines():
            if PROBLEM.search(line):
                key = MASK.sub("#", line.strip())[:160]
                found[key] = found.get(key, 0) + 1
        return sorted(found.items(), key=lambda kv: -kv[1])[:top]

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Usage:
    """CPU seconds and peak RSS of a process tree, sampled (psutil; None without it)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid) if psutil else None
        self.seen: dict[int, Any] = {}
        self.cpu: dict[int, float] = {}
        self.peak_rss = 0

    def sample(self) -> None:
        if self.root is None:
            return
        with contextlib.suppress(Exception):
            procs = [self.root, *self.root.children(recursive=True)]
            rss = 0
            for p in procs:
                with contextlib.suppress(Exception):
                    t = p.cpu_times()
                    self.cpu[p.pid] = float(t.user + t.system)
                    rss += int(p.memory_info().rss)
            self.peak_rss = max(self.peak_rss, rss)

    def cpu_seconds(self) -> float | None:
        return sum(self.cpu.values()) if self.root is not None else None

    def rss_mb(self) -> float | None:
        return round(self.peak_rss / 2**20, 1) if self.root is not None else None


class Bench:
    """The shared Valkey (and, when needed, the simulator) and a work directory for logs."""

    def __init__(self, workdir: Path | None = None, offload_lease_ms: int | None = None) -> None:
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="offload-peers-"))
        self.offload_lease_ms = offload_lease_ms  # None: offload's default lease (10 s)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.valkey: Proc | None = None
        self.port = 0
        self.sims: dict[float, tuple[Proc, str]] = {}
        self._n = 0
        self._lock = threading.Lock()

    # -- services ------------------------------------------------------------------------------------------

    def start_valkey(self) -> str:
        from offload.local.embedded import server_argv, server_env

        self.port = free_port()
        data = self.workdir / "valkey"
        data.mkdir(exist_ok=True)
        self.valkey = Proc(
            server_argv(self.port, data, bind=HOST, extra=("--databases", "16")),
            self.logs / "valkey.log",
            server_env(),
        )
        self._wait(lambda: redis.Redis(host=HOST, port=self.port).ping(), self.valkey, "valkey")
        return self.valkey_version()

    def valkey_version(self) -> str:
        from offload.local.embedded import server_binary

        out = subprocess.run([str(server_binary()), "--version"], capture_output=True, text=True).stdout
        return next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), out.strip())

    def url(self, db: int) -> str:
        return f"redis://{HOST}:{self.port}/{db}"

    def client(self, db: int) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, db=db, decode_responses=True)

    def sim(self, latency: float) -> str:
        """A simulator whose jobs take `latency` seconds (one per latency, started on first use)."""
        if latency not in self.sims:
            port = free_port()
            proc = self.start(
                [
                    sys.executable,
                    "-m",
                    "offload",
                    "sim",
                    "serve",
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "--latency",
                    f"{latency:g}",
                    "--log-level",
                    "warning",
                ],
                f"sim-{latency:g}",
                None,
            )
            url = f"http://{HOST}:{port}"
            self._wait(lambda: httpx.get(f"{url}/_sim/health", timeout=1).status_code == 200, proc, "simulator")
            self.sims[latency] = (proc, url)
        return self.sims[latency][1]

    def _wait(self, ready: Any, proc: Proc, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                if ready():
                    return
            if not proc.alive():
                raise RuntimeError(f"{what} exited:\n{proc.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout:g}s:\n{proc.tail()}")
            time.sleep(0.05)

    # -- processes -----------------------------------------------------------------------------------------

    def start(
        self, argv: list[str], name: str, system: System | None, db: int = 0, extra_env: dict[str, str] | None = None
    ) -> Proc:
        with self._lock:
            self._n += 1
            log = self.logs / f"{self._n:03d}-{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_", "VIRTUAL_ENV"))}
        env.update({"BENCH_REDIS_URL": self.url(db), "PYTHONUNBUFFERED": "1"})
        if system is not None:
            env["PYTHONPATH"] = str(APPS)
            env.update(system.env)
            if system.venv is not None:
                env["PATH"] = f"{system.venv / 'bin'}:{env.get('PATH', '')}"
        env.update(extra_env or {})
        proc = Proc(argv, log, env, cwd=APPS if system is not None else None)
        with self._lock:
            self.procs.append(proc)
        return proc

    def worker(self, system: System, db: int, concurrency: int, tag: str) -> Proc:
        return self.start(
            [system.python, str(APPS / system.app), system.worker, str(concurrency)],
            f"{system.name}-{tag}-worker",
            system,
            db,
        )

    def producer(self, system: System, db: int, run: str, n: int, sleep_s: float, track: bool) -> Proc:
        timeout = 0 if sleep_s < 5 else int(sleep_s * 4)  # only SAQ needs it: its default job timeout is 10 s
        return self.start(
            [
                system.python,
                str(APPS / system.app),
                "produce",
                run,
                str(n),
                f"{sleep_s:g}",
                "1" if track else "0",
                str(timeout),
            ],
            f"{system.name}-{run}-producer",
            system,
            db,
        )

    def offload_config(self, db: int, sim_url: str, concurrency: int, tag: str, public_url: str | None = None) -> Path:
        """Write offload's config for (c) or the SIGKILL test (see offload_hooks.py): polling, or webhooks on."""
        path = self.workdir / f"offload-{tag}.yaml"
        results = self.workdir / f"results-{tag}"
        path.write_text(json.dumps(offload_hooks.config(self.url(db), sim_url, results, concurrency, public_url)))
        return path

    def offload_server(self, config: Path, port: int, tag: str) -> Proc:
        """The real `offload server` on `port` (the config's public URL), answering /healthz."""
        proc = self.start(offload_hooks.server_argv(config, port), f"offload-{tag}-server", None)
        url = f"http://{HOST}:{port}/healthz"
        self._wait(lambda: httpx.get(url, timeout=1).status_code == 200, proc, "offload server")
        return proc

    def offload_worker(self, config: Path, concurrency: int, tag: str) -> Proc:
        """The real `offload worker` against the simulator, with a config from `offload_config`."""
        return self.start(
            [
                sys.executable,
                "-m",
                "offload",
                "worker",
                "--queue",
                OFFLOAD_GPU_QUEUE,
                "--config",
                str(config),
                "--concurrency",
                str(concurrency),
                "--grace",
                "1",
                "--log-level",
                "warning",
            ],
            f"offload-{tag}-worker",
            None,
            0,
            {"OFFLOAD_LEASE_MS": str(self.offload_lease_ms)} if self.offload_lease_ms else None,
        )

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.alive():
                proc.kill()
        for proc, _ in self.sims.values():
            proc.kill()
        if self.valkey is not None:
            self.valkey.kill()


# -- results ---------------------------------------------------------------------------------------------------


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
        deadline = time.monotonic() + 150  # worker start-up + warm-up job
        while (t0 := _float(client.get(f"bench:{rid}:t0"))) is None:
            if not producer.alive() and producer.popen.returncode != 0:
                raise RuntimeError(f"producer failed:\n{producer.tail()}")
            if not worker.alive():
                raise RuntimeError(f"worker exited:\n{worker.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no warm-up within 150 s\nworker:\n{worker.tail()}\nproducer:\n{producer.tail()}")
            time.sleep(POLL)
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
    from offload.connection import connect
    from offload.queue.specs import JobSpec
    from offload.queue.store import QueueStore

    bench.client(db).flushdb()
    sim_url = bench.sim(sleep_s)
    tag = f"gpu{rep}" + ("-hooks" if webhooks else "")
    run = Run(OFFLOAD_WEBHOOKS if webhooks else "offload", "gpu", rep, n, concurrency)
    server: Proc | None = None
    if webhooks:
        httpx.post(f"{sim_url}/_sim/webhooks", json={"replicate_secret": offload_hooks.SECRET}).raise_for_status()
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

    async def go() -> None:
        r = await connect(bench.url(db))
        store = QueueStore(r)
        try:
            deadline = time.monotonic() + 60
            while (await store.stats(OFFLOAD_GPU_QUEUE)).workers < 1:
                if not worker.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"offload worker not serving:\n{worker.tail()}")
                await asyncio.sleep(POLL)
            usage.sample()
            sim_usage.sample()
            cpu0, sim0 = usage.cpu_seconds(), sim_usage.cpu_seconds()
            specs = [JobSpec(input={"id": f"g{rep}-{i}", "n": i}, retention=3600) for i in range(n)]
            ids: list[str] = []
            t0 = time.time()
            for k in range(0, n, 5_000):
                ids += await store.enqueue_many(OFFLOAD_GPU_QUEUE, specs[k : k + 5_000])
            run.enqueue_s = time.time() - t0
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
                    break
                if not worker.alive():
                    raise RuntimeError(f"offload worker exited:\n{worker.tail()}")
                await asyncio.sleep(0.1)
            usage.sample()
            sim_usage.sample()
            cpu1, sim1 = usage.cpu_seconds(), sim_usage.cpu_seconds()
            run.worker_cpu_s = round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None
            run.sim_cpu_s = round(sim1 - sim0, 2) if sim0 is not None and sim1 is not None else None
            run.worker_rss_mb = usage.rss_mb()
            run.jobs_per_s = run.done / run.seconds if run.seconds else 0.0
        finally:
            await r.aclose()

    try:
        asyncio.run(go())
    except Exception as exc:
        run.error = str(exc)[:2000]
    finally:
        worker.kill()
        run.log_problems = worker.problems()
        if server is not None:
            server.kill()
            run.log_problems = _merge(run.log_problems, server.problems())
    return run


# -- durability ------------------------------------------------------------------------------------------------


@dataclass
class Crash:
    system: str
    n: int
    sleep_s: float
    concurrency: int
    cap: float
    in_flight_at_kill: int = 0
    done_at_kill: int = 0
    lost: int = 0  # in flight at the kill, never finished within the cap
    rerun: int = 0  # in flight at the kill, started again (the work paid twice)
    duplicated: int = 0  # finished more than once
    unfinished: int = 0  # not finished within the cap (lost ones included)
    all_done_s: float | None = None  # kill -> every job finished; None: not within the cap
    samples: list[tuple[float, int]] = field(default_factory=list)  # (s since kill, jobs finished)
    log_problems: list[tuple[str, int]] = field(default_factory=list)  # both workers' warnings and errors
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _merge(*lists: list[tuple[str, int]]) -> list[tuple[str, int]]:
    total: dict[str, int] = {}
    for items in lists:
        for key, n in items:
            total[key] = total.get(key, 0) + n
    return sorted(total.items(), key=lambda kv: -kv[1])[:3]


def _counts(client: redis.Redis, key: str) -> dict[str, int]:
    return {str(k): int(v) for k, v in client.hgetall(key).items()}


def crash_peer(bench: Bench, system: System, db: int, crash: Crash, kill_after: float) -> Crash:
    """Start a worker, enqueue, SIGKILL the worker `kill_after` s after its budget of jobs started, start a
    new one at once, and watch every job's starts and ends (written to Valkey by the job as it happens)."""
    client = bench.client(db)
    client.flushdb()
    rid = f"{system.name}-crash"
    worker = bench.worker(system, db, crash.concurrency, "crash1")
    producer = bench.producer(system, db, rid, crash.n, crash.sleep_s, True)
    second: Proc | None = None
    try:
        target = 1 if system.one_at_a_time else min(crash.concurrency, crash.n)
        deadline = time.monotonic() + 150
        while client.hlen(f"bench:{rid}:starts") < target:
            if time.monotonic() > deadline or not worker.alive():
                raise RuntimeError(f"jobs did not start\nworker:\n{worker.tail()}\nproducer:\n{producer.tail()}")
            time.sleep(POLL)
        time.sleep(kill_after)
        worker.kill()
        t_kill = time.time()
        starts0, ends0 = _counts(client, f"bench:{rid}:starts"), _counts(client, f"bench:{rid}:ends")
        second = bench.worker(system, db, crash.concurrency, "crash2")
        in_flight = {i for i in starts0 if ends0.get(i, 0) == 0}
        crash.in_flight_at_kill, crash.done_at_kill = len(in_flight), len(ends0)
        while True:
            now = time.time() - t_kill
            ends = _counts(client, f"bench:{rid}:ends")
            crash.samples.append((round(now, 2), len(ends)))
            if crash.all_done_s is None and len(ends) >= crash.n:
                crash.all_done_s = now
            if now > crash.cap:
                break
            time.sleep(0.5)
        starts = _counts(client, f"bench:{rid}:starts")
        crash.lost = sum(1 for i in in_flight if ends.get(i, 0) == 0)
        crash.rerun = sum(1 for i in in_flight if starts.get(i, 0) > 1)
        crash.duplicated = sum(1 for v in ends.values() if v > 1)
        crash.unfinished = crash.n - len(ends)
    except Exception as exc:
        crash.error = str(exc)[:2000]
    finally:
        for proc in (worker, producer, second):
            if proc is not None and proc.alive():
                proc.kill()
        client.close()
        crash.log_problems = _merge(worker.problems(), second.problems() if second else [])
    return crash


def crash_offload(bench: Bench, db: int, crash: Crash, kill_after: float) -> Crash:
    """The same with the real `offload worker` against the simulator: a job's start is its remote submission
    (counted by the simulator per job), its end is `succeeded`."""
    from offload.connection import connect
    from offload.queue.keyspace import prefix
    from offload.queue.specs import JobSpec
    from offload.queue.store import QueueStore

    client = bench.client(db)
    client.flushdb()
    sim_url = bench.sim(crash.sleep_s)
    config = bench.offload_config(db, sim_url, crash.concurrency, "crash")
    worker = bench.offload_worker(config, crash.concurrency, "crash1")
    second: Proc | None = None
    tag = f"crash{os.getpid()}-{time.time_ns()}"

    def submissions() -> dict[str, int]:
        by_id: dict[str, int] = httpx.get(f"{sim_url}/_sim/stats", timeout=10).json()["submissions_by_input_id"]
        return {k.rsplit("-", 1)[1]: v for k, v in by_id.items() if k.startswith(tag)}

    async def enqueue() -> list[str]:
        r = await connect(bench.url(db))
        store = QueueStore(r)
        try:
            deadline = time.monotonic() + 60
            while (await store.stats(OFFLOAD_GPU_QUEUE)).workers < 1:
                if not worker.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"offload worker not serving:\n{worker.tail()}")
                await asyncio.sleep(POLL)
            specs = [JobSpec(input={"id": f"{tag}-{i}"}, retention=3600) for i in range(crash.n)]
            return await store.enqueue_many(OFFLOAD_GPU_QUEUE, specs)
        finally:
            await r.aclose()

    succeeded_key = prefix(OFFLOAD_GPU_QUEUE) + "succeeded"
    try:
        ids = asyncio.run(enqueue())
        index = {job_id: str(i) for i, job_id in enumerate(ids)}

        def ends() -> set[str]:
            return {index[j] for j in client.zrange(succeeded_key, 0, -1) if j in index}

        target = min(crash.concurrency, crash.n)
        deadline = time.monotonic() + 60
        while len(submissions()) < target:
            if time.monotonic() > deadline or not worker.alive():
                raise RuntimeError(f"jobs did not start\nworker:\n{worker.tail()}")
            time.sleep(POLL)
        time.sleep(kill_after)
        worker.kill()
        t_kill = time.time()
        starts0, ends0 = submissions(), ends()
        second = bench.offload_worker(config, crash.concurrency, "crash2")
        in_flight = {i for i in starts0 if i not in ends0}
        crash.in_flight_at_kill, crash.done_at_kill = len(in_flight), len(ends0)
        while True:
            now = time.time() - t_kill
            done = ends()
            crash.samples.append((round(now, 2), len(done)))
            if crash.all_done_s is None and len(done) >= crash.n:
                crash.all_done_s = now
            if now > crash.cap:
                break
            time.sleep(0.5)
        starts = submissions()
        totals = client.hgetall(prefix(OFFLOAD_GPU_QUEUE) + "stats")
        crash.lost = sum(1 for i in in_flight if i not in done)
        crash.rerun = sum(1 for i in in_flight if starts.get(i, 0) > 1)
        crash.duplicated = max(int(totals.get("succeeded", 0)) - len(done), 0)
        crash.unfinished = crash.n - len(done)
    except Exception as exc:
        crash.error = str(exc)[:2000]
    finally:
        for proc in (worker, second):
            if proc is not None and proc.alive():
                proc.kill()
        client.close()
        crash.log_problems = _merge(worker.problems(), second.problems() if second else [])
    return crash
