"""The peer benchmark's harness: its processes, the shared Valkey, the simulator and the offload server and
worker; the runs themselves are in sessions.py (throughput, jobs in flight) and crash.py (SIGKILL recovery).

Each system gets its own Valkey database (the same server), flushed before each of its runs, so no run sees
another's keys. Workers and producers run as their own process groups, started with the system's venv and
`BENCH_REDIS_URL`; a worker is stopped (or "crashed") by SIGKILL to its whole group.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

import redis

from bench import web
from bench.peers import offload_hooks
from bench.peers.systems import APPS, System

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
            self._wait(lambda: web.get(f"{url}/_sim/health", timeout=1).status_code == 200, proc, "simulator")
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
        self._wait(lambda: web.get(url, timeout=1).status_code == 200, proc, "offload server")
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


def merge_problems(*lists: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The three most frequent problems over several processes' logs."""
    total: dict[str, int] = {}
    for items in lists:
        for key, n in items:
            total[key] = total.get(key, 0) + n
    return sorted(total.items(), key=lambda kv: -kv[1])[:3]
