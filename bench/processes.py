"""The processes a benchmark starts, stops and measures: children in their own sessions (stopped in order on
exit, and on Linux when the bench itself dies), a private Valkey, the simulator, and a process's CPU time and
memory (`ProcStats`). Benchmarks run as scripts (`python bench/<name>.py`) import it as `processes`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import redis

from bench import web

try:
    import psutil
except ImportError:  # not a dependency: fall back to /proc
    psutil = None

HOST = "127.0.0.1"
T = TypeVar("T")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Timeout)\b[^\n]*$", re.MULTILINE)
LOGGED = re.compile(r"^\S+ \S+ (?:WARNING|ERROR) (.*)$", re.MULTILINE)
ID = re.compile(r"[\w.-]*[0-9a-f]{16,}[\w.-]*")
# Settings a worker would pick up from the environment; the bench's own config file must be all it sees.
TUTORIAL_ENV = (
    "REDIS_URL",
    "QUEUE_KEY",
    "GPU_API_BASE",
    "GPU_API_KEY",
    "S3_ENDPOINT",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "RESULT_BUCKET",
    "MAX_ATTEMPTS",
    "DAILY_JOB_CAP",
    "POLL_INTERVAL",
    "POLL_TIMEOUT",
)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the bench dies without cleaning up (Linux only)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_") and k not in TUTORIAL_ENV}


class Processes:
    """Children in their own sessions (a Ctrl-C reaches only the bench, which stops them in order)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env or child_env(),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        self.procs.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def errors(self, name: str, top: int = 5) -> str:
        """Exceptions (last line of each traceback) and warnings/errors in a child's log, ids masked, most
        frequent first, with counts."""
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        found = Counter(m.group(0) for m in EXCEPTION_LINE.finditer(text))
        found.update(ID.sub("<id>", m.group(1)) for m in LOGGED.finditer(text))
        return "\n".join(f"{n:7d} x {line[:200]}" for line, n in found.most_common(top)) or "(none logged)"

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):  # worker first, then the simulator, then Valkey
            with contextlib.suppress(Exception):
                self.stop(proc)


def run_in_workdir(prefix: str, keep: bool, run: Callable[[Path], Coroutine[Any, Any, T]]) -> T:
    """`run(workdir)` on a fresh event loop in a new temporary directory, removed afterwards unless `keep` (its
    path is then printed to stderr); a SIGTERM exits through the same cleanup."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        return asyncio.run(run(workdir))
    finally:
        if keep:
            print(f"work directory: {workdir}", file=sys.stderr)
        else:
            with contextlib.suppress(OSError):
                shutil.rmtree(workdir)


def wait_until(
    ready: Any, proc: subprocess.Popen[bytes], what: str, procs: Processes, name: str, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if ready():
                return
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}:\n{procs.log_tail(name)}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not ready after {timeout:g}s:\n{procs.log_tail(name)}")
        time.sleep(0.05)


def start_valkey(procs: Processes) -> str:
    from offload.local.embedded import server_argv, server_env

    port = free_port()
    data = procs.workdir / "valkey"
    data.mkdir()
    proc = procs.start(
        "valkey",
        server_argv(port, data, bind=HOST),
        server_env(child_env()),
    )
    url = f"redis://{HOST}:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        wait_until(client.ping, proc, "valkey", procs, "valkey")
    finally:
        client.close()
    return url


def start_sim(procs: Processes, latency: float) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = procs.start(
        "sim",
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
    )
    url = f"http://{HOST}:{port}"
    wait_until(lambda: web.get(f"{url}/_sim/health", timeout=1).status_code == 200, proc, "simulator", procs, "sim")
    return url, proc


# -- measuring a process ---------------------------------------------------------------------------


class ProcStats:
    """CPU seconds (user + system) and memory of one process: psutil when installed, else /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._ps = psutil.Process(pid) if psutil else None
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def cpu_seconds(self) -> float:
        if self._ps is not None:
            t = self._ps.cpu_times()
            return float(t.user + t.system)
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime (fields 14, 15 of the line)

    def _status_kb(self, name: str) -> int | None:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(name + ":"):
                    return int(line.split()[1])
        return None

    def rss_bytes(self) -> int:
        if self._ps is not None:
            return int(self._ps.memory_info().rss)
        return (self._status_kb("VmRSS") or 0) * 1024

    def peak_rss_bytes(self) -> int | None:
        """The kernel's high-water mark (catches peaks between samples); None where /proc is missing."""
        kb = self._status_kb("VmHWM")
        return kb * 1024 if kb is not None else None
